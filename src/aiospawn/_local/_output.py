"""Per-rank output: where each rank's stdout and stderr go, and reading the ones that pass us.

A stream's mode is one of

* ``"inherit"``: the rank writes to the supervisor's own stream (no copying);
* ``"devnull"``: discarded;
* a directory path: one file per rank and stream (``rank3.stdout``), mode
  0600, truncated at each start of the rank and never deleted (see
  :func:`open_log_dir` and :func:`open_log` for what is refused);
* ``"prefix"``: each line is written to the supervisor's stream behind a
  prefix such as ``[rank3]: `` (the default under ipykernel, see
  ``_core._spec.default_stream_mode``);
* ``"capture"``: the lines are kept for ``ctx.output()``.

The rank's file descriptors 1 and 2 are redirected, so the output of C
extensions and of the rank's own children is included. Streams in the last two
modes, and every stream with ``tee=True``, come through a pipe that the rank's
watcher reads on the event loop (no thread, no polling): lines are split at
``MAX_LINE`` bytes, never dropped, and a rank that writes faster than a
``capture`` consumer reads is held back by its full pipe instead of growing
memory without bound (while nobody iterates ``ctx.output()``, the oldest
captured lines are dropped instead, see ``_core._capture``). What a rank wrote
just before it exited is read before its exit is reported: exactly what the
pipe holds at that moment, never more, since a process the rank left behind
may hold the pipe open and write into it for ever.

Prefixed lines go to the ``sys.stdout`` or ``sys.stderr`` in force when the
rank was made, binary or text (a notebook's stream is text only), and are
written in the :mod:`contextvars` context of that moment: ipykernel keeps the
cell a write belongs to in a context variable (its ``OutStream`` parent
header, ipykernel 6.29 and later), so the lines of a group started in one cell
appear in that cell even while a later cell runs.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import errno
import fcntl
import os
import stat
import sys
import termios
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import anyio

from aiospawn._core._capture import CaptureBuffer, OutputLine
from aiospawn._core._log import logger
from aiospawn._core._spec import STREAMS, Mode, OutputSpec
from aiospawn._rank.wire import ChildEnd

from . import _pipes
from ._pipes import close_watched, rank_pipe

if TYPE_CHECKING:
    from pathlib import Path  # a directory mode; only those import pathlib

#: Longer lines are split into pieces of this many bytes, never dropped.
MAX_LINE = 64 * 1024

#: The last lines of a failed rank's stderr that its exception quotes.
STDERR_TAIL_LINES = 20

_READ_CHUNK = 64 * 1024

#: Bytes read per wake-up while the rank runs.
_STEP = 16 * 1024


class StreamReader:
    """Reads one rank stream's pipe on the event loop and hands out its lines."""

    def __init__(
        self,
        reader: int,
        name: str,
        sinks: list[Callable[[bytes], None]],
        capture: CaptureBuffer | None,
        flushes: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.name = name
        self._reader: int | None = reader
        self._sinks = sinks
        self._flushes = list(flushes)
        self._capture = capture
        self._partial = b""
        self._eof = False
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)

    def prepare(self) -> None:
        """Make the pipe non-blocking, once the rank has its end."""
        assert self._reader is not None
        os.set_blocking(self._reader, False)

    async def pump(self) -> None:
        """Read lines as the rank writes them, until end-of-file or cancellation."""
        while not self._eof:
            if self._capture is not None:
                await self._capture.wait_for_room()
            if self._reader is None:  # drained and closed: the rank has exited
                return
            try:
                await anyio.wait_readable(self._reader)
            except anyio.ClosedResourceError:
                return
            if self._reader is None:  # the exit was recorded as we woke up
                return
            # One small read per wake-up: each line costs the loop a few
            # microseconds, and a rank writing short lines packs thousands in.
            self._read(limit=1, budget=_STEP)

    def drain(self) -> None:
        """After the rank exited: read what the pipe holds now, without waiting, then close.

        Bounded by the pipe's contents when it is called: a descendant that
        kept the write end open (``Popen(["yes"])``, then the rank returned)
        would otherwise keep this loop reading, on the event loop, for as long
        as it writes.
        """
        if self._reader is None:
            return
        self._read(limit=None, budget=_buffered(self._reader))
        if self._partial:
            self._emit(self._partial)
            self._partial = b""
            self._flush()
        close_watched(self._reader)
        self._reader = None

    def close(self) -> None:
        """Release the pipe without reading (the rank never started)."""
        if self._reader is not None:
            _pipes.close(self._reader)
            self._reader = None

    def _read(self, limit: int | None, budget: int | None = None) -> None:
        fd = self._reader
        assert fd is not None
        reads = 0
        while not self._eof and (limit is None or reads < limit):
            if budget is not None and budget <= 0:
                return
            try:
                data = os.read(fd, _READ_CHUNK if budget is None else min(budget, _READ_CHUNK))
            except BlockingIOError:
                return
            reads += 1
            if not data:
                self._eof = True
                return
            if budget is not None:
                budget -= len(data)
            self._split(data)
            self._flush()

    def _split(self, data: bytes) -> None:
        buffer = self._partial + data
        start = 0
        while True:
            end = buffer.find(b"\n", start, start + MAX_LINE)
            if end >= 0:
                self._emit(buffer[start:end])
                start = end + 1
            elif len(buffer) - start >= MAX_LINE:
                self._emit(buffer[start : start + MAX_LINE])
                start += MAX_LINE
            else:
                break
        self._partial = buffer[start:]

    def _flush(self) -> None:
        for flush in self._flushes:
            try:
                flush()
            except Exception as exc:  # OSError, or ValueError of a closed stream
                self._flushes.remove(flush)
                logger.warning("Stopped flushing a rank's %s: %s", self.name, exc)

    def _emit(self, line: bytes) -> None:
        for sink in list(self._sinks):
            try:
                sink(line)
            except Exception as exc:
                # A closed terminal or pipe, a full disk, a stream closed by the
                # program (ValueError) or one that cannot encode the line: the
                # output is lost, the supervision must go on.
                self._sinks.remove(sink)
                logger.warning("Stopped copying a rank's %s: %s", self.name, exc)
        if self.name == "stderr":
            self.tail.append(line.decode(errors="replace"))


class RankOutput:
    """The output plumbing of one rank: what its fds 1 and 2 become, and our readers.

    Args:
        spec: The group's output spec.
        rank: The rank's index.
        capture: The group's capture buffer, if a stream is captured.
        restart: The rank's restart count, for the prefix.
        log_dirs: The group's log directories (see :func:`open_log_dirs`), by path.

    Raises:
        ValueError: A log file cannot be used safely (see :func:`open_log`).
        OSError: A pipe or a file cannot be made; nothing is left open.
    """

    def __init__(
        self,
        spec: OutputSpec,
        rank: int,
        capture: CaptureBuffer | None,
        restart: int = 0,
        log_dirs: Mapping[Path, int] | None = None,
    ) -> None:
        self._rank = rank
        self._restart = restart
        self._template = spec.prefix
        self._prefix = b""
        self.targets: dict[str, ChildEnd | str | None] = {}
        self.streams: list[StreamReader] = []
        self._child_ends: list[ChildEnd] = []
        self._log_fds: list[int] = []
        self._readers: list[int] = []  # made, not yet in a StreamReader
        modes, teed = spec.for_rank(rank)
        try:
            for name in STREAMS:
                self._plumb(name, modes[name], name in teed, capture, log_dirs or {})
        except BaseException:
            self.discard()
            raise

    def _plumb(
        self,
        name: str,
        mode: Mode,
        teed: bool,
        capture: CaptureBuffer | None,
        log_dirs: Mapping[Path, int],
    ) -> None:
        log = None
        if not isinstance(mode, str):  # a directory
            log = (mode, log_dirs[mode], f"rank{self._rank}.{name}")
        if mode == "inherit":
            self.targets[name] = None
        elif mode == "devnull":
            self.targets[name] = os.devnull
        elif log is not None and not teed:
            end = ChildEnd(open_log(*log))
            self._child_ends.append(end)
            self.targets[name] = end
        else:
            reader, writer = rank_pipe()
            self._child_ends.append(writer)
            self.targets[name] = writer
            self._readers.append(reader)
            sinks: list[Callable[[bytes], None]] = []
            flushes: list[Callable[[], None]] = []
            if log is not None:
                self._log_fds.append(open_log(*log))
                sinks.append(_file_writer(self._log_fds[-1]))
            if mode == "prefix" or log is not None:
                write, flush = self._prefixed_writer(name)
                sinks.append(write)
                flushes.append(flush)
            if mode == "capture":
                assert capture is not None
                sinks.append(_capturer(capture, self._rank, name))
            held_back_by = capture if mode == "capture" else None
            self._readers.pop()
            self.streams.append(StreamReader(reader, name, sinks, held_back_by, flushes))

    def started(self, pid: int) -> None:
        """Close our copies of the rank's ends, once the rank (``pid``) has its own."""
        self._prefix = self._template.format(
            rank=self._rank, pid=pid, restart=self._restart
        ).encode()
        for end in self._child_ends:
            _pipes.close(end.fd)
        self._child_ends.clear()
        for stream in self.streams:
            stream.prepare()

    def drain(self) -> None:
        """After the rank exited: deliver what is left, then close everything."""
        for stream in self.streams:
            stream.drain()
        self._close_logs()

    def discard(self) -> None:
        """Close everything of a rank that never started."""
        for end in self._child_ends:
            _pipes.close(end.fd)
        self._child_ends.clear()
        for fd in self._readers:
            _pipes.close(fd)
        self._readers.clear()
        for stream in self.streams:
            stream.close()
        self._close_logs()

    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines of stderr that passed through us."""
        for stream in self.streams:
            if stream.name == "stderr":
                return tuple(stream.tail)
        return ()

    def _prefixed_writer(self, name: str) -> tuple[Callable[[bytes], None], Callable[[], None]]:
        stream: Any = sys.stdout if name == "stdout" else sys.stderr
        binary: BinaryIO | None = getattr(stream, "buffer", None)
        context = contextvars.copy_context()

        def write_binary(line: bytes) -> None:
            assert binary is not None
            binary.write(self._prefix + line + b"\n")

        def write_text(line: bytes) -> None:
            stream.write((self._prefix + line).decode(errors="replace") + "\n")

        write = write_binary if binary is not None else write_text
        target: Any = binary if binary is not None else stream

        def write_in_context(line: bytes) -> None:
            context.run(write, line)

        def flush_in_context() -> None:
            # Once per read, not per line: a flush is a system call.
            context.run(target.flush)

        return write_in_context, flush_in_context

    def _close_logs(self) -> None:
        for fd in self._log_fds:
            _pipes.close(fd)
        self._log_fds.clear()


def _buffered(fd: int) -> int:
    """How many bytes the pipe ``fd`` holds (``FIONREAD``, pipe(7))."""
    try:
        answer = fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4)
    except OSError:  # not a pipe after all: one chunk, as a bound
        return _READ_CHUNK
    return int.from_bytes(answer, sys.byteorder)


def open_log_dirs(spec: OutputSpec) -> dict[Path, int]:
    """Open each output directory of ``spec`` once, for the group's life (:func:`open_log_dir`).

    Raises:
        ValueError, OSError: As :func:`open_log_dir`; nothing is left open.
    """
    dirs: dict[Path, int] = {}
    try:
        for modes, _ in spec.ranks or (spec.for_rank(0),):
            for mode in modes.values():
                if not isinstance(mode, str) and mode not in dirs:  # a directory
                    dirs[mode] = open_log_dir(mode)
    except BaseException:
        close_log_dirs(dirs)
        raise
    return dirs


def close_log_dirs(dirs: dict[Path, int]) -> None:
    """Close what :func:`open_log_dirs` opened (idempotent)."""
    for fd in dirs.values():
        _pipes.close(fd)
    dirs.clear()


def open_log_dir(path: Path) -> int:
    """Open the log directory ``path``, making it and its missing parents with mode 0700.

    The files are then made relative to this descriptor: a directory swapped
    for a link while the group runs changes nothing.

    Raises:
        ValueError: ``path`` is a symbolic link or not a directory, belongs to
            another user, or others or its group can write to it (they could
            plant links or files where the ranks' output goes).
        OSError: It cannot be made or opened.
    """
    _make_dirs(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(
                f"the output directory {str(path)!r} is a symbolic link or not a directory;"
                " give the directory itself"
            ) from None
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise ValueError(
                f"the output directory {str(path)!r} belongs to uid {info.st_uid}, not to this"
                f" process (uid {os.geteuid()}); use a directory of your own"
            )
        if info.st_mode & 0o022:
            raise ValueError(
                f"the output directory {str(path)!r} can be written by its group or others"
                f" (mode {stat.S_IMODE(info.st_mode):04o}), who could plant links where the"
                " ranks' output goes; use a directory of your own (a missing one is made with"
                " mode 0700), or chmod go-w it"
            )
    except BaseException:
        os.close(fd)
        raise
    return _pipes.track(fd)


def _make_dirs(path: Path) -> None:
    # Path.mkdir(parents=True) gives the parents the default mode (0755 under
    # the usual umask), not the one asked for.
    missing = []
    current = os.path.abspath(path)
    while not os.path.lexists(current) and current != os.path.dirname(current):
        missing.append(current)
        current = os.path.dirname(current)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile; checked once opened
            os.mkdir(directory, 0o700)


def open_log(directory: Path, dir_fd: int, name: str) -> int:
    """Open ``name`` in the log directory for writing, emptied, mode 0600; return the fd.

    A link is never followed, and what was opened is checked before it is
    emptied: a regular file of ours with no other hard link. A file there
    already keeps its contents until then and gets mode 0600.

    Raises:
        ValueError: ``name`` is a symbolic link, not a regular file, belongs
            to another user, or has other hard links.
        OSError: It cannot be opened.
    """
    path = os.path.join(directory, name)
    # O_NONBLOCK: a FIFO planted there must not block us until it has a reader.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(
                f"{path!r} is a symbolic link; aiospawn never follows links for rank output:"
                " remove it, or use another directory"
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise ValueError(f"{path!r} is not a regular file; remove it") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path!r} is not a regular file; remove it")
        if info.st_uid != os.geteuid():
            raise ValueError(f"{path!r} belongs to uid {info.st_uid}; remove it")
        if info.st_nlink != 1:
            # Emptying it would empty the other names' file too.
            raise ValueError(f"{path!r} has {info.st_nlink - 1} other hard link(s); remove it")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return _pipes.track(fd)


def _file_writer(fd: int) -> Callable[[bytes], None]:
    def write(line: bytes) -> None:
        data = memoryview(line + b"\n")
        while data:
            data = data[os.write(fd, data) :]

    return write


def _capturer(capture: CaptureBuffer, rank: int, name: str) -> Callable[[bytes], None]:
    def keep(line: bytes) -> None:
        capture.put(OutputLine(rank, name, line.decode(errors="replace")))

    return keep
