"""aiospawn.sync's failures are torch's exception classes too, once torch is loaded.

Code written for torch catches ``torch.multiprocessing.ProcessRaisedException``
(accelerate imports it by name); through the one-line swap, the failure
aiospawn.sync raises must be caught there, and still by aiospawn's classes
(``aiospawn._torch_errors``). This process must not load torch (it forks
ranks), so most tests put a module of torch's shape where aiospawn looks for
torch's spawn module (:func:`torch_spawn`); they run without torch installed.
The real torch is checked in a fresh interpreter (``tests/torch_errors_probe.py``).
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import aiospawn
import aiospawn.sync as mp
from aiospawn._torch_errors import for_torch
from tests import ranks

ROOT = Path(__file__).resolve().parent.parent


# torch 2.13's three classes, in shape (torch/multiprocessing/spawn.py): slots,
# an __init__ that wants all of its arguments, a __reduce__ of their own.


class TorchProcessException(Exception):
    __slots__ = ["error_index", "error_pid"]

    def __init__(self, msg: str, error_index: int, error_pid: int) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.msg, self.error_index, self.error_pid)


class TorchProcessRaisedException(TorchProcessException):
    pass


class TorchProcessExitedException(TorchProcessException):
    __slots__ = ["exit_code"]

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
        return type(self), args


@pytest.fixture
def torch_spawn(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A module of torch's shape, as ``torch.multiprocessing.spawn`` in ``sys.modules``."""
    module = types.ModuleType("torch.multiprocessing.spawn")
    module.ProcessException = TorchProcessException  # type: ignore[attr-defined]
    module.ProcessRaisedException = TorchProcessRaisedException  # type: ignore[attr-defined]
    module.ProcessExitedException = TorchProcessExitedException  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.multiprocessing.spawn", module)
    return module


@pytest.fixture
def without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if torch were not loaded, and any import of it failed."""
    monkeypatch.delitem(sys.modules, "torch.multiprocessing.spawn", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # type: ignore[arg-type]


def failing_group(how: str) -> mp.ProcessContext:
    """Two fork ranks: rank 1 does ``how`` (a crash row), rank 0 waits to be stopped."""
    return mp.start_processes(
        ranks.crash_row, args=(how, 1), nprocs=2, join=False, start_method="fork"
    )


def join_until_done(ctx: mp.ProcessContext) -> None:
    while not ctx.join():
        pass


# Through aiospawn.sync ---------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "ours", "fields"),
    [
        pytest.param(
            "raise ValueError",
            aiospawn.ProcessRaisedException,
            {"error_index": 1},
            id="raised",
        ),
        pytest.param(
            "sys.exit(3)",
            aiospawn.ProcessExitedException,
            {"error_index": 1, "exit_code": 3, "signal_name": None},
            id="exited",
        ),
        pytest.param(
            "SIGKILL",
            aiospawn.ProcessExitedException,
            {"error_index": 1, "exit_code": -9, "signal_name": "SIGKILL"},
            id="killed",
        ),
    ],
)
def test_a_failure_is_caught_as_torchs_class_and_as_aiospawns(
    torch_spawn: Any, how: str, ours: type[aiospawn.ProcessException], fields: dict[str, Any]
) -> None:
    theirs = {
        aiospawn.ProcessRaisedException: torch_spawn.ProcessRaisedException,
        aiospawn.ProcessExitedException: torch_spawn.ProcessExitedException,
    }[ours]
    ctx = failing_group(how)
    caught = []
    for _ in range(2):  # the failure, then the equal one a later join() raises
        try:
            join_until_done(ctx)
        except theirs as exc:  # as code written for torch catches it
            caught.append(exc)
    for exc in caught:
        assert isinstance(exc, ours)
        assert isinstance(exc, torch_spawn.ProcessException)
        assert {name: getattr(exc, name) for name in fields} == fields
        assert exc.error_pid == ctx.pids()[1]
        assert str(exc) == exc.msg
        assert exc.args == (exc.msg,)
        # Named and printed as aiospawn's class.
        assert (type(exc).__module__, type(exc).__qualname__) == ("aiospawn", ours.__name__)
    first, again = caught
    assert again is not first
    assert again.msg == first.msg
    if ours is aiospawn.ProcessRaisedException:
        assert repr(first.__cause__) == repr(again.__cause__) == repr(ValueError("bad shard 1"))
        assert first.__suppress_context__


def test_a_group_stopped_by_terminate_reports_torchs_exited_class(torch_spawn: Any) -> None:
    ctx = mp.start_processes(ranks.sleep_forever, nprocs=2, join=False, start_method="fork")
    ctx.terminate()
    with pytest.raises(torch_spawn.ProcessExitedException) as caught:
        ctx.join()
    assert isinstance(caught.value, aiospawn.ProcessExitedException)
    assert (caught.value.error_index, caught.value.signal_name) == (0, "SIGTERM")


def test_without_torch_loaded_a_failure_is_aiospawns_own_class(without_torch: None) -> None:
    # Nothing imports torch for it: the import would fail here.
    ctx = failing_group("raise ValueError")
    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        join_until_done(ctx)
    assert type(caught.value) is aiospawn.ProcessRaisedException
    assert for_torch(caught.value) is caught.value


# The combined classes ------------------------------------------------------------


def some_failures() -> list[aiospawn.ProcessException]:
    """One failure of each of aiospawn's classes, with a cause, a note and a traceback."""
    failures: list[aiospawn.ProcessException] = [
        aiospawn.ProcessException("stuck", 2, 102),
        aiospawn.ProcessRaisedException("raised", 1, 101),
        aiospawn.ProcessExitedException("exited", 0, 100, -15, "SIGTERM"),
        aiospawn.ProcessHungException("hung", 3, 103, 12.5, "stack"),
    ]
    for failure in failures:
        try:
            raise failure from ValueError("the rank's own")
        except aiospawn.ProcessException as exc:
            exc.add_note("a note")
    failures[1].restarts = ("a restart record",)  # type: ignore[assignment]
    return failures


def fields(error: BaseException) -> dict[str, Any]:
    names = ["msg", "error_index", "error_pid", "exit_code", "signal_name", "seconds", "stack"]
    found = {name: getattr(error, name) for name in names if hasattr(error, name)}
    return found | {"args": error.args, "restarts": getattr(error, "restarts", None)}


def test_each_failure_becomes_torchs_counterpart_with_every_field_and_link(
    torch_spawn: Any,
) -> None:
    counterparts = [
        torch_spawn.ProcessException,
        torch_spawn.ProcessRaisedException,
        torch_spawn.ProcessExitedException,
        torch_spawn.ProcessException,  # a hung rank: torch has no such class
    ]
    for error, theirs in zip(some_failures(), counterparts, strict=True):
        twin = for_torch(error)
        assert isinstance(twin, theirs)
        assert isinstance(twin, type(error))
        assert fields(twin) == fields(error)
        assert (str(twin), repr(twin)) == (str(error), repr(error))
        assert twin.__cause__ is error.__cause__
        assert twin.__suppress_context__
        assert twin.__notes__ == ["a note"]
        assert twin.__traceback__ is error.__traceback__
        assert for_torch(twin) is twin  # already torch's
    # One combined class per pair, whichever failure made it.
    assert type(for_torch(aiospawn.ProcessRaisedException("a", 0, 1))) is type(
        for_torch(aiospawn.ProcessRaisedException("b", 1, 2))
    )


def test_a_combined_failure_pickles_as_combined_where_torch_is_loaded_else_as_aiospawns(
    torch_spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for error in some_failures():
        twin = for_torch(error)
        assert isinstance(twin, torch_spawn.ProcessException)
        data = pickle.dumps(twin)
        copy = pickle.loads(data)
        assert type(copy) is type(twin)
        assert fields(copy) == fields(twin)
        assert copy.__notes__ == ["a note"]
        # Unpickled where torch is not loaded: aiospawn's own class.
        with monkeypatch.context() as elsewhere:
            elsewhere.delitem(sys.modules, "torch.multiprocessing.spawn")
            plain = pickle.loads(data)
        assert type(plain) is type(error)
        assert fields(plain) == fields(error)


class RefusingProcessException(Exception):
    """A torch class that no class can derive from (a torch of the future, say)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("no subclasses")


def test_a_failure_is_still_reported_when_torchs_classes_cannot_be_combined(
    torch_spawn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ProcessException", "ProcessRaisedException", "ProcessExitedException"):
        monkeypatch.setattr(torch_spawn, name, RefusingProcessException)
    for error in some_failures():
        assert for_torch(error) is error
    ctx = failing_group("raise ValueError")
    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        join_until_done(ctx)
    assert type(caught.value) is aiospawn.ProcessRaisedException
    assert repr(caught.value.__cause__) == repr(ValueError("bad shard 1"))


def test_without_torch_loaded_a_failure_is_left_as_it_is(without_torch: None) -> None:
    for error in some_failures():
        assert for_torch(error) is error


# The real torch ------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="checks torch's own classes: needs torch (pip install torch==2.13.0)",
)
def test_plain_except_clauses_of_torchs_classes_catch_aiospawn_syncs_failures() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.torch_errors_probe"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # a tripwire: importing torch takes seconds on a busy machine
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    # Before torch is loaded: aiospawn's own class, and the failure did not load torch.
    assert report["before"] == {"aiospawns_own_class": True, "torch_loaded": False}
    assert report["raised"] == {
        "aiospawn": True,
        "class": "aiospawn.ProcessRaisedException",
        "index": 1,
        "cause": repr(ValueError("bad shard 1")),
        "pickled": {"torch": True, "aiospawn": True, "fields": [True, 1, True]},
    }
    assert report["exited"] == {"aiospawn": True, "index": 1, "exit_code": 3, "signal_name": None}
    assert report["killed"] == {
        "class": "ProcessExitedException",
        "aiospawn": True,
        "signal_name": "SIGKILL",
    }
