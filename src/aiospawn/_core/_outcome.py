"""How ranks ended: each rank's outcome, the group's exception, the group's results.

:class:`RankExit` (an exit), :class:`Hang` (a hang found by heartbeats) and
:class:`BrokenChannel` (a rank's channel carried a frame that breaks its format)
each build the exception that reports them; :func:`group_error` builds the one
``join()`` raises for the whole group, from its root cause or, after
``terminate()``, the lowest rank stopped; :func:`decode_results` unpickles
what every rank returned.

Every payload a rank sends is unpickled here, in the supervisor, and
unpickling runs whatever code the pickle names: a class's module is imported
(and may call ``sys.exit()``, as an ``argparse`` script does), a
``__reduce__`` callable runs. Ranks are trusted code. Whatever that code
raises, ``SystemExit`` and ``KeyboardInterrupt`` included, becomes the rank's
:class:`ProcessRaisedException`; it never reaches the supervising task.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from aiospawn._rank.wire import LOST_CHANNEL_STATUS, Kind, exit_status

from ._errors import (
    ProcessException,
    ProcessExitedException,
    ProcessHungException,
    ProcessRaisedException,
    RemoteTraceback,
    broken_channel_message,
    exited_message,
    hung_message,
    raised_message,
    signal_name,
)

if TYPE_CHECKING:
    from ._policy import RestartRecord


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
        cause: What ended the rank, when the backend knows it and the code
            alone would mislead (a warm rank whose template died is reported as
            SIGKILL): said in the message in place of a guess.
        ended_at: When the rank ended, as ``time.time()``: by the rank's own
            clock when ``fn`` returned or raised, if the rank said so with
            its outcome; otherwise (killed by a signal, ``os._exit``) when
            the supervisor saw the exit. None if unknown. The group's root
            cause is the failure that ended first (see ``_group``).
    """

    rank: int
    pid: int
    exit_code: int
    frame: tuple[int, bytes | bytearray] | None
    stopped_by_us: bool
    stderr_tail: tuple[str, ...] = ()
    note: str | None = None
    cause: str | None = None
    ended_at: float | None = None

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
            exc_pickle, type_name, text = _loads_raised(self.frame[1])
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
            return self.exit_code, self.cause
        if self.frame[0] != Kind.EXITED:
            return self.exit_code, None
        try:
            sent, detail = pickle.loads(self.frame[1])
        except BaseException as exc:  # a frame we did not write
            return self.exit_code, f"its exit report cannot be decoded: {_describe(exc)}"
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


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokenChannel:
    """A rank whose channel carried a frame that breaks the format, found while it ran.

    The supervisor reads nothing more from that channel, and stops the rank as
    it stops a hung one.

    Attributes:
        rank: The rank's index.
        pid: Its process id.
        reason: What was wrong: ``"a frame of unknown kind 255 (...)"``.
    """

    rank: int
    pid: int
    reason: str

    def summary(self) -> str:
        """``"broken channel"``."""
        return "broken channel"

    def exception(self) -> ProcessException:
        """Build a fresh exception naming the rank and what was wrong."""
        message = broken_channel_message(self.rank, self.pid, self.reason)
        return ProcessException(message, self.rank, self.pid)


#: A failure that can end a group: an exit, or one the supervisor found in a running rank.
Failure = RankExit | Hang | BrokenChannel


def ended_before(failure: Failure, other: Failure) -> bool:
    """True if both are exits whose ends are dated and ``failure`` ended first.

    A hang or a broken channel is dated by no rank: it is the root cause from
    when it is found.
    """
    if not isinstance(failure, RankExit) or not isinstance(other, RankExit):
        return False
    if failure.ended_at is None or other.ended_at is None:
        return False
    return failure.ended_at < other.ended_at


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


def rebuild_raised(payload: bytes | bytearray) -> BaseException:
    """The exception in a RAISED payload (a stand-in if it cannot be rebuilt), with its traceback.

    For a handler's error in ``ctx.call()``: the caller gets the exception
    itself, and the rank's traceback as a note.
    """
    exc_pickle, type_name, text = _loads_raised(payload)
    error = _rebuild(exc_pickle, type_name, text)
    if not isinstance(error, RemoteTraceback):
        error.add_note(text.rstrip("\n"))
    return error


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


def group_error(
    root: Failure | None,
    exits: Sequence[RankExit | None],
    *,
    stuck: Sequence[tuple[int, int | None]] = (),
    restarts: tuple[RestartRecord, ...] = (),
    restart_error: Exception | None = None,
    give_up_note: str | None = None,
) -> ProcessException | None:
    """The exception ``join()`` raises once a group has been shut down, if any.

    Args:
        root: The group's root cause, if a failure ended it.
        exits: Each slot's last exit, index = rank. Without a root cause (the
            group was terminated), the lowest rank that did not succeed is
            reported.
        stuck: ``(rank, pid)`` of the ranks that could not be reaped.
        restarts: The restart history, for ``exc.restarts``.
        restart_error: Why a restart could not happen, if that ended the group.
        give_up_note: The restart policy's note, if it gave up.

    Returns:
        A fresh exception each call (so that every ``join()`` raises an equal
        one), or None if every rank succeeded and none is stuck.
    """
    if root is not None:
        error = root.exception()
    else:
        stopped = [exit for exit in exits if exit and not exit.succeeded]
        if stopped:
            error = stopped[0].exception()
        elif stuck:
            rank, pid = stuck[0]
            error = ProcessException(f"process {rank} did not exit after SIGKILL", rank, pid or 0)
        else:
            return None
    for rank, pid in stuck:
        error.add_note(
            f"rank {rank} (pid {pid}) did not exit after SIGKILL and could not be"
            " reaped: it is probably in uninterruptible sleep (state D)"
        )
    if restarts:
        error.restarts = restarts
    if restart_error is not None:
        error.add_note(f"aiospawn could not restart after it: {restart_error!r}")
    if give_up_note is not None:
        error.add_note(give_up_note)
    return error


async def decode_results(
    exits: Sequence[RankExit | None], *, stopped_as_none: bool = False
) -> list[Any]:
    """Unpickle what every rank returned, index = rank, on a worker thread.

    With ``stopped_as_none``, a rank that a requested stop ended (it did not
    return) reads as ``None``.

    Always off the loop: unpickling runs the ranks' code (a class's module
    import, a ``__reduce__`` callable), which may take any time whatever the
    size; the hop costs tens of microseconds, once a group. The pickles are
    dropped once every value is decoded.

    Raises:
        ProcessRaisedException: A value cannot be unpickled here (its class
            is missing, or its unpickling raised, ``SystemExit`` included),
            naming the rank.
    """
    return await anyio.to_thread.run_sync(_decode, exits, stopped_as_none)


def _decode(exits: Sequence[RankExit | None], stopped_as_none: bool) -> list[Any]:
    values: list[Any] = []
    for exit in exits:
        assert exit is not None
        if stopped_as_none and exit.stopped_by_us and not exit.succeeded:
            values.append(None)
            continue
        values.append(exit.value())  # raises the rank's ProcessRaisedException
    for exit in exits:
        assert exit is not None
        exit.release_payload()
    return values


def _describe(exc: BaseException) -> str:
    """``repr(exc)``, or its type's name if even that raises."""
    try:
        return repr(exc)
    except BaseException:
        return f"<{type(exc).__qualname__}: repr() failed>"
