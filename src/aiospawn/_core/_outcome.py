"""How one rank ended, and the exception that reports it."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from aiospawn._rank.wire import LOST_CHANNEL_STATUS, Kind, exit_status

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
    frame: tuple[int, bytes] | None
    stopped_by_us: bool
    stderr_tail: tuple[str, ...] = ()
    note: str | None = None

    @property
    def succeeded(self) -> bool:
        """True if ``fn`` finished normally and the process exited with 0."""
        return self.exit_code == 0 and (self.frame is None or self.frame[0] == Kind.RETURNED)

    def value(self) -> Any:
        """Unpickle the value ``fn`` returned (``None`` if it exited without one)."""
        if self.frame is None or self.frame[0] != Kind.RETURNED:
            return None
        return pickle.loads(self.frame[1])

    def summary(self) -> str:
        """How it ended in a word or two: ``returned``, ``raised``, ``SIGKILL``, ``exit code 3``."""
        if self.succeeded:
            return "returned"
        if self.frame is not None and self.frame[0] == Kind.RAISED:
            return "raised"
        if self.exit_code < 0:
            return signal_name(self.exit_code)
        return f"exit code {self._reported_code()[0]}"

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
            exc_pickle, type_name, text = pickle.loads(self.frame[1])
            error = ProcessRaisedException(raised_message(self.rank, text), self.rank, self.pid)
            error.__cause__ = _rebuild(exc_pickle, type_name, text)
            if self.stderr_tail:
                # A note, not the message: torch's message ends with the exception line.
                error.add_note(self._stderr_tail_text())
            return error
        code, detail = self._reported_code()
        message = exited_message(self.rank, code, detail=detail, killed_by_us=self.stopped_by_us)
        if self.stderr_tail:
            message += "\n" + self._stderr_tail_text()
        name = signal_name(code) if code < 0 else None
        return ProcessExitedException(message, self.rank, self.pid, code, name)

    def _reported_code(self) -> tuple[int, str | None]:
        """The exit code to report, and what to say of it beyond the code.

        ``sys.exit(n)`` with an ``n`` no exit status can hold ends the process
        with status 1; the frame has ``n`` itself, which the report gives
        (a negative ``n`` would read as a signal: the report says status 1).
        """
        if self.frame is None:
            if self.exit_code == LOST_CHANNEL_STATUS:
                return self.exit_code, (
                    "the rank's code closed the pipe on which it reports how fn ended (code"
                    " that closes every descriptor, such as os.closerange(3, ...), does this),"
                    " so its outcome is lost; unless fn exited with this code itself"
                )
            return self.exit_code, None
        if self.frame[0] != Kind.EXITED:
            return self.exit_code, None
        sent, detail = pickle.loads(self.frame[1])
        if sent != self.exit_code and self.exit_code == exit_status(sent):
            detail = f"sys.exit({sent!r}); the process's exit status is {self.exit_code}, as"
            detail += " an exit status holds 0 to 255"
            return (sent if sent > 0 else self.exit_code), detail
        return self.exit_code, detail

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


def _rebuild(exc_pickle: bytes | None, type_name: str, text: str) -> BaseException:
    if exc_pickle is not None:
        try:
            exc = pickle.loads(exc_pickle)
        except Exception:
            pass
        else:
            if isinstance(exc, BaseException):
                return exc
    return RemoteTraceback(type_name, text)
