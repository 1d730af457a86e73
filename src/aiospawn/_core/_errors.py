"""The exceptions aiospawn raises when a rank fails, and how their messages are made.

The three ``Process*Exception`` classes keep the names, positional arguments and
messages of ``torch.multiprocessing``, so one ``except`` clause serves code written
for either library. All of them survive a pickle round trip with their fields.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._policy import RestartRecord

__all__ = [
    "ProcessException",
    "ProcessExitedException",
    "ProcessHungException",
    "ProcessRaisedException",
    "RemoteTraceback",
]


class ProcessException(Exception):
    """Root of the exceptions raised when a rank of a group fails.

    Raised (through one of its subclasses) by ``join()``, ``spawn()``,
    ``start_processes()`` and the ``async with`` block of a group, once the
    failing rank's siblings have been shut down and reaped.

    Attributes:
        msg: The message, as passed to the constructor.
        error_index: The rank that failed.
        error_pid: The process id the failed rank had.
        restarts: With a restart policy, the failures it acted on, oldest
            first, ending with this one when the policy gave up
            (:class:`aiospawn.RestartRecord`); empty otherwise.
    """

    restarts: tuple[RestartRecord, ...] = ()

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid), self.__dict__


class ProcessRaisedException(ProcessException):
    """A rank's function raised an exception (or returned a value that cannot be pickled).

    Raised where :class:`ProcessException` is. The message is the rank's
    formatted traceback, introduced as ``torch.multiprocessing`` does::

        -- Process 1 terminated with the following error:
        Traceback (most recent call last):
          ...
        ValueError: bad shard

    ``__cause__`` is the rank's own exception when it could be pickled and
    unpickled, otherwise a :class:`RemoteTraceback` holding the same text.
    """


class ProcessExitedException(ProcessException):
    """A rank's process ended with a non-zero exit code, or was killed by a signal.

    Raised where :class:`ProcessException` is.

    Attributes:
        exit_code: The exit code; negative for a signal, as in ``multiprocessing``.
        signal_name: The signal's name (``"SIGKILL"``) when a signal ended the
            process, else ``None``.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name)
        return type(self), args, self.__dict__


class ProcessHungException(ProcessException):
    """A rank stopped sending heartbeats (``heartbeat_timeout``), or never began.

    Raised where :class:`ProcessException` is, after the hung rank and its
    siblings were shut down. The message ends with every thread's Python
    stack, taken from the rank itself before it was stopped, or says why no
    stack could be taken.

    Attributes:
        seconds: Seconds since its last heartbeat (or since it started, if it
            never beat) when it was found hung.
        stack: The stacks of its threads as ``faulthandler`` writes them, or
            ``None`` if the rank did not answer (it blocked every signal, or
            was stuck in the kernel).
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        seconds: float,
        stack: str | None = None,
    ) -> None:
        super().__init__(msg, error_index, error_pid)
        self.seconds = seconds
        self.stack = stack

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.msg, self.error_index, self.error_pid, self.seconds, self.stack)
        return type(self), args, self.__dict__


class RemoteTraceback(Exception):
    """Stands in for a rank's exception that could not cross the process boundary.

    It becomes the ``__cause__`` of a :class:`ProcessRaisedException` when
    the rank's exception could not be pickled in the rank or unpickled here
    (for example a class whose ``__init__`` needs arguments that ``args`` does
    not hold); ``ctx.call()`` raises it in place of a handler's exception
    that could not cross.

    Attributes:
        type_name: The qualified name of the rank's exception class.
        traceback: The rank's formatted traceback.
    """

    def __init__(self, type_name: str, traceback: str) -> None:
        super().__init__(type_name, traceback)
        self.type_name = type_name
        self.traceback = traceback

    def __str__(self) -> str:
        return f"{self.type_name} (not picklable); traceback from the rank:\n{self.traceback}"


def signal_name(exit_code: int) -> str:
    """Return the name of the signal behind a negative exit code, e.g. ``"SIGKILL"``."""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"<Unknown signal {-exit_code}>"


def describe_exit(exit_code: int) -> str:
    """Describe an exit code as users read it: ``SIGKILL (-9)`` or ``exit code 3``."""
    if exit_code < 0:
        return f"{signal_name(exit_code)} ({exit_code})"
    return f"exit code {exit_code}"


def hung_message(
    rank: int, pid: int, seconds: float, *, began: bool, timeout: float, stack: str | None
) -> str:
    """The message of a :class:`ProcessHungException`, stack included."""
    if began:
        what = f"sent no heartbeat for {seconds:.1f} s (heartbeat_timeout={timeout:g})"
    else:
        what = f"sent no first heartbeat in {seconds:.1f} s (startup_timeout={timeout:g})"
    message = f"process {rank} (pid {pid}) is hung: it {what}"
    if stack is None:
        return (
            f"{message}\nno stack could be taken: the rank did not answer the stack"
            " request; it blocks signals, is stuck in the kernel, or had not finished"
            " importing its modules"
        )
    return f"{message}\nits threads' Python stacks when it was found hung:\n\n{stack}"


def broken_channel_message(rank: int, pid: int, reason: str) -> str:
    """The message of the :class:`ProcessException` of a rank whose channel carried a bad frame."""
    return (
        f"process {rank} (pid {pid}) broke its channel: it sent {reason}; aiospawn stopped it."
        " Only aiospawn writes to a rank's channel: code in the rank that writes to the"
        " channel's descriptor itself (or closes it and reuses its number) breaks it"
    )


def raised_message(rank: int, traceback_text: str) -> str:
    """The message of a :class:`ProcessRaisedException`, as torch formats it."""
    return f"\n\n-- Process {rank} terminated with the following error:\n{traceback_text}"


def exited_message(
    rank: int, exit_code: int, *, detail: str | None = None, killed_by_us: bool = False
) -> str:
    """The message of a :class:`ProcessExitedException`.

    The first sentence is torch's. A SIGKILL that aiospawn did not send gets a
    hint, since it is nearly always the kernel's out-of-memory killer.
    """
    if exit_code < 0:
        message = f"process {rank} terminated with signal {signal_name(exit_code)}"
        if killed_by_us:
            message += " (sent by aiospawn while shutting the group down)"
        elif exit_code == -signal.SIGKILL and not detail:  # the detail knows better
            message += (
                " (aiospawn did not send it; the out-of-memory killer is the usual"
                " cause: see `dmesg` or the container's memory limit)"
            )
    else:
        message = f"process {rank} terminated with exit code {exit_code}"
        if killed_by_us:
            message += " (after aiospawn asked it to stop)"
    if detail:
        message += f": {detail}"
    return message
