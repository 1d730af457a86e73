"""The rank bootstrap: what runs in a local rank's process around ``fn(rank, *args)``.

``multiprocessing`` (or a warm template) calls :func:`run_rank` in the new
process, which

1. sets the process up (``process``: its process group, signals, subreaper,
   under ``fork`` what it holds of the supervisor (``forked``), the guard
   that kills it once the supervisor is gone (``guard``), its environment,
   channel, heartbeat and output);
2. runs ``fn`` and says how it ended (``outcome``: the rule every backend
   shares); a ``fn`` sent by value is unpickled first (``payload``), and an
   ``async def fn`` runs on an event loop of its own (``async_main``, imported
   only then);
3. SIGKILLs every process ``fn`` started that still runs, wherever it went
   (``descendants``), sends what a cancelled send left on the channel, and
   only then its outcome, as one frame on its private pipe (``wire``): a
   rank's leftover processes end with the rank (when the supervisor dies,
   the guard kills them too);
4. ends the process as Python ends a program, short of its finalization.

The exit-code contract, row by row:

=====================================  ================  ==========================
``fn`` ...                             exit code         the supervisor reports
=====================================  ================  ==========================
returns ``value``                      0                 success, result ``value``
calls ``sys.exit()`` / ``sys.exit(0)`` 0                 success, result ``None``
calls ``sys.exit(n)``, 0 < n < 256     n                 ProcessExitedException
calls ``sys.exit(n)``, other n         1                 ProcessExitedException,
                                                         ``exit_code`` n (for n > 0)
                                                         and ``sys.exit(n)`` in the
                                                         message
calls ``sys.exit("text")``             1                 ProcessExitedException
                                                         with the text
raises (``KeyboardInterrupt`` too)     1                 ProcessRaisedException
returns an unpicklable value           1                 ProcessRaisedException
                                                         saying so
closes the pipe it reports on and      86 (or fn's own   ProcessExitedException
then ends (``os.closerange``)          non-zero code)    saying the outcome is lost
calls ``os._exit(0)``                  0                 success, result ``None``
calls ``os._exit(n)``, n != 0          n                 ProcessExitedException
is killed by a signal                  -signal           ProcessExitedException
is an ``async def`` cancelled by       -SIGTERM          ProcessExitedException
SIGTERM (its cleanup has run)                            (stopped by us)
=====================================  ================  ==========================

After ``fn``, the rank never returns into ``multiprocessing``, under any
start method. Under ``fork`` and ``forkserver`` what called the bootstrap is
a copy of the supervisor (or of the fork server), whose code must not run
again in the rank; under ``spawn`` a return ends in the interpreter's
finalization, where extension libraries' C++ static destructors may abort a
rank whose ``fn`` has finished. So every rank runs Python's exit steps
itself (non-daemon threads joined, the atexit handlers registered in the
rank, ``multiprocessing``'s finalizers, stdio flushed) and ends with
``os._exit`` (see ``ending``): a rank that finished reads as
finished. Not run: the interpreter's finalization (``__del__`` of what is
still alive, module teardown) and C-level exit handlers. The status is one
the kernel keeps as it is (0 to 255).

A rank's own descriptors (the result pipe, the stack pipe, the pidfd the
guard watches) are moved to numbers of at least :data:`~.fds.HIGH_FD`, away
from the low numbers that code reuses or closes (see ``fds``).

The rank-side package's rule holds here: standard library only, and nothing
that the supervisor needs (no anyio, no asyncio): a rank costs the
interpreter plus the user's own imports.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from . import api, descendants, ending
from .fds import identity, move_high
from .outcome import die_of_sigterm, run_fn

# The local launcher makes a rank's setup and payload with these names.
from .payload import early_environment as early_environment
from .payload import unpickle_in_rank as unpickle_in_rank
from .payload import unpickle_now as unpickle_now
from .process import RankSetup as RankSetup
from .process import prepare
from .wire import LOST_CHANNEL_STATUS, ChildEnd, Kind, encode_exception, ended_frame, header

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

    from .payload import Payload

#: Seconds a rank waits, once ``fn`` ended, for its leftover processes to die
#: of SIGKILL (only one stuck in the kernel takes that long).
LEFTOVER_PATIENCE = 5.0


def run_rank(
    fn: Callable[..., Any] | Payload,
    rank: int,
    args: tuple[Any, ...],
    channel: ChildEnd,
    setup: RankSetup,
) -> NoReturn:
    """Run ``fn(rank, *args)`` as rank ``rank``, report how it ended, and end the process.

    Args:
        fn: The user's function, or a :class:`~.payload.Payload` holding it and ``args``.
        rank: This rank's index.
        args: The extra positional arguments (empty with a ``Payload``).
        channel: Write end of the rank's private result pipe.
        setup: The rank's surroundings.
    """
    status = 1  # whatever interrupts what follows, the rank cannot read as a success
    try:
        report = _ResultPipe(channel)
        try:
            prepare(setup, report.fd)
        except BaseException as exc:
            report.send(Kind.RAISED, encode_exception(exc), time.time())
            raise
        ending = run_fn(fn, rank, args, setup.loop)
        # Leftovers first: once the supervisor has the outcome, the rank's
        # processes are gone, even those that left its process group.
        descendants.kill_descendants(os.getpid(), LEFTOVER_PATIENCE)
        # Then what the rank sent and a cancellation left queued.
        api.end(LEFTOVER_PATIENCE)
        if ending.terminated:
            die_of_sigterm()
        # Only once the frame is out may the status become 0: a KeyboardInterrupt
        # while it is written must not leave a success without a result.
        sent = report.send(ending.kind, ending.payload, ending.ended_at)
        status = ending.status if sent or ending.status else LOST_CHANNEL_STATUS
        if ending.text is not None:
            print(ending.text, file=sys.stderr)
    finally:
        _end(status)


class _ResultPipe:
    """The rank's end of its result pipe, kept out of the way of ``fn``'s own descriptors."""

    def __init__(self, end: ChildEnd) -> None:
        self.fd = move_high(end.fd)
        self._identity = identity(self.fd)

    def send(self, kind: int, payload: bytes, ended_at: float) -> bool:
        """Write the frame after when ``fn`` ended; False if ``fn`` closed or replaced the pipe."""
        if identity(self.fd) != self._identity:
            # Closed (os.closerange), or the number now holds another file of
            # the rank's: writing there would corrupt that file.
            _say(
                f"the pipe on which this rank reports how fn ended (fd {self.fd}) was"
                " closed by the rank's own code: its outcome is lost"
            )
            return False
        try:
            _write_all(self.fd, ended_frame(ended_at) + header(kind, len(payload)))
            _write_all(self.fd, payload)
        except OSError:  # the supervisor is gone; the exit code still tells the story
            pass
        return True


def _end(status: int) -> NoReturn:
    """End the rank with ``status`` once Python's exit steps have run (see ``ending``).

    Never by returning into ``multiprocessing``: under ``fork`` and
    ``forkserver`` its caller is a copy of the supervisor or of the fork
    server, and under ``spawn`` a return ends in the interpreter's
    finalization, where C++ static destructors of extension libraries may
    abort a rank whose ``fn`` has finished (reported of two-rank gloo DDP
    jobs with torch 2.13). The atexit handlers that run are those registered
    in the rank: the inherited ones were dropped at its start (see
    ``process.prepare``).
    """
    ending.end(status)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # fd 2 may be closed too
        os.write(2, f"aiospawn: {line}\n".encode())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
