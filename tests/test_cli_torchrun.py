"""``aiospawn run`` with torchrun's flags: their parsing, their effect in the ranks, refusals.

Each flag is run for real through the launcher (2 ranks); a refusal is a
usage error: exit status 2, one line on stderr, nothing started. Devices are
tested without a GPU: the value of ``CUDA_VISIBLE_DEVICES`` is the contract.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from aiospawn import _cli as cli
from tests.cli_helpers import (
    Launcher,
    basetemp_first,
    by_rank,
    environ,
    json_by_rank,
    launchers,
    program,
    run,
    start,
)
from tests.helpers import is_gone, wait_until

__all__ = ["basetemp_first", "launchers"]  # fixtures


def shown(*args: str, names: tuple[str, ...], env: dict[str, str] | None = None) -> dict[int, dict]:
    """Run show_vars.py as 2 ranks with ``args`` before it; return each rank's variables."""
    result = run("run", "-n", "2", *args, program("show_vars.py"), *names, env=env)
    assert result.returncode == 0, result.stderr
    return json_by_rank(result.stdout)


# ------------------------------------------------------------------ spellings and env


def test_underscore_spellings_and_single_machine_flags_are_accepted() -> None:
    result = run(
        "run",
        "--standalone",
        "--nnodes=1",
        "--node_rank=0",
        "--nproc_per_node=2",
        "--max_restarts=0",
        "--monitor_interval=0.1",
        "--start_method=spawn",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--run_path",
        program("show_vars.py"),
        "WORLD_SIZE",
    )
    assert result.returncode == 0, result.stderr
    assert {rank: vars["WORLD_SIZE"] for rank, vars in json_by_rank(result.stdout).items()} == {
        0: "2",
        1: "2",
    }


def test_ranks_get_the_rest_of_torchruns_environment() -> None:
    names = (
        "ROLE_NAME",
        "ROLE_RANK",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
        "TORCHELASTIC_ERROR_FILE",
        "GROUP_WORLD_SIZE",
    )
    first = shown("--max-restarts", "2", names=names)
    second = shown(names=names)
    for rank in (0, 1):
        variables = first[rank]
        assert variables["ROLE_NAME"] == "default"
        assert variables["ROLE_RANK"] == str(rank)
        assert variables["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert variables["TORCHELASTIC_RESTART_COUNT"] == "0"
        # torchrun's default, in its order.
        assert variables["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        assert variables["GROUP_WORLD_SIZE"] == "1"
        assert variables["TORCHELASTIC_ERROR_FILE"].endswith(f"-rank{rank}.error.json")
    # One run id per run, the same in every rank, new for the next run.
    assert first[0]["TORCHELASTIC_RUN_ID"] == first[1]["TORCHELASTIC_RUN_ID"]
    assert first[0]["TORCHELASTIC_RUN_ID"] != second[0]["TORCHELASTIC_RUN_ID"]
    # A rank's error file exists only if the rank writes one.
    assert not Path(first[0]["TORCHELASTIC_ERROR_FILE"]).exists()


@pytest.mark.parametrize("flag", ["--run-id", "--run_id", "--rdzv-id", "--rdzv_id"])
def test_run_id_sets_torchelastic_run_id(flag: str) -> None:
    variables = shown(flag, "job-42", names=("TORCHELASTIC_RUN_ID",))
    assert {rank: v["TORCHELASTIC_RUN_ID"] for rank, v in variables.items()} == {
        0: "job-42",
        1: "job-42",
    }


def test_role_names_the_role_and_the_line_prefix() -> None:
    result = run("run", "-n", "2", "--role", "trainer", program("show_vars.py"), "ROLE_NAME")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        '[trainer0]: {"ROLE_NAME": "trainer"}',
        '[trainer1]: {"ROLE_NAME": "trainer"}',
    ]


def test_master_port_is_the_one_given() -> None:
    variables = shown(
        "--master-port", "29555", "--master-addr", "localhost", names=("MASTER_PORT",)
    )
    assert {v["MASTER_PORT"] for v in variables.values()} == {"29555"}


def test_a_static_rendezvous_endpoint_on_one_machine_gives_the_master_port() -> None:
    # As torchrun's: the static endpoint stands for --master-addr/--master-port.
    variables = shown("--rdzv-endpoint", "127.0.0.1:29557", names=("MASTER_PORT",))
    assert {v["MASTER_PORT"] for v in variables.values()} == {"29557"}


def test_env_wins_over_torchruns_variables() -> None:
    variables = shown("--env", "ROLE_NAME=mine", names=("ROLE_NAME",))
    assert {v["ROLE_NAME"] for v in variables.values()} == {"mine"}


# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    ("args", "visible", "expected"),
    [
        (["--devices-per-rank", "2", "--devices", "0,1,2,3"], None, ["0,1", "2,3"]),
        (["--devices", "5,7"], None, ["5", "7"]),
        (["--devices-per-rank", "1"], "4,5,6", ["4", "5"]),
        (["--devices-per-rank", "0"], "4,5", ["", ""]),
        (["--virtual-local-rank"], "6,7", ["6", "7"]),
        (["--virtual_local_rank"], None, ["0", "1"]),
    ],
    ids=[
        "per-rank-from-list",
        "list-split",
        "per-rank-from-visible",
        "none",
        "virtual",
        "virtual-",
    ],
)
def test_devices_set_cuda_visible_devices_per_rank(
    args: list[str], visible: str | None, expected: list[str]
) -> None:
    env = environ(CUDA_VISIBLE_DEVICES=visible)
    variables = shown(*args, names=("CUDA_VISIBLE_DEVICES", "LOCAL_RANK"), env=env)
    assert [variables[rank]["CUDA_VISIBLE_DEVICES"] for rank in (0, 1)] == expected
    virtual = any(arg.startswith("--virtual") for arg in args)
    assert [variables[rank]["LOCAL_RANK"] for rank in (0, 1)] == (
        ["0", "0"] if virtual else ["0", "1"]
    )


def test_without_device_options_the_ranks_see_the_launchers_devices() -> None:
    variables = shown(names=("CUDA_VISIBLE_DEVICES",), env=environ(CUDA_VISIBLE_DEVICES="2,3"))
    assert {v["CUDA_VISIBLE_DEVICES"] for v in variables.values()} == {"2,3"}


def test_nproc_per_node_gpu_is_one_rank_per_visible_device() -> None:
    result = run(
        "run",
        "--nproc-per-node",
        "gpu",
        program("show_vars.py"),
        "WORLD_SIZE",
        env=environ(CUDA_VISIBLE_DEVICES="0,1"),
    )
    assert result.returncode == 0, result.stderr
    assert sorted(json_by_rank(result.stdout)) == [0, 1]


# ---------------------------------------------------------------------------- output


def test_redirects_and_tee_maps_choose_streams_per_rank(tmp_path: Path) -> None:
    # Rank 0: both streams to files, stdout also to the terminal; rank 1: stderr to a file.
    result = run(
        "run",
        "-n",
        "2",
        "--log-dir",
        str(tmp_path),
        "-r",
        "0:3,1:2",
        "-t",
        "0:1",
        program("show_vars.py"),
        "RANK",
    )
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {0: ['{"RANK": "0"}'], 1: ['{"RANK": "1"}']}
    assert result.stderr == ""
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "rank0.stderr",
        "rank0.stdout",
        "rank1.stderr",
    ]
    assert (tmp_path / "rank0.stdout").read_text() == '{"RANK": "0"}\n'
    assert (tmp_path / "rank1.stderr").read_text() == "stderr of rank 1\n"


def test_tee_3_writes_both_streams_to_files_and_the_terminal(tmp_path: Path) -> None:
    result = run(
        "run", "-n", "2", "--log-dir", str(tmp_path), "--tee", "3", program("show_vars.py"), "RANK"
    )
    assert result.returncode == 0, result.stderr
    assert sorted(by_rank(result.stdout)) == [0, 1]
    assert sorted(result.stderr.splitlines()) == [
        "[rank0]: stderr of rank 0",
        "[rank1]: stderr of rank 1",
    ]
    assert len(list(tmp_path.iterdir())) == 4


def test_local_ranks_filter_shows_only_those_ranks(tmp_path: Path) -> None:
    plain = run("run", "-n", "2", "--local-ranks-filter", "1", program("show_vars.py"), "RANK")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == '[rank1]: {"RANK": "1"}\n'
    assert plain.stderr == "[rank1]: stderr of rank 1\n"
    teed = run(
        "run",
        "-n",
        "2",
        "--log-dir",
        str(tmp_path),
        "--tee",
        "3",
        "--local_ranks_filter",
        "0",
        program("show_vars.py"),
        "RANK",
    )
    assert teed.returncode == 0, teed.stderr
    assert teed.stdout == '[rank0]: {"RANK": "0"}\n'
    # A filtered rank's files are still written.
    assert (tmp_path / "rank1.stdout").read_text() == '{"RANK": "1"}\n'


def test_a_bare_tee_before_the_script_is_aiospawns_tee(tmp_path: Path) -> None:
    result = run("run", "-n", "2", "--log-dir", str(tmp_path), "--tee", program("show_vars.py"))
    assert result.returncode == 0, result.stderr
    assert sorted(by_rank(result.stdout)) == [0, 1]
    assert (tmp_path / "rank1.stderr").read_text() == "stderr of rank 1\n"


# ----------------------------------------------------------------- supervision flags


def test_shutdown_timeout_is_the_wait_from_sigterm_to_sigkill(launchers: list[Launcher]) -> None:
    launcher = start(
        launchers,
        "run",
        "-n",
        "2",
        "--shutdown-timeout",
        "0.5",
        program("sleeper.py"),
        "ignore-term",
    )
    pids = launcher.ready_pids(2)
    launcher.signal(signal.SIGTERM)
    status, _, err = launcher.finish()
    assert status == 143, err
    assert "SIGKILL after 0.5 s" in err
    assert err.count("SIGKILL (-9), stopped by aiospawn") == 2
    assert all(is_gone(pid) for pid in pids)


def test_signals_to_handle_passes_a_signal_on_to_the_ranks(launchers: list[Launcher]) -> None:
    launcher = start(
        launchers,
        "run",
        "-n",
        "2",
        "--signals-to-handle",
        "SIGTERM,SIGUSR1",
        "--grace-period",
        "30",
        program("on_signal.py"),
        "SIGUSR1",
    )
    pids = launcher.ready_pids(2)
    launcher.signal(signal.SIGUSR1)
    status, out, err = launcher.finish()
    assert status == 128 + signal.SIGUSR1, err
    assert sorted(line.split(": ", 1)[1] for line in out.splitlines() if "got" in line) == sorted(
        f"got SIGUSR1 {pid}" for pid in pids
    )
    assert "SIGUSR1 received: sent on to the ranks" in err
    assert all(is_gone(pid) for pid in pids)


def test_a_signal_not_in_signals_to_handle_is_not_handled(launchers: list[Launcher]) -> None:
    # Only SIGUSR1 is handled: SIGHUP takes its default action on the launcher,
    # which cannot clean up after itself: its temp files go to a dir of its own.
    tmp = tempfile.mkdtemp(prefix="aiospawn-cli-")
    try:
        launcher = start(
            launchers,
            "run",
            "-n",
            "2",
            "--signals-to-handle",
            "SIGUSR1",
            program("sleeper.py"),
            env=environ(TMPDIR=tmp),
            hangup_default=True,  # as from a shell, even if this run ignores SIGHUP (nohup)
        )
        pids = launcher.ready_pids(2)
        launcher.signal(signal.SIGHUP)
        status, _, _ = launcher.finish()
        assert status == -signal.SIGHUP
        # The ranks die with their launcher (the parent-death guard).
        assert wait_until(lambda: all(is_gone(pid) for pid in pids), 10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_restart_strategy_one_for_one_restarts_the_failed_rank_alone() -> None:
    result = run(
        "run",
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--restart-strategy",
        "one_for_one",
        "--restart-backoff",
        "0.25",
        program("fail_first_run.py"),
    )
    assert result.returncode == 0, result.stderr
    assert "failed (exit code 3); restarting it in 0.25 s" in result.stderr
    # The warning's lines after the first (the rank's error) are the launcher's too.
    warning = result.stderr[result.stderr.index("aiospawn: Rank 1") :].splitlines()
    assert len(warning) > 1, warning
    assert all(line.startswith("aiospawn: ") for line in warning), warning
    runs = [json.loads(line.split(": ", 1)[1]) for line in result.stdout.splitlines()]
    assert sorted((run["rank"], run["restart"]) for run in runs) == [
        ("0", "0"),
        ("1", "0"),
        ("1", "1"),
    ]


def test_startup_timeout_finds_a_rank_that_never_beats() -> None:
    result = run(
        "run", "-n", "2", "--startup-timeout", "1", "--grace-period", "1", program("sleeper.py")
    )
    assert result.returncode == 1, result.stderr
    assert re.search(
        r"root cause\): process \d \(pid \d+\) is hung: it sent no first", result.stderr
    )


def test_heartbeat_timeout_finds_a_rank_that_stopped_beating() -> None:
    result = run(
        "run", "-n", "2", "--heartbeat-timeout", "1", "--grace-period", "1", program("beat_once.py")
    )
    assert result.returncode == 1, result.stderr
    assert re.search(r"root cause\): process \d \(pid \d+\) is hung: .*heartbeat", result.stderr)
    assert "beat_once.py" in result.stderr  # the hung rank's stack


# ------------------------------------------------------------------------ error file


def test_error_file_holds_the_root_cause_in_torchruns_shape(tmp_path: Path) -> None:
    target = tmp_path / "error.json"
    result = run(
        "run",
        "-n",
        "2",
        "--grace-period",
        "1",
        program("fail.py"),
        "raise",
        "1",
        env=environ(TORCHELASTIC_ERROR_FILE=str(target)),
    )
    assert result.returncode == 1
    data = json.loads(target.read_text())
    message = data["message"]
    assert message["message"] == "ValueError: cli: a bad shard"
    assert message["errorCode"] == 1
    assert message["extraInfo"]["timestamp"].isdigit()
    callstack = message["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):")
    assert 'raise ValueError("cli: a bad shard")' in callstack
    # The user's frames alone, as in the rank's own stderr: not the wrappers
    # that ran the script, nor the rule that called them.
    frames = [line for line in callstack.splitlines() if line.startswith("  File")]
    assert frames, callstack
    assert all(line.startswith(f'  File "{program("fail.py")}"') for line in frames), frames


def test_error_file_copies_a_ranks_recorded_error(tmp_path: Path) -> None:
    target = tmp_path / "error.json"
    target.write_text("an older run's file")
    result = run(
        "run",
        "-n",
        "2",
        "--grace-period",
        "1",
        program("record_error.py"),
        env=environ(TORCHELASTIC_ERROR_FILE=str(target)),
    )
    assert result.returncode == 5
    assert json.loads(target.read_text()) == {
        "message": {
            "message": "RuntimeError: recorded by rank 1",
            "extraInfo": {"py_callstack": "Traceback: recorded", "timestamp": "1700000000"},
            "errorCode": 5,
        }
    }


def test_error_file_for_a_signal_names_it(tmp_path: Path) -> None:
    target = tmp_path / "error.json"
    result = run(
        "run",
        "-n",
        "2",
        "--grace-period",
        "1",
        program("fail.py"),
        "sigkill",
        "0",
        env=environ(TORCHELASTIC_ERROR_FILE=str(target)),
    )
    assert result.returncode == 137
    message = json.loads(target.read_text())["message"]
    assert message["message"].startswith("Signal 9 (SIGKILL) received by PID ")
    assert message["errorCode"] == -9


def test_no_error_file_after_success(tmp_path: Path) -> None:
    target = tmp_path / "error.json"
    result = run(
        "run", "-n", "2", program("show_vars.py"), env=environ(TORCHELASTIC_ERROR_FILE=str(target))
    )
    assert result.returncode == 0, result.stderr
    assert not target.exists()


# -------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("args", "words"),
    [
        # More nodes join a rendezvous (tests/test_cli_nodes.py); these cannot.
        (["--nnodes=1:4"], "its node count is fixed"),
        (["--nnodes", "2", "--rdzv-backend", "etcd"], "use c10d"),
        (["--node_rank", "1"], "no rendezvous"),
        (["--rdzv-backend", "etcd"], "no rendezvous"),
        (["--rdzv_endpoint", "10.0.0.1:29400"], "no rendezvous"),
        (["--rdzv-conf", "timeout=900"], "no rendezvous"),
        (["--master-addr", "10.0.0.1"], "127.0.0.1"),
        (["--master-port", "x"], "port number"),
        (["--master-port", "99999"], "from 1 to 65535, got '99999'"),
        (["--master-port", "0"], "from 1 to 65535, got '0'"),
        (["--rdzv-endpoint", "127.0.0.1:99999"], "from 0 to 65535, got '99999'"),
        (["--local-addr", "10.0.0.1"], "no rendezvous"),
        (["--logs-specs", "mine"], "--log-dir"),
        (["--duplicate-stdout-filters", "loss"], "grep"),
        (["--numa-binding", "node"], "numactl"),
        (["--devices-per-rank", "3", "--devices", "0,1,2,3"], "need 6, but 4 are given"),
        (["--devices", "0,1,2"], "do not split evenly"),
        (["--devices", "0,0"], "twice"),
        (["--virtual-local-rank", "--devices-per-rank", "2"], "one device"),
        (["--devices-per-rank", "-1"], "non-negative"),
        (["-r", "4"], "0, 1, 2 or 3"),
        (["-r", "3"], "--log-dir"),
        (["--redirects", "0:3,0:1", "--log-dir", "x"], "twice"),
        (["-r", "3", "--log-dir", "x", "--stdout", "devnull"], "use one"),
        (["--local-ranks-filter", "a"], "ranks such as"),
        (["--local-ranks-filter", "5"], "0..1"),
        (["--signals-to-handle", "SIGKILL"], "not SIGKILL"),
        (["--signals-to-handle", "SIGNOPE"], "signal names"),
        (["--shutdown-timeout", "1", "--grace-period", "1"], "give one"),
        (["--restart-strategy", "one_for_one"], "--max-restarts"),
        (["--restart-backoff", "1"], "--max-restarts"),
        (["--restart-strategy", "rest_for_one", "--max-restarts", "1"], "invalid choice"),
        (["--heartbeat-timeout", "0"], "more than 0"),
        (["--startup-timeout", "-1"], "non-negative"),
        (["--placement", "SPREAD"], "--ray"),
        (["--ray", "auto", "--log-dir", "x"], "Ray sends"),
        (["--ray", "auto", "--devices", "0"], "--devices-per-rank"),
        (["--ray", "auto", "--signals-to-handle", "SIGUSR1"], "Ray's workers"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_refusals_say_why_before_starting(
    args: list[str],
    words: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In this process: the command's parse and plan steps refuse before any
    # start (the launcher as a process is tested above and in test_cli.py).
    # A plan puts the target's directory first on sys.path, as the rank will.
    monkeypatch.setattr(sys, "path", list(sys.path))
    marker = tmp_path / "ran"
    assert cli.main(["run", "-n", "2", *args, program("touch.py"), str(marker)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("aiospawn: error: ")
    assert words in err
    assert not marker.exists()


def test_nproc_per_node_gpu_without_gpus_is_refused() -> None:
    env = environ(CUDA_VISIBLE_DEVICES="")
    result = run("run", "--nproc-per-node", "gpu", program("touch.py"), "x", env=env)
    assert result.returncode == 2
    assert "none is visible" in result.stderr


# ------------------------------------------------- a torchrun command line, as it is


@pytest.mark.torch
def test_a_tutorial_torchrun_command_line_runs_with_only_the_program_name_changed(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch", reason="the DDP script needs torch (pip install torch==2.13.0)")
    # pytorch/examples, distributed/ddp-tutorial-series/run_multigpu_torchrun.sh:
    #   torchrun --standalone --nproc_per_node=gpu multigpu_torchrun.py 50 10
    # Two "GPUs" are made visible; the CPU build of torch trains on gloo.
    line = ["--standalone", "--nproc_per_node=gpu", "multigpu_torchrun.py", "50", "10"]
    line[2] = program(line[2])
    # torch leaves its compiler's cache dir in the temp dir: one of the test's own.
    (tmp_path / "tmp").mkdir()
    env = environ(
        CUDA_VISIBLE_DEVICES="0,1", SNAPSHOT_DIR=str(tmp_path), TMPDIR=str(tmp_path / "tmp")
    )
    result = run("run", *line, env=env)
    assert result.returncode == 0, result.stderr
    reports = json_by_rank(result.stdout)
    assert sorted(reports) == [0, 1]
    assert reports[0]["checksum"] == reports[1]["checksum"]  # DDP kept the weights equal
    assert reports[0]["TORCHELASTIC_RUN_ID"] == reports[1]["TORCHELASTIC_RUN_ID"]
    assert (tmp_path / "snapshot.pt").exists()
