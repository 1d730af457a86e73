"""What changes when the supervisor is a Jupyter kernel (ipykernel).

Two adaptations, both inert outside ipykernel, and neither imports it:

* :func:`default_stream_mode`: the ranks' output goes through the
  supervisor's ``sys.stdout`` and ``sys.stderr``, which the kernel shows in
  the cell, rather than to the file descriptors the kernel inherited.
* :func:`signals_wake_the_loop`: the notebook's stop button sends SIGINT to
  the kernel. For a cell that awaits, ipykernel's handler schedules the cell
  task's cancellation with a plain ``call_soon`` from the signal handler,
  which does not wake an asyncio loop asleep in ``select()``: a cell whose
  ranks are quiet was never cancelled (ipykernel issue 881). While a group
  runs, a signal wakes the loop, and the cancellation shuts the group down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from ._loops import runs_asyncio


def under_ipykernel() -> bool:
    """True if this process is an ipykernel kernel whose ``sys.stdout`` a notebook shows."""
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(sys.stdout, iostream.OutStream)


def default_stream_mode() -> str:
    """The mode of a stream the caller left unset: ``"prefix"`` under ipykernel, else ``"inherit"``.

    A notebook shows, in the running cell, what the kernel writes to its
    ``sys.stdout`` and ``sys.stderr``; ranks that inherit the kernel's file
    descriptors write past them (to the kernel's terminal, or unprefixed into
    whichever cell runs at the time). With ``"prefix"`` the supervisor writes
    each line, behind its rank's prefix, into the cell that started the group.
    """
    return "prefix" if under_ipykernel() else "inherit"


class _Waker:
    """A wakeup fd for the signals of this process, read by the running asyncio loop."""

    def __init__(self) -> None:
        self.users = 0
        self._fds: tuple[int, int] | None = None

    def acquire(self) -> None:
        self.users += 1
        if self.users > 1:
            return
        import asyncio  # loaded already: see runs_asyncio

        reader, writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
        if previous != -1:
            # The loop already wakes on signals (it has handlers of its own).
            signal.set_wakeup_fd(previous)
            os.close(reader)
            os.close(writer)
            return
        asyncio.get_running_loop().add_reader(reader, _drain, reader)
        self._fds = reader, writer

    def release(self) -> None:
        self.users -= 1
        if self.users or self._fds is None:
            return
        import asyncio

        reader, writer = self._fds
        self._fds = None
        current = signal.set_wakeup_fd(-1)
        if current != writer:  # someone set their own meanwhile: keep it
            signal.set_wakeup_fd(current)
        asyncio.get_running_loop().remove_reader(reader)
        os.close(reader)
        os.close(writer)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


_waker = _Waker()


@contextlib.contextmanager
def signals_wake_the_loop() -> Iterator[None]:
    """While the block runs, let a signal wake this kernel's asyncio loop (see above).

    Only under ipykernel, on the main thread (the only one that takes
    signals), running asyncio; elsewhere it does nothing.
    """
    if not (
        under_ipykernel()
        and threading.current_thread() is threading.main_thread()
        and runs_asyncio()
    ):
        yield
        return
    _waker.acquire()
    try:
        yield
    finally:
        _waker.release()
