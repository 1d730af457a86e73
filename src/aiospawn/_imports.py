"""What a first call imports, and how: on a worker thread, never on the event loop.

The entry points (``_api``) import the supervisor's modules at their first
call, not with ``aiospawn``: first the checks (:data:`CHECKS`), then, once the
arguments passed them and a fork server (if any) is starting up, the
supervisor (:data:`SUPERVISOR`). :func:`import_off_the_loop` imports what is
missing on a worker thread; a later call finds it imported and pays nothing.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ._core._loops import runs_asyncio

#: The modules a first call imports to check its arguments, and then to
#: supervise the group (each pulls in what it needs: anyio, multiprocessing).
CHECKS = ("aiospawn._core._policy", "aiospawn._core._spec", "aiospawn._local._backend")
SUPERVISOR = (
    "aiospawn._core._context",
    "aiospawn._core._shutdown",
    "aiospawn._local._launcher",
    "aiospawn._local._strategy",
    "aiospawn._local._rank",
    "aiospawn._local._output",
    "aiospawn._local._link",
    "aiospawn._local._progress",
    "aiospawn._rank.bootstrap",
    "multiprocessing.spawn",
    "multiprocessing.popen_spawn_posix",
    "multiprocessing.resource_tracker",
)


async def import_off_the_loop(names: tuple[str, ...]) -> None:
    """Import ``names``, and anyio's backend for this loop, on a worker thread if not imported yet.

    A first call imports a few hundred milliseconds' worth of modules on a
    loaded machine (tens on a quiet one): on the loop, that would stall every
    other task of the program, a service's requests included. On a thread, the
    loop runs between the import's bytecodes. Later calls find them imported
    and pay nothing. A cancellation leaves the import to finish on its thread.

    Meanwhile the GIL changes hands after 1 ms instead of 5 (see
    :func:`_quick_handover`).
    """
    on_asyncio = runs_asyncio()
    # anyio imports its backend for this loop at the first anyio call: under
    # asyncio.run that is ours, 27-30 ms of the loop's CPU here (2 cores).
    backend = _ANYIO_BACKEND.format("asyncio" if on_asyncio else "trio")
    missing = [name for name in (backend, *names) if name not in sys.modules]
    if not missing:
        return
    with _quick_handover():
        if on_asyncio:
            import asyncio  # the caller's loop: imported already

            await asyncio.get_running_loop().run_in_executor(None, _import_all, missing)
        else:
            import trio  # the caller's loop: imported already

            await trio.to_thread.run_sync(_import_all, missing)


#: The module anyio's ``get_async_backend()`` imports for a loop (private to
#: anyio: if a release renames it, it is merely imported on the loop again).
_ANYIO_BACKEND = "anyio._backends._{}"


def _import_all(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            if not name.startswith(_ANYIO_BACKEND[:-2]):
                raise


#: The interpreter's switch interval while a first call imports (seconds).
HANDOVER = 0.001

_handover_lock = threading.Lock()
_importing = 0  # imports under way that asked for the quick handover
_restore = 0.0  # the switch interval to restore once the last one ends


@contextmanager
def _quick_handover() -> Iterator[None]:
    """Let the GIL change hands within 1 ms while an import thread holds it.

    A thread that wants the GIL waits ``sys.getswitchinterval()`` (5 ms by
    default) before it asks the holder to let go. The import runs on a
    thread, so the loop, woken meanwhile, waited up to that at every
    wake-up: the most a first ``forkserver`` call stalled it went from a
    median of 9.8 ms to 5.0 ms, none of 12 trials over 10 ms where 6 were
    (benchmarks/results.md, "The first call's import and the GIL"). The
    interval is process-wide: lowered while any first call imports, put
    back after the last one ends, unless somebody else set it meanwhile.
    """
    global _importing, _restore
    with _handover_lock:
        if _importing == 0:
            _restore = sys.getswitchinterval()
        _importing += 1
        lowered = min(_restore, HANDOVER)
        sys.setswitchinterval(lowered)
    try:
        yield
    finally:
        with _handover_lock:
            _importing -= 1
            if _importing == 0 and sys.getswitchinterval() == lowered:
                sys.setswitchinterval(_restore)
