"""How ``fn`` ended, as every rank reports it: the one rule from its end to its outcome frame.

:func:`run_fn` calls ``fn(rank, *args)`` (and runs the coroutine of an
``async def fn`` on its own event loop, see ``async_main``) and turns how it
ended into the frame of ``wire`` and the exit status that goes with it:

==========================================  ===================================  ==========
``fn`` ...                                  frame                                status
==========================================  ===================================  ==========
returns ``value``                           RETURNED ``value``                   0
calls ``sys.exit()`` / ``sys.exit(0)``      RETURNED ``None``                    0
calls ``sys.exit(n)``, 0 < n < 256          EXITED ``(n, None)``                 n
calls ``sys.exit(n)``, other n              EXITED ``(n, None)``                 1
calls ``sys.exit("text")``                  EXITED ``(1, "sys.exit('text')")``   1
raises (``KeyboardInterrupt`` too)          RAISED                               1
returns a value that cannot be pickled      RAISED (a ``TypeError``)             1
is an ``async def`` cancelled by SIGTERM    none (:attr:`Ending.terminated`)     -SIGTERM
==========================================  ===================================  ==========

Both backends use it: a local rank (``bootstrap``) writes the frame to its
pipe and exits with the status, which is where the rest of the exit-code
contract lives (a rank killed by a signal, ``os._exit``, a closed pipe); a
Ray rank hands the frame back from its actor call (``aiospawn.ray._actor``).
The supervisor decodes the frame in ``aiospawn._core._outcome``.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Coroutine

from .payload import Payload
from .wire import Kind, encode_exception, encode_exit, encode_value, from_fn

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

    from .wire import Outcome


class Ending:
    """How ``fn`` ended: the outcome frame, the exit status, and when.

    Attributes:
        kind: The frame's :class:`~aiospawn._rank.wire.Kind`.
        payload: The frame's payload.
        status: The exit status the rank ends with once the frame is out.
        ended_at: ``time.time()`` when ``fn`` returned or raised, on the rank's clock.
        text: What Python would print as the process ends (``sys.exit("text")``
            prints its text), or None.
        terminated: SIGTERM cancelled an ``async def fn``: there is no frame,
            and the rank dies of SIGTERM (:func:`die_of_sigterm`), as a sync
            rank it stopped would.
        value: What ``fn`` returned, held for as long as the ending is: a
            local rank ends with ``os._exit`` and never finalises it, so that
            a returned object's finalizer (a ``TemporaryDirectory``'s removal,
            say) does not run in the middle of the rank's end.
    """

    __slots__ = ("ended_at", "kind", "payload", "status", "terminated", "text", "value")

    def __init__(
        self,
        kind: int,
        payload: bytes,
        status: int,
        ended_at: float,
        *,
        text: str | None = None,
        terminated: bool = False,
        value: Any = None,
    ) -> None:
        self.kind = kind
        self.payload = payload
        self.status = status
        self.ended_at = ended_at
        self.text = text
        self.terminated = terminated
        self.value = value

    @property
    def frame(self) -> Outcome:
        """``(kind, payload, status)``, as a Ray rank hands it back."""
        return self.kind, self.payload, self.status

    def __repr__(self) -> str:
        return (
            f"Ending(kind={self.kind}, status={self.status}, terminated={self.terminated},"
            f" {len(self.payload)} bytes)"
        )


def run_fn(fn: Callable[..., Any] | Payload, rank: int, args: tuple[Any, ...], loop: str) -> Ending:
    """Run ``fn(rank, *args)`` here and say how it ended: what ``fn`` raises is not raised.

    Args:
        fn: The user's function, or a :class:`~aiospawn._rank.payload.Payload`
            holding it and ``args``, unpickled now (its failure is ``fn``'s).
        rank: The rank's index.
        args: The extra positional arguments (ignored with a ``Payload``).
        loop: The event loop an ``async def fn`` runs on: ``"asyncio"``,
            ``"trio"`` or ``"uvloop"``; imported only for one.
    """
    text = None
    terminated = False
    entry = None  # an async def fn's code: below the event loop's frames
    try:
        try:
            if isinstance(fn, Payload):  # sent by value: unpickled now, after env
                fn, args = fn.load()
            value = fn(rank, *args)
            if isinstance(value, Coroutine):  # an async def fn: run it on its own loop
                entry = getattr(value, "cr_code", None)
                # Imported only for one, and only here: the async main is a
                # module of its own, which imports this one.
                from .async_main import Terminated, run_coroutine

                try:
                    value = run_coroutine(value, loop)
                except Terminated:
                    terminated = True
        finally:
            # When fn ended, on the rank's clock: the supervisor orders
            # failures by it, however late it learns of them.
            ended_at = time.time()
    except SystemExit as exc:
        kind, payload, status = encode_exit(exc)
        if exc.code is not None and not isinstance(exc.code, int):
            text = str(exc.code)  # printed, as Python does for sys.exit("text")
    except BaseException as exc:
        # from_fn: the traceback starts in fn, not in this frame.
        kind, payload, status = Kind.RAISED, encode_exception(from_fn(exc, entry)), 1
    else:
        if terminated:
            return Ending(Kind.RAISED, b"", 1, ended_at, terminated=True)
        kind, payload, status = encode_value(value)
        return Ending(kind, payload, status, ended_at, value=value)
    return Ending(kind, payload, status, ended_at, text=text)


def die_of_sigterm() -> NoReturn:
    """End the rank as killed by SIGTERM, its output flushed, as a stopped sync rank ends."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))
    os.kill(os.getpid(), signal.SIGTERM)
    while True:  # delivered at once to this thread; never past this
        signal.pause()
