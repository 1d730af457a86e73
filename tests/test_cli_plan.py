"""The ``aiospawn run`` command line read and checked in this process: no rank starts.

``parse`` and ``Plan`` (``aiospawn._cli``) are called directly, as the launcher
calls them before anything starts; what only a launcher process shows (exit
status, the order of its lines, a rank's own view) is in ``test_cli.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

import aiospawn
from aiospawn._cli._parse import UsageError, parse, parser
from aiospawn._cli._plan import Plan
from aiospawn._local._limits import max_nprocs
from aiospawn._rank.programs import rank_script
from tests.cli_helpers import PROGRAMS, REPO, basetemp_first, program

__all__ = ["basetemp_first"]  # fixtures


@pytest.fixture(autouse=True)
def _keep_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # A plan puts the target's directory first on sys.path, as the rank will.
    monkeypatch.setattr(sys, "path", list(sys.path))


def plan(*argv: str) -> Plan:
    return Plan(parse(["run", *argv]))


def test_version_after_run_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["run", "--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"aiospawn {aiospawn.__version__}\n"


def test_version_after_the_target_is_the_targets() -> None:
    options = parse(["run", "script.py", "--version"])
    assert options.args == ["--version"]


@pytest.mark.parametrize(
    ("argv", "tee", "target", "args"),
    [
        # torchrun's value, or aiospawn's bare flag when the next word is no value.
        (["--tee", "3", "x.py"], "Std(3, {})", "x.py", []),
        (["-t", "0:3,1:1", "x.py"], "Std(0, {0: 3, 1: 1})", "x.py", []),
        (["--tee=2", "x.py"], "Std(2, {})", "x.py", []),
        (["--tee", "x.py", "3"], "files", "x.py", ["3"]),
        (["-t"], "files", None, []),
        # An option's value that reads as a word is never taken for TARGET.
        (["--role", "worker", "--tee", "x.py"], "files", "x.py", []),
        (["--log-dir", "logs", "-t", "x.py"], "files", "x.py", []),
        # After TARGET, -t and --tee are the target's.
        (["x.py", "--tee", "3"], None, "x.py", ["--tee", "3"]),
        (["--tee", "--", "x.py", "-t"], "files", "x.py", ["-t"]),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_tee_takes_torchruns_value_or_none(
    argv: list[str], tee: str | None, target: str | None, args: list[str]
) -> None:
    options = parse(["run", *argv])
    assert (None if options.tee is None else str(options.tee)) == tee
    assert options.target == target
    assert options.args == args


def test_every_option_of_run_that_takes_a_value_is_known_to_the_tee_reading() -> None:
    # The launcher learns them from what add_argument returned; argparse's own
    # list (private, read here only) says whether a declaration slipped past.
    top, takes_value = parser()
    (commands,) = (a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    run = commands.choices["run"]
    declared = {
        option
        for action in run._actions
        if action.option_strings and action.nargs is None
        for option in action.option_strings
    }
    assert "--nproc_per_node" in declared
    assert takes_value == declared


def test_a_fn_module_that_raises_at_import_is_explained_in_a_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    target = "tests.cli_programs.reads_rank_at_import:main"
    with pytest.raises(UsageError) as refused:
        plan("--fn", target)
    assert str(refused.value) == (
        f"--fn {target}: importing module 'tests.cli_programs.reads_rank_at_import' in the"
        " launcher, to check that the function exists, raised KeyError: 'RANK' (RANK is set"
        " in each rank, not in the launcher: read it when the function runs, not at import)"
    )


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_such_module_here:main", "no module named 'no_such_module_here'"),
        ("tests.no_such_module_here:main", "no module named 'tests.no_such_module_here'"),
        ("tests.cli_programs.functions:nope", "module 'tests.cli_programs.functions' has no"),
    ],
)
def test_a_fn_module_or_function_that_is_not_there_says_so(target: str, message: str) -> None:
    with pytest.raises(UsageError, match=f"^--fn {target}: {message}"):
        plan("--fn", target)


@pytest.mark.parametrize(
    ("value", "guess"),
    [("weird", ""), ("prefx", "did you mean 'prefix'? "), ("devnul", "did you mean 'devnull'? ")],
)
@pytest.mark.parametrize("stream", ["--stdout", "--stderr"])
def test_a_stream_value_that_looks_like_a_mistyped_mode_is_refused(
    stream: str, value: str, guess: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as refused:
        parse(["run", stream, value, "script.py"])
    assert str(refused.value) == (
        f"argument {stream}: {value!r} is neither a mode (prefix, inherit, devnull) nor an"
        f" existing directory; {guess}for a new directory, give a path: ./{value}"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["logs", "./new", "new/logs", "inherit"])
def test_a_stream_value_that_is_a_mode_or_a_directory_is_taken(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()  # an existing directory needs no path
    assert parse(["run", "--stdout", value, "--stderr", value, "script.py"]).stdout == value


def test_more_ranks_than_this_process_can_hold_is_a_usage_error_of_the_plan() -> None:
    # The fewest descriptors a rank can take: more ranks fail under every option.
    too_many = max_nprocs() + 1
    with pytest.raises(UsageError) as refused:
        plan("-n", str(too_many), program("touch.py"))
    assert str(refused.value).startswith(f"-n {too_many} is more than this process can supervise")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--ray", "auto", "--heartbeat-timeout", "5"],
            "--heartbeat-timeout and --startup-timeout are not available with --ray:",
        ),
        (["--ray", "auto", "--preload", "json"], "--preload warm-starts local ranks"),
        (
            ["--start-method", "fork", "--preload", "json"],
            "--preload forks ranks from a spawned template; --start-method fork copies",
        ),
        (["--ray", "auto", "--devices", "0,1"], "--devices 0,1 names devices of this machine;"),
    ],
    ids=["ray-heartbeats", "ray-preload", "fork-preload", "ray-devices"],
)
def test_what_the_backend_refuses_is_a_usage_error_in_flag_names(
    options: list[str], message: str
) -> None:
    # The backend's own check, in the command line's words: and with --ray,
    # without Ray (none needs to be installed to refuse).
    with pytest.raises(UsageError) as refused:
        plan("-n", "2", *options, program("touch.py"))
    assert str(refused.value).startswith(message)
    assert "=" not in str(refused.value)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["-n", "2", "--preload", "json"], {"OMP_NUM_THREADS": "1"}),
        (
            ["-n", "2", "--preload", "json", "--env", "OMP_NUM_THREADS=3", "--env", "X=1"],
            {"OMP_NUM_THREADS": "3"},
        ),
        (
            ["--preload", "json", "--env", "MKL_NUM_THREADS=2", "--env", "MASTER_PORT=1"],
            {"MKL_NUM_THREADS": "2"},
        ),
        (["--preload", "json"], {}),  # one rank: OMP_NUM_THREADS is left alone
        (["-n", "2"], {}),  # no template
    ],
    ids=["default", "env", "mkl", "one-rank", "no-preload"],
)
def test_a_template_gets_the_thread_counts_every_rank_gets(
    options: list[str], expected: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    checked = plan(*options, program("touch.py"))
    assert checked.template_env == expected
    for key, value in expected.items():
        assert checked.environment(None)(1)[key] == value  # what each rank gets


def test_a_script_sees_its_path_as_typed_and_its_file_absolute(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What python script.py does, and torchrun's ranks get (python -u script.py).
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    typed = os.path.join("tests", "cli_programs", "show_main.py")
    rank_script(0, typed, ["z"])
    shown = json.loads(capsys.readouterr().out)
    assert shown == {
        "name": "__main__",
        "argv": [typed, "z"],
        "path0": str(PROGRAMS),
        "file": str(PROGRAMS / "show_main.py"),
    }
    assert sys.modules["__main__"].__name__ == "__main__"
    assert getattr(sys.modules["__main__"], "__file__", None) != shown["file"]
