"""Ctrl-C while a blocking call waits: counted, then raised at one point.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be (in
``threading`` internals, half-way through recording a group) can leave a
lock held or ranks running. So while a blocking call of ``aiospawn.sync``
runs in the main thread, SIGINT has a handler of ours (as ``asyncio.Runner``
does it): the first Ctrl-C is only counted, and the wait in progress
(``_portal.LoopThread.run``) turns it into a cancellation and raises
``KeyboardInterrupt`` once the cancelled work has ended. A second Ctrl-C
raises at once.

::

    with_ctrl_c_deferred(body)         SIGINT -> CtrlC.__call__
      installs CtrlC                     first, inside body: count it, return
      body() ... waits poll              otherwise: raise KeyboardInterrupt
        CtrlC.current().pending
      puts Python's handler back
      raises KeyboardInterrupt if one is still pending

Imports the standard library only.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")


class CtrlC:
    """SIGINT's handler while a blocking call runs in the main thread.

    Attributes:
        count: How many Ctrl-C came during the call.
        delivered: The ``KeyboardInterrupt`` for the first one was raised.
    """

    def __init__(self) -> None:
        self.count = 0
        self.delivered = False

    @property
    def pending(self) -> bool:
        """A Ctrl-C came and has not been raised yet."""
        return self.count > 0 and not self.delivered

    @staticmethod
    def current() -> CtrlC | None:
        """The handler of the call in progress, if this thread is the main one."""
        if threading.current_thread() is not threading.main_thread():
            return None
        handler = signal.getsignal(signal.SIGINT)
        return handler if isinstance(handler, CtrlC) else None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1 and _inside_deferring_call(frame):
            return
        if not _inside_deferring_call(frame):
            # Left installed by a call that was cut short before it could put
            # Python's handler back (only another exception can do that).
            signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt


def with_ctrl_c_deferred(body: Callable[[], T]) -> T:
    """Run ``body()``; in the main thread, with Ctrl-C deferred as :class:`CtrlC` says.

    Only when SIGINT has Python's default handler: one the program installed
    itself is left alone.

    Returns:
        What ``body()`` returned.

    Raises:
        KeyboardInterrupt: A Ctrl-C came after ``body()``'s last wait, and is
            raised as if just after its return.
    """
    ctrl_c = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if handler is signal.default_int_handler or isinstance(handler, CtrlC):
            ctrl_c = CtrlC()
    try:
        if ctrl_c is not None:
            signal.signal(signal.SIGINT, ctrl_c)
        result = body()
    finally:
        if ctrl_c is not None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if ctrl_c is not None and ctrl_c.pending:
        raise KeyboardInterrupt
    return result


def _inside_deferring_call(frame: FrameType | None) -> bool:
    # The handler runs in whatever frame the main thread is executing; only a
    # frame below with_ctrl_c_deferred has a wait that will raise the count.
    while frame is not None:
        if frame.f_code is with_ctrl_c_deferred.__code__:
            return True
        frame = frame.f_back
    return False
