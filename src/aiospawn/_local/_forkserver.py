"""multiprocessing's fork server, as a ``forkserver`` group without ``preload=`` uses it.

Two things make such a group start sooner, neither changing what its ranks
run:

* the server imports the rank bootstrap once, when it starts, instead of every
  rank importing it, and freezes its heap, so that ranks share its pages
  (:func:`preload_bootstrap`);
* the first ``forkserver`` call starts the server as soon as its arguments
  are checked, before it imports the supervisor's modules, so that the
  server's own start-up (a fresh interpreter importing ``multiprocessing``
  and the bootstrap) runs on another core meanwhile (:func:`start_early`).

The server may thus be running when a later check refuses the group (an
output directory, an ``env`` callable's result): it is ``multiprocessing``'s,
shared by every forkserver start of the process, and it ends with the process.
Light on purpose: this module is imported before the supervisor's modules.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os

__all__ = ["preload_bootstrap", "start_early", "started_here"]

#: What the server imports for us: the rank bootstrap, then its heap frozen.
_SERVER_PRELOAD = "aiospawn._rank.forkserver"

#: The process in which :func:`start_early` has started the server (a fork of it has none).
_started_in: int | None = None


def preload_bootstrap() -> None:
    """Have the fork server, when it starts, import the rank bootstrap once for all ranks.

    Each forkserver rank otherwise imports it for itself: 8 trivial ranks took
    126 ms rather than 69 ms here. Then the server freezes its heap
    (``aiospawn._rank.forkserver``): unfrozen, once a supervisor had started
    about 10 groups, each rank's start took 9.5 ms of CPU rather than 6, its
    collections walking (and copying) the server's pages. The user's own
    preload list is kept, and nothing changes once the server runs. The list
    lives in a private attribute (stable since Python 3.4); without it,
    nothing is done.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    modules = getattr(server, "_preload_modules", None)
    if isinstance(modules, list) and _SERVER_PRELOAD not in modules:
        multiprocessing.forkserver.set_forkserver_preload([*modules, _SERVER_PRELOAD])


def start_early() -> None:
    """Start the fork server now (with the bootstrap preloaded), if it is not running.

    Blocking (a fork, an exec, and a wait for the exec, a few milliseconds):
    call it from a worker thread. The server then starts up by itself. It is
    the server every ``forkserver`` start in this process uses anyway, and it
    ends with this process, as ``multiprocessing`` has it.

    Raises:
        OSError: The server could not be started (the rank starts would then
            fail the same way).
    """
    global _started_in
    preload_bootstrap()
    multiprocessing.forkserver.ensure_running()
    _started_in = os.getpid()


def started_here() -> bool:
    """True once :func:`start_early` has run in this process: later calls need not.

    Starting early helps only the first call, whose imports the server's
    start-up overlaps; later, :func:`start_early` would only cost a worker
    thread's round trip a group. A server that has died since is started
    again by the next rank start itself (``multiprocessing`` checks at each),
    from the same preload list.
    """
    return _started_in == os.getpid()
