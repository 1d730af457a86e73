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
    """
    on_asyncio = runs_asyncio()
    # anyio imports its backend for this loop at the first anyio call: under
    # asyncio.run that is ours, 27-30 ms of the loop's CPU here (2 cores).
    backend = _ANYIO_BACKEND.format("asyncio" if on_asyncio else "trio")
    missing = [name for name in (backend, *names) if name not in sys.modules]
    if not missing:
        return
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
