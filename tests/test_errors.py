"""The exceptions (``_errors``): pickle round trips with every field, and message formats."""

from __future__ import annotations

import pickle
import signal

import pytest

import aiospawn
from aiospawn._core._errors import describe_exit, exited_message, raised_message, signal_name

PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)


def round_trip(error: BaseException, protocol: int) -> BaseException:
    return pickle.loads(pickle.dumps(error, protocol=protocol))  # type: ignore[no-any-return]


def test_the_hierarchy() -> None:
    assert issubclass(aiospawn.ProcessException, Exception)
    assert issubclass(aiospawn.ProcessRaisedException, aiospawn.ProcessException)
    assert issubclass(aiospawn.ProcessExitedException, aiospawn.ProcessException)
    assert not issubclass(aiospawn.RemoteTraceback, aiospawn.ProcessException)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("cls", [aiospawn.ProcessException, aiospawn.ProcessRaisedException])
def test_process_exception_round_trip(cls: type[aiospawn.ProcessException], protocol: int) -> None:
    error = cls("Oh no!", 1, 1)
    error.add_note("a note")
    copy = round_trip(error, protocol)
    assert type(copy) is cls
    assert isinstance(copy, cls)
    assert (copy.msg, copy.error_index, copy.error_pid) == ("Oh no!", 1, 1)
    assert copy.args == error.args == ("Oh no!",)
    assert str(copy) == "Oh no!"
    assert copy.__notes__ == ["a note"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("args", "signal_name"),
    [(("Oh no!", 1, 1, 1), None), (("Oh no!", 2, 4242, -9, "SIGKILL"), "SIGKILL")],
)
def test_process_exited_exception_round_trip(
    args: tuple[object, ...], signal_name: str | None, protocol: int
) -> None:
    error = aiospawn.ProcessExitedException(*args)  # type: ignore[arg-type]
    error.add_note("a note")
    copy = round_trip(error, protocol)
    assert type(copy) is aiospawn.ProcessExitedException
    fields = (copy.msg, copy.error_index, copy.error_pid, copy.exit_code, copy.signal_name)
    assert fields == (*args[:4], signal_name)
    assert str(copy) == "Oh no!"
    assert copy.__notes__ == ["a note"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_remote_traceback_round_trip(protocol: int) -> None:
    text = 'Traceback (most recent call last):\n  File "x.py", line 1\npkg.ShardError: torn\n'
    error = aiospawn.RemoteTraceback("pkg.ShardError", text)
    error.add_note("a note")
    copy = round_trip(error, protocol)
    assert type(copy) is aiospawn.RemoteTraceback
    assert (copy.type_name, copy.traceback) == ("pkg.ShardError", text)
    assert str(copy) == f"pkg.ShardError (not picklable); traceback from the rank:\n{text}"
    assert copy.__notes__ == ["a note"]


def test_raised_message_is_torchs() -> None:
    text = "Traceback (most recent call last):\n  ...\nValueError: bad shard\n"
    assert raised_message(3, text) == (
        "\n\n-- Process 3 terminated with the following error:\n" + text
    )


BY_US = " (sent by aiospawn while shutting the group down)"
OOM_HINT = (
    " (aiospawn did not send it; the out-of-memory killer is the usual cause:"
    " see `dmesg` or the container's memory limit)"
)


@pytest.mark.parametrize(
    ("rank", "exit_code", "kwargs", "message"),
    [
        (0, 3, {}, "process 0 terminated with exit code 3"),
        (
            2,
            1,
            {"detail": "sys.exit('no GPU')"},
            "process 2 terminated with exit code 1: sys.exit('no GPU')",
        ),
        (
            1,
            1,
            {"killed_by_us": True},
            "process 1 terminated with exit code 1 (after aiospawn asked it to stop)",
        ),
        (1, -15, {}, "process 1 terminated with signal SIGTERM"),
        (1, -15, {"killed_by_us": True}, "process 1 terminated with signal SIGTERM" + BY_US),
        (1, -9, {"killed_by_us": True}, "process 1 terminated with signal SIGKILL" + BY_US),
        (1, -9, {}, "process 1 terminated with signal SIGKILL" + OOM_HINT),
        (4, -11, {}, "process 4 terminated with signal SIGSEGV"),
        (0, -99, {}, "process 0 terminated with signal <Unknown signal 99>"),
    ],
)
def test_exited_message(rank: int, exit_code: int, kwargs: dict[str, object], message: str) -> None:
    assert exited_message(rank, exit_code, **kwargs) == message  # type: ignore[arg-type]


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGKILL) == "SIGKILL (-9)"
    assert describe_exit(3) == "exit code 3"
    assert signal_name(-signal.SIGTERM) == "SIGTERM"
