"""The process's warm templates: leased by their preload list, stopped when idle.

- :func:`acquire` / :func:`release`: a group's start leases the template of
  its preload list, shared by every group of this process whose preload list,
  ``sys.path`` and environment agree; started on first use, started again if
  it died. A template's lease count is its starts under way and its ranks
  running (a rank forked takes one, :func:`hold`); one with none is idle, and
  idle templates are stopped (see :data:`IDLE_TIMEOUT` and :data:`MAX_TEMPLATES`).
- :func:`stop_all`: stop every template (at interpreter exit, and in tests).

A template's life, as a start sees it::

    acquire() ──► spawn (a worker thread: Process.start(), under the
                  template's own lock, never held across the import)
              ──► wait_ready() on the event loop: its control socket says
                  b"R" (ready) or b"E" (refused), or its pidfd says it died.
                  Cancellable: the import runs on in the template, and the
                  next start of the same key finds it, importing or ready.
              ──► fork() each rank (worker threads; the template answers at once)
    release() ──► idle once its ranks have ended too

The registry lock guards the table of templates and their lease counts only,
and is never held across anything that waits: unrelated groups never wait for
each other's imports.
"""

from __future__ import annotations

import atexit
import threading
import time

from aiospawn._core._log import logger

from ._template import Template, TemplateKey, describe, on_a_thread

#: Seconds after which an idle template (no start under way, no rank running)
#: is stopped, at the next warm start of this process.
IDLE_TIMEOUT = 300.0

#: The most templates this process keeps: beyond it, a warm start stops the
#: idle ones, the least recently used first (templates in use are never stopped).
MAX_TEMPLATES = 4


#: Every template of this process, by key; and the lock of that table and of
#: each template's ``users`` and ``last_used``. Never held across a wait.
_templates: dict[TemplateKey, Template] = {}
_registry_lock = threading.Lock()


async def acquire(preload: tuple[str, ...]) -> Template:
    """Lease the ready template of ``preload`` for this process's ``sys.path`` and environment.

    Started if there is none, or if the last one died; idle templates are
    stopped on the way (see :data:`IDLE_TIMEOUT`, :data:`MAX_TEMPLATES`).
    Give the lease back with :func:`release` once the group's ranks are
    forked: each rank holds the template until its exit is recorded.

    Raises:
        TemplateError: As :meth:`Template.spawn` and :meth:`Template.wait_ready`;
            a template that failed is stopped before it is raised.

    Cancellation: returns once the template's process exists (a spawn is
    never abandoned half-way); its import goes on, unleased.
    """
    key = TemplateKey.current(preload)
    with _registry_lock:
        template = _templates.get(key)
        stale = _stale(key)
        if template is None or template in stale:
            template = _templates[key] = Template(key)
        template.users += 1
    try:
        if template.process is None or stale:
            await on_a_thread(lambda: _prepare(template, stale))
        await template.wait_ready()
    except BaseException:
        release(template)
        if template.gone:
            with _registry_lock:
                if _templates.get(key) is template:
                    del _templates[key]
            await on_a_thread(template.stop)
        raise
    return template


def release(template: Template) -> None:
    """Give back one lease of ``template`` (a start's, or a rank's once it ended)."""
    with _registry_lock:
        template.users -= 1
        template.last_used = time.monotonic()


def hold(template: Template) -> None:
    """Take one more lease of ``template``: a rank forked from it."""
    with _registry_lock:
        template.users += 1


def _stale(key: TemplateKey) -> list[Template]:
    """Take out of the table the templates to stop: gone, or idle too long, or too many.

    Called under the registry lock; the template of ``key`` is kept unless it is gone.
    """
    now = time.monotonic()
    stale = []
    for other, template in list(_templates.items()):
        if template.gone:
            if template.pid is not None:
                logger.warning(
                    "warm-start template %s exited (%s)%s",
                    template.pid,
                    describe(template.exit_status()),
                    "; starting a new one" if other == key else "",
                )
            stale.append(_templates.pop(other))
        elif other != key and template.users == 0 and now - template.last_used >= IDLE_TIMEOUT:
            stale.append(_templates.pop(other))
    idle = sorted(
        (t for k, t in _templates.items() if k != key and t.users == 0),
        key=lambda t: t.last_used,
    )
    excess = len(_templates) + (key not in _templates) - MAX_TEMPLATES
    for template in idle[: max(0, excess)]:
        stale.append(_templates.pop(template.key))
    return stale


def _prepare(template: Template, stale: list[Template]) -> None:
    """Spawn ``template`` (if need be), then stop ``stale``. Blocking: on a worker thread."""
    try:
        template.spawn()
    finally:
        for old in stale:
            logger.debug("stopping warm-start template %s (%r)", old.pid, old)
            old.stop()


def stop_all() -> None:
    """Stop every template of this process (at exit; tests call it between tests)."""
    with _registry_lock:
        templates = list(_templates.values())
        _templates.clear()
    for template in templates:
        template.stop()


atexit.register(stop_all)


def running_templates() -> list[int]:
    """The pids of this process's templates (for tests and diagnostics)."""
    with _registry_lock:
        return [t.pid for t in _templates.values() if t.pid is not None]
