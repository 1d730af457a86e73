"""The launcher's stdout and stderr: when their reader goes (``| head``), it dies of SIGPIPE.

That is how command-line tools end, but only these two streams may end the
launcher so: SIGPIPE stays ignored for the rest of the process, as Python sets
it, because the launcher also holds sockets (the ranks' channels, a Ray
driver's connections) whose peers may close while a write is under way, which
must be an ``EPIPE`` error there, never the launcher's death. (Setting SIGPIPE
to its default for the whole process let a Ray driver's socket kill the
launcher during a restart.)
"""

from __future__ import annotations

import io
import os
import signal
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["die_of_sigpipe_on_closed_output"]


def die_of_sigpipe_on_closed_output() -> None:
    """Replace ``sys.stdout`` and ``sys.stderr`` by streams that die of SIGPIPE on a closed pipe."""
    sys.stdout = _dying_on_closed_pipe(sys.stdout)
    sys.stderr = _dying_on_closed_pipe(sys.stderr)


class _Fd(io.RawIOBase):
    """A file descriptor we write to but do not own (it is not closed with us)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: Buffer, /) -> int:
        try:
            return os.write(self._fd, data)
        except BrokenPipeError:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGPIPE)  # delivered before kill() returns
            raise


def _dying_on_closed_pipe(stream: TextIO) -> TextIO:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (replaced, or closed)
        return stream
    stream.flush()
    raw = _Fd(fd)
    # Buffered as the stream it replaces: unbuffered under python -u or
    # PYTHONUNBUFFERED, else a buffer that the text layer flushes per line
    # (stderr, a terminal) or not.
    binary: io.RawIOBase | io.BufferedWriter = (
        io.BufferedWriter(raw)
        if isinstance(getattr(stream, "buffer", None), io.BufferedWriter)
        else raw
    )
    # (typeshed wants a buffered stream; CPython's own unbuffered stdout is a
    # TextIOWrapper straight over its FileIO, as here.)
    return io.TextIOWrapper(  # type: ignore[type-var]
        binary,
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=bool(stream.line_buffering),
        write_through=getattr(stream, "write_through", False),
    )
