"""How one rank ended, and the exception that reports it.

Every payload a rank sends is unpickled here, in the supervisor, and
unpickling runs whatever code the pickle names: a class's module is imported
(and may call ``sys.exit()``, as an ``argparse`` script does), a
``__reduce__`` callable runs. Ranks are trusted code. Whatever that code
raises, ``SystemExit`` and ``KeyboardInterrupt`` included, becomes the rank's
:class:`ProcessRaisedException`; it never reaches the supervising task.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from aiospawn._rank.wire import Kind

from ._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessHungException,
    ProcessRaisedException,
    RemoteTraceback,
    exited_message,
    hung_message,
    raised_message,
    signal_name,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """The end of one rank's process, as observed by its watcher.

    Attributes:
        rank: The rank's index.
        pid: The pid it had.
        exit_code: As ``multiprocessing`` reports it: negative for a signal.
        frame: The ``(kind, payload)`` the rank sent, if it sent a whole one.
        stopped_by_us: True when aiospawn had signalled the rank to stop, so
            that its death is a consequence of a shutdown, never a root cause.
        stderr_tail: The last lines of the rank's stderr, when it passed
            through the supervisor (``prefix``, ``capture`` or ``tee``).
        note: What the backend knows of the exit beyond its code (such as the
            machine the rank ran on), added to the exception as a note.
    """

    rank: int
    pid: int
    exit_code: int
    frame: tuple[int, bytes | bytearray] | None
    stopped_by_us: bool
    stderr_tail: tuple[str, ...] = ()
    note: str | None = None

    @property
    def succeeded(self) -> bool:
        """True if ``fn`` finished normally and the process exited with 0."""
        return self.exit_code == 0 and (self.frame is None or self.frame[0] == Kind.RETURNED)

    def value(self) -> Any:
        """Unpickle the value ``fn`` returned (``None`` if it exited without one).

        Blocking and arbitrary (see the module docstring): call it off the
        event loop.

        Raises:
            ProcessRaisedException: The value cannot be unpickled here; its
                cause is what the unpickling raised, whatever it was.
        """
        if self.frame is None or self.frame[0] != Kind.RETURNED:
            return None
        try:
            return pickle.loads(self.frame[1])
        except BaseException as exc:  # SystemExit too: the rank's failure, not ours
            text = (
                f"the value rank {self.rank} returned cannot be unpickled here: {_describe(exc)}\n"
            )
            error = ProcessRaisedException(raised_message(self.rank, text), self.rank, self.pid)
            error.__cause__ = exc
            raise error from exc

    def release_payload(self) -> None:
        """Drop the returned value's pickle, once the value has been decoded.

        A large result would otherwise be held twice for the context's life.
        """
        if self.frame is not None and self.frame[0] == Kind.RETURNED:
            # Frozen for its readers; this is the one field that can go.
            object.__setattr__(self, "frame", (Kind.RETURNED, b""))

    def summary(self) -> str:
        """How it ended in a word or two: ``returned``, ``raised``, ``SIGKILL``, ``exit code 3``."""
        if self.succeeded:
            return "returned"
        if self.frame is not None and self.frame[0] == Kind.RAISED:
            return "raised"
        if self.exit_code < 0:
            return signal_name(self.exit_code)
        return f"exit code {self.exit_code}"

    def exception(self) -> ProcessException:
        """Build a fresh exception reporting this (unsuccessful) exit.

        A fresh instance each time lets ``join()`` raise an equal exception on
        every call without piling tracebacks onto one object.
        """
        error = self._exception()
        if self.note:
            error.add_note(self.note)
        return error

    def _exception(self) -> ProcessException:
        if self.frame is not None and self.frame[0] == Kind.RAISED:
            exc_pickle, type_name, text = _loads_raised(self.frame[1])
            error = ProcessRaisedException(raised_message(self.rank, text), self.rank, self.pid)
            error.__cause__ = _rebuild(exc_pickle, type_name, text)
            if self.stderr_tail:
                # A note, not the message: torch's message ends with the exception line.
                error.add_note(self._stderr_tail_text())
            return error
        detail = None
        if self.frame is not None and self.frame[0] == Kind.EXITED:
            try:
                _code, detail = pickle.loads(self.frame[1])
            except BaseException as exc:  # a frame we did not write
                detail = f"its exit report cannot be decoded: {_describe(exc)}"
        message = exited_message(
            self.rank, self.exit_code, detail=detail, killed_by_us=self.stopped_by_us
        )
        if self.stderr_tail:
            message += "\n" + self._stderr_tail_text()
        name = signal_name(self.exit_code) if self.exit_code < 0 else None
        return ProcessExitedException(message, self.rank, self.pid, self.exit_code, name)

    def _stderr_tail_text(self) -> str:
        lines = "\n".join(f"    {line}" for line in self.stderr_tail)
        return f"last lines of rank {self.rank}'s stderr:\n{lines}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Hang:
    """A rank found hung by its heartbeats, before the supervisor stopped it.

    Attributes:
        rank: The rank's index.
        pid: Its process id.
        seconds: Since its last heartbeat (or its start, if it never beat).
        began: Whether it had sent a first heartbeat.
        timeout: The limit it overran (``heartbeat_timeout`` or ``startup_timeout``).
        stack: Its threads' stacks, or None if it did not answer.
    """

    rank: int
    pid: int
    seconds: float
    began: bool
    timeout: float
    stack: str | None

    def summary(self) -> str:
        """``"hung"``."""
        return "hung"

    def exception(self) -> ProcessHungException:
        """Build a fresh exception reporting the hang, with the stack."""
        message = hung_message(
            self.rank,
            self.pid,
            self.seconds,
            began=self.began,
            timeout=self.timeout,
            stack=self.stack,
        )
        return ProcessHungException(message, self.rank, self.pid, self.seconds, self.stack)


def _loads_raised(payload: bytes | bytearray) -> tuple[bytes | None, str, str]:
    """``(exception_pickle, type_name, text)`` from a RAISED payload, or a stand-in."""
    try:
        exc_pickle, type_name, text = pickle.loads(payload)
    except BaseException as exc:  # a frame we did not write
        return (
            None,
            "builtins.RuntimeError",
            f"its error report cannot be decoded: {_describe(exc)}\n",
        )
    return exc_pickle, str(type_name), str(text)


def _rebuild(exc_pickle: bytes | None, type_name: str, text: str) -> BaseException:
    if exc_pickle is not None:
        try:
            exc = pickle.loads(exc_pickle)
        except BaseException:  # SystemExit too; the text still tells the story
            pass
        else:
            if isinstance(exc, BaseException):
                return exc
    return RemoteTraceback(type_name, text)


def _describe(exc: BaseException) -> str:
    """``repr(exc)``, or its type's name if even that raises."""
    try:
        return repr(exc)
    except BaseException:
        return f"<{type(exc).__qualname__}: repr() failed>"
