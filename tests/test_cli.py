"""The ``aiospawn`` command line, run for real in subprocesses.

Each test starts ``python -m aiospawn run ...`` (one test the installed
``aiospawn`` script) from the repository root, with the small programs of
``tests/cli_programs`` as targets. Tests that signal the launcher start it in
a session of its own, wait for the ranks' ``ready PID`` lines (no sleeping),
and check afterwards that no rank is left; a failed test kills what is left
of that session.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from aiospawn._local._limits import max_nprocs
from tests.cli_helpers import (
    LAUNCHER,
    PREFIXED,
    PROGRAMS,
    REPO,
    TRIPWIRE,
    Launcher,
    basetemp_first,
    by_rank,
    environ,
    json_by_rank,
    launchers,
    program,
    run,
    session_members,
    start,
)
from tests.helpers import is_gone, wait_until

__all__ = ["basetemp_first", "launchers"]  # fixtures

# ----------------------------------------------------------------- output and streams


def test_two_ranks_are_prefixed_and_print_nothing_else() -> None:
    result = run("run", "-n", "2", program("show_env.py"))
    assert result.returncode == 0, result.stderr
    assert sorted(json_by_rank(result.stdout)) == [0, 1]
    assert sorted(result.stderr.splitlines()) == [
        "[rank0]: stderr of rank 0",
        "[rank1]: stderr of rank 1",
    ]


def test_one_rank_inherits_the_streams() -> None:
    result = run("run", program("show_env.py"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["WORLD_SIZE"] == "1"
    assert result.stderr == "stderr of rank 0\n"


def test_verbose_adds_one_summary_line() -> None:
    result = run("run", "-v", "-n", "2", program("show_env.py"))
    assert result.returncode == 0, result.stderr
    extra = [line for line in result.stderr.splitlines() if not line.startswith("[rank")]
    assert len(extra) == 1
    assert re.fullmatch(r"aiospawn: 2 ranks of .*show_env\.py succeeded in [\d.]+ s", extra[0])


def test_log_dir_writes_owner_only_files_and_nothing_to_the_terminal(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = run("run", "-n", "2", "--log-dir", str(logs), program("show_env.py"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == result.stderr == ""
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    for rank in range(2):
        out, err = logs / f"rank{rank}.stdout", logs / f"rank{rank}.stderr"
        assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(err.stat().st_mode) == 0o600
        assert json.loads(out.read_text())["RANK"] == str(rank)
        assert err.read_text() == f"stderr of rank {rank}\n"


def test_tee_writes_files_and_the_terminal(tmp_path: Path) -> None:
    result = run("run", "-n", "2", "--log-dir", str(tmp_path), "--tee", program("show_env.py"))
    assert result.returncode == 0, result.stderr
    for rank, (line,) in by_rank(result.stdout).items():
        assert line == (tmp_path / f"rank{rank}.stdout").read_text().rstrip("\n")
    assert "[rank1]: stderr of rank 1" in result.stderr.splitlines()
    assert (tmp_path / "rank1.stderr").read_text() == "stderr of rank 1\n"


def test_stream_modes_apply_to_each_stream(tmp_path: Path) -> None:
    result = run(
        "run", "-n", "2", "--stdout", "devnull", "--stderr", str(tmp_path), program("show_env.py")
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == result.stderr == ""
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank0.stderr", "rank1.stderr"]


# ------------------------------------------------------------------------ environment


def test_ranks_get_torchrun_variables_and_env_options() -> None:
    result = run(
        "run",
        "-n",
        "2",
        "--env",
        "AIOSPAWN_TEST_A=1",
        "--env",
        "AIOSPAWN_TEST_B=x=y",
        program("show_env.py"),
    )
    assert result.returncode == 0, result.stderr
    shown = json_by_rank(result.stdout)
    port = shown[0]["MASTER_PORT"]
    assert 0 < int(port) < 65536
    for rank in range(2):
        assert shown[rank] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "AIOSPAWN_TEST_A": "1",
            "AIOSPAWN_TEST_B": "x=y",
        }


def test_omp_num_threads_is_set_with_a_note_only_when_unset() -> None:
    unset = run("run", "-n", "2", program("show_env.py"), env=environ(OMP_NUM_THREADS=None))
    assert unset.returncode == 0, unset.stderr
    assert {shown["OMP_NUM_THREADS"] for shown in json_by_rank(unset.stdout).values()} == {"1"}
    notes = [line for line in unset.stderr.splitlines() if not line.startswith("[rank")]
    assert len(notes) == 1
    assert notes[0].startswith("aiospawn: OMP_NUM_THREADS is unset")
    chosen = run("run", "-n", "2", program("show_env.py"), env=environ(OMP_NUM_THREADS="3"))
    assert {shown["OMP_NUM_THREADS"] for shown in json_by_rank(chosen.stdout).values()} == {"3"}
    assert "OMP_NUM_THREADS" not in chosen.stderr
    alone = run("run", program("show_env.py"), env=environ(OMP_NUM_THREADS=None))
    assert json.loads(alone.stdout)["OMP_NUM_THREADS"] is None
    assert alone.stderr == "stderr of rank 0\n"


def test_a_preload_sees_the_thread_counts_the_ranks_get() -> None:
    # Native libraries read them as they load: with --preload, in the template.
    result = run(
        "run",
        "-n",
        "2",
        "--preload",
        "threads_at_import",
        "--env",
        "MKL_NUM_THREADS=3",
        program("show_threads.py"),
        env=environ(OMP_NUM_THREADS=None),
    )
    assert result.returncode == 0, result.stderr
    for shown in json_by_rank(result.stdout).values():
        assert shown == {
            "seen_at_import": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "3"},
            "imported_here": False,  # in the template, before the fork
        }
    [note] = result.stderr.splitlines()
    assert note.startswith("aiospawn: OMP_NUM_THREADS is unset")


@pytest.mark.torch
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install torch==2.13.0); the same setting is proven"
    " torch-free by test_a_preload_sees_the_thread_counts_the_ranks_get",
)
@pytest.mark.parametrize(
    ("options", "threads"),
    [([], 1), (["--env", "OMP_NUM_THREADS=2"], 2)],
    ids=["default", "env"],
)
def test_torch_preloaded_runs_each_rank_on_the_rank_thread_count(
    options: list[str], threads: int
) -> None:
    result = run(
        "run",
        "-n",
        "2",
        "--preload",
        "torch",
        *options,
        program("torch_threads.py"),
        env=environ(OMP_NUM_THREADS=None),
    )
    assert result.returncode == 0, result.stderr
    shown = json_by_rank(result.stdout)
    assert shown == {rank: {"threads": threads, "omp": str(threads)} for rank in (0, 1)}
    # Notes on the template's native threads are for -v alone.
    assert "native thread" not in result.stderr


@pytest.mark.parametrize("verbose", [False, True], ids=["default", "verbose"])
def test_native_threads_of_a_preload_are_noted_only_with_verbose(verbose: bool) -> None:
    result = run(
        "run",
        *(["-v"] if verbose else []),
        "--preload",
        "tests.warm_modules.native_thread",
        "--fn",
        "tests.cli_programs.functions:greet",
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "native thread" in line]
    assert len(notes) == (1 if verbose else 0), result.stderr


def test_master_port_is_free_for_a_rank_to_bind() -> None:
    result = run("run", "-n", "2", program("bind_port.py"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\[rank0\]: bound \d+\n", result.stdout)


@pytest.mark.skipif((os.cpu_count() or 1) > 4, reason="starts one rank per CPU")
def test_nprocs_auto_is_one_rank_per_cpu() -> None:
    cpus = os.cpu_count() or 1
    result = run("run", "-n", "auto", program("show_env.py"))
    assert result.returncode == 0, result.stderr
    shown = json_by_rank(result.stdout) if cpus > 1 else {0: json.loads(result.stdout)}
    assert sorted(shown) == list(range(cpus))
    assert shown[0]["WORLD_SIZE"] == str(cpus)


# ----------------------------------------------------------------------- launch modes


def test_script_runs_as_main_with_its_argv_and_directory() -> None:
    script = program("show_main.py")
    result = run("run", "-n", "2", script, "a", "--flag", "-n", "3")
    assert result.returncode == 0, result.stderr
    for shown in json_by_rank(result.stdout).values():
        assert shown == {
            "name": "__main__",
            "argv": [script, "a", "--flag", "-n", "3"],
            "path0": str(PROGRAMS),
            "file": script,
        }


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_other_start_methods_run_the_script(start_method: str) -> None:
    script = program("show_main.py")
    result = run("run", "-n", "2", "--start-method", start_method, script, "z")
    assert result.returncode == 0, result.stderr
    for shown in json_by_rank(result.stdout).values():
        assert shown["name"] == "__main__"
        assert shown["argv"] == [script, "z"]


def test_a_script_can_use_a_spawn_pool_of_its_own_functions() -> None:
    # The pool's workers import the script as their __main__, as for python script.py.
    result = run("run", "-n", "2", program("pool_main.py"))
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {0: ["0 285"], 1: ["1 285"]}


def test_installed_script_runs_ranks() -> None:
    command = Path(sys.executable).with_name("aiospawn")
    result = subprocess.run(
        [str(command), "run", "-n", "2", program("show_env.py")],
        cwd=REPO,
        env=environ(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TRIPWIRE,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(json_by_rank(result.stdout)) == [0, 1]


def test_module_runs_as_main() -> None:
    result = run("run", "-n", "2", "-m", "tests.cli_programs.mod_main", "x", "--y")
    assert result.returncode == 0, result.stderr
    for rank, shown in json_by_rank(result.stdout).items():
        assert shown == {
            "name": "__main__",
            "spec": "tests.cli_programs.mod_main",
            "argv": ["x", "--y"],
            "rank": str(rank),
        }


def test_fn_is_called_with_the_rank_and_string_arguments() -> None:
    result = run("run", "-n", "2", "--fn", "tests.cli_programs.functions:greet", "7", "b")
    assert result.returncode == 0, result.stderr
    for rank, shown in json_by_rank(result.stdout).items():
        assert shown == {"rank": rank, "args": ["7", "b"], "env_rank": str(rank)}


def test_no_python_runs_any_program_with_the_rank_environment() -> None:
    result = run(
        "run", "-n", "2", "--no-python", "/bin/sh", "-c", 'echo "rank=$RANK of $WORLD_SIZE $0"'
    )
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {0: ["rank=0 of 2 /bin/sh"], 1: ["rank=1 of 2 /bin/sh"]}


@pytest.mark.parametrize(
    ("script", "status"),
    [
        ('[ "$RANK" = 1 ] && exit 6; sleep 30', 6),
        ('[ "$RANK" = 1 ] && kill -USR1 $$; sleep 30', 138),
    ],
    ids=["exit-code", "signal"],
)
def test_no_python_program_status_becomes_the_launchers(script: str, status: int) -> None:
    result = run("run", "-n", "2", "--grace-period", "1", "--no-python", "sh", "-c", script)
    assert result.returncode == status, result.stderr


# ------------------------------------------------------------- failures and summaries


@pytest.mark.parametrize(
    ("how", "status", "row"),
    [
        ("raise", 1, "exit code 1, root cause"),
        ("exit3", 3, "exit code 3, root cause"),
        (
            "sigkill",
            137,
            "SIGKILL (-9), not sent by aiospawn: out of memory? (see dmesg), root cause",
        ),
    ],
    ids=["raise", "exit3", "sigkill"],
)
def test_failing_rank_sets_the_status_and_the_summary(how: str, status: int, row: str) -> None:
    result = run("run", "-n", "2", "--grace-period", "1", program("fail.py"), how, "1")
    assert result.returncode == status
    summary = result.stderr[result.stderr.index("aiospawn: rank 1 failed (root cause): ") :]
    lines = summary.splitlines()
    assert "rank 1 is about to fail" in summary  # the tail of its stderr
    if how == "raise":
        assert lines[0].endswith("raised ValueError: cli: a bad shard")
    table = lines[lines.index(next(line for line in lines if "summary of" in line)) + 1 :]
    assert table[0].split() == ["rank", "pid", "exit", "duration"]
    assert re.fullmatch(r"\s+0\s+\d+\s+SIGTERM \(-15\), stopped by aiospawn\s+[\d.]+ s", table[1])
    assert re.fullmatch(rf"\s+1\s+\d+\s+{re.escape(row)}\s+[\d.]+ s", table[2])
    assert len(table) == 3


def test_a_traceback_reaches_the_ranks_stderr_without_launcher_frames() -> None:
    result = run("run", "-n", "2", "--grace-period", "1", program("fail.py"), "raise", "0")
    source = Path(program("fail.py")).read_text().splitlines()
    line = 1 + next(n for n, text in enumerate(source) if "raise ValueError" in text)
    traceback = [text for text in by_rank_lines(result.stderr, 0) if text.startswith("  File")]
    assert traceback == [f'  File "{program("fail.py")}", line {line}, in <module>']


def by_rank_lines(text: str, rank: int) -> list[str]:
    return [m[2] for line in text.splitlines() if (m := PREFIXED.match(line)) and m[1] == str(rank)]


# ------------------------------------------------------------------------- bad usage


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--bogus", "TOUCH"],
        ["run", "-n", "two", "TOUCH"],
        ["run", "-n", "0", "TOUCH"],
        ["run", "--grace-period", "-1", "TOUCH"],
        ["run", "missing_script.py"],
        ["run"],
        ["run", "--fn", "tests.cli_programs.functions:nope"],
        ["run", "--fn", "tests.cli_programs.functions:NOT_CALLABLE"],
        ["run", "--fn", "tests.cli_programs.functions"],
        ["run", "--fn", "no_such_module_here:main"],
        ["run", "-m", "no_such_module_here"],
        ["run", "--no-python", "/no/such/program"],
        ["run", "--max-restarts", "-1", "TOUCH"],
        ["run", "--restart-window", "60", "TOUCH"],
        ["run", "--max-restarts", "1", "--restart-window", "0", "TOUCH"],
        ["run", "--stdout", "capture", "TOUCH"],
        ["run", "--stdout", "weird", "TOUCH"],
        ["run", "--stderr", "prefx", "TOUCH"],
        ["run", "--fn", "tests.cli_programs.reads_rank_at_import:main"],
        ["run", "--tee", "TOUCH"],
        ["run", "-m", "--fn", "x:y"],
        ["run", "--preload", "no_such_module_here", "TOUCH"],
        ["frobnicate"],
    ],
    ids=lambda args: " ".join(args) or "nothing",
)
def test_bad_usage_exits_2_with_one_line_before_starting(args: list[str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    args = [f"{program('touch.py')}" if arg == "TOUCH" else arg for arg in args]
    if args and args[-1] == program("touch.py"):
        args.append(str(marker))
    result = run(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("aiospawn: error: ")
    assert not marker.exists()


def test_a_usage_error_comes_before_any_note(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    too_many = str(max_nprocs() + 1)  # the fewest descriptors a rank can take
    result = run(
        "run", "-n", too_many, program("touch.py"), str(marker), env=environ(OMP_NUM_THREADS=None)
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"aiospawn: error: -n {too_many} is more than this process")
    assert result.stderr.count("\n") == 1, result.stderr  # no OMP_NUM_THREADS note
    assert not marker.exists()


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["-n", "2", "--start-method", "fork"], ["--preload", "--start-method fork"]),
        (["--ray", "127.0.0.1:1"], ["--preload", "--ray"]),
    ],
    ids=["fork", "ray"],
)
def test_preload_where_no_template_can_be_is_a_usage_error_in_flag_names(
    args: list[str], flags: list[str], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    result = run("run", "--preload", "json", *args, program("touch.py"), str(marker))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("aiospawn: error: --preload ")
    assert all(flag in result.stderr for flag in flags), result.stderr
    assert "preload=" not in result.stderr
    assert "start_method=" not in result.stderr
    assert not marker.exists()


def test_max_restarts_zero_is_accepted(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = run("run", "--max-restarts", "0", program("touch.py"), str(marker))
    assert result.returncode == 0, result.stderr
    assert marker.exists()


def test_max_restarts_starts_every_rank_again_with_a_fresh_port() -> None:
    result = run("run", "-n", "2", "--max-restarts", "1", program("fail_first_run.py"))
    assert result.returncode == 0, result.stderr
    runs = [json.loads(line.split(": ", 1)[1]) for line in result.stdout.splitlines()]
    seen = {(run["rank"], run["restart"]) for run in runs}
    # Rank 0's first run may be stopped before it prints: rank 1 fails at once.
    assert (
        {("1", "0"), ("0", "1"), ("1", "1")}
        <= seen
        <= {("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")}
    )
    ports = {run["restart"]: run["port"] for run in runs}
    assert ports["0"] != ports["1"]


def test_restarts_used_up_report_the_failure_with_a_restarts_column() -> None:
    result = run(
        "run",
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--grace-period",
        "1",
        program("fail.py"),
        "exit3",
        "1",
    )
    assert result.returncode == 3
    lines = result.stderr.splitlines()
    table = lines[lines.index(next(line for line in lines if "summary of" in line)) + 1 :]
    assert table[0].split() == ["rank", "pid", "exit", "restarts", "duration"]
    assert re.fullmatch(r"\s+1\s+\d+\s+exit code 3, root cause\s+1\s+[\d.]+ s", table[2])


def test_no_command_prints_the_usage_and_exits_2() -> None:
    result = run()
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("usage: aiospawn ")
    assert "COMMAND" in result.stderr


@pytest.mark.parametrize("args", [["--version"], ["run", "--version"]], ids=" ".join)
def test_version_prints_the_version(args: list[str]) -> None:
    import aiospawn

    result = run(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"aiospawn {aiospawn.__version__}\n"


def test_help_documents_the_options() -> None:
    result = run("run", "--help")
    assert result.returncode == 0
    for option in ("--nprocs", "--start-method", "--grace-period", "--stdout", "--stderr"):
        assert option in result.stdout
    for option in ("--log-dir", "--tee", "--env", "--verbose", "-m", "--fn", "--no-python"):
        assert option in result.stdout
    assert "MASTER_PORT" in result.stdout
    assert "128 + signal" in result.stdout


# ---------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_signal_stops_the_ranks_and_exits_128_plus_signal(
    signum: int, launchers: list[Launcher]
) -> None:
    launcher = start(launchers, "run", "-n", "2", "--grace-period", "5", program("sleeper.py"))
    pids = launcher.ready_pids(2)
    launcher.signal(signum)
    status, _, err = launcher.finish()
    assert status == 128 + signum, err
    assert all(is_gone(pid) for pid in pids)
    assert f"aiospawn: {signal.Signals(signum).name} received" in err
    assert err.count("SIGTERM (-15), stopped by aiospawn") == 2


# The launcher as its console script runs it, with anyio's import held up
# until the test sends SIGINT: a Ctrl-C during the launcher's first moments.
SLOW_IMPORT = """
import sys, time

class HoldAnyio:
    def find_spec(self, name, path=None, target=None):
        if name == "anyio":
            print("importing", flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, HoldAnyio())
from aiospawn._cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_ctrl_c_while_the_launcher_imports_exits_130_without_a_traceback() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", SLOW_IMPORT, "run", "-n", "1", program("sleeper.py")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        assert launcher.stdout.readline() == "importing\n"
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=TRIPWIRE)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 130, err
    assert "Traceback" not in err


def test_second_sigint_kills_ranks_that_ignore_sigterm(launchers: list[Launcher]) -> None:
    launcher = start(
        launchers, "run", "-n", "2", "--grace-period", "60", program("sleeper.py"), "ignore-term"
    )
    pids = launcher.ready_pids(2)
    began = time.monotonic()
    launcher.signal(signal.SIGINT)
    launcher.wait_for_lines(r"SIGTERM ignored \d+$", 2)  # the shutdown is under way
    launcher.signal(signal.SIGINT)
    status, _, err = launcher.finish()
    assert status == 130, err
    assert time.monotonic() - began < 30  # far from the 60 s grace period
    assert all(is_gone(pid) for pid in pids)
    assert err.count("SIGKILL (-9), stopped by aiospawn") == 2


def test_sigterm_reaches_a_no_python_program(launchers: list[Launcher]) -> None:
    launcher = start(
        launchers,
        "run",
        "-n",
        "2",
        "--grace-period",
        "5",
        "--no-python",
        "sh",
        "-c",
        "echo ready $$; exec sleep 60",
    )
    programs = launcher.ready_pids(2)
    wrappers = [psutil.Process(pid).ppid() for pid in programs]
    launcher.signal(signal.SIGTERM)
    status, _, err = launcher.finish()
    assert status == 143, err
    assert all(is_gone(pid) for pid in programs + wrappers)
    assert err.count("SIGTERM (-15), stopped by aiospawn") == 2


def test_a_no_python_program_dies_with_its_rank(launchers: list[Launcher]) -> None:
    launcher = start(
        launchers, "run", "-n", "2", "--no-python", "sh", "-c", "echo ready $$; exec sleep 60"
    )
    programs = launcher.ready_pids(2)
    rank = psutil.Process(programs[0]).ppid()
    os.kill(rank, signal.SIGKILL)  # the rank alone, as the out-of-memory killer would
    status, _, err = launcher.finish()
    assert status == 137, err
    assert "out of memory?" in err
    assert wait_until(lambda: all(is_gone(pid) for pid in programs), 10)


def test_only_the_launchers_own_output_can_kill_it_with_sigpipe(
    launchers: list[Launcher],
) -> None:
    # The launcher holds sockets too (channels, a Ray driver's): a peer closing
    # during a write must be an error there, not the launcher's death.
    launcher = start(
        launchers, "run", "-n", "1", "--no-python", "sh", "-c", "echo ready $$; exec sleep 60"
    )
    launcher.ready_pids(1)
    with open(f"/proc/{launcher.proc.pid}/status") as status:
        ignored = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    assert ignored & (1 << (signal.SIGPIPE - 1)), "SIGPIPE is not ignored in the launcher"
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish()[0] == 143


STREAM_SHAPE = """
import io, json, sys
from aiospawn._cli._streams import die_of_sigpipe_on_closed_output

def shape():
    return [
        [isinstance(s.buffer, io.BufferedWriter), s.write_through, s.line_buffering]
        for s in (sys.stdout, sys.stderr)
    ]

before = shape()
die_of_sigpipe_on_closed_output()
print(json.dumps([before, shape()]))  # not flushed: unbuffered or not, as before
sys.stdin.readline()
"""


@pytest.mark.parametrize("unbuffered", [True, False], ids=["PYTHONUNBUFFERED", "buffered"])
def test_the_launchers_own_streams_keep_their_buffering(unbuffered: bool) -> None:
    # The launcher's stdout carries the ranks' lines (Ray prints them there):
    # a buffer where the interpreter had none would hold them back.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    child = subprocess.Popen(
        [sys.executable, "-c", STREAM_SHAPE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert child.stdin is not None
    assert child.stdout is not None
    try:
        if unbuffered:  # the line arrives while the child still waits
            readable, _, _ = select.select([child.stdout], [], [], TRIPWIRE)
            assert readable, "the launcher's unbuffered stdout held a line back"
            before, after = json.loads(child.stdout.readline())
        child.stdin.close()
        assert child.wait(TRIPWIRE) == 0
        if not unbuffered:
            before, after = json.loads(child.stdout.read())
    finally:
        child.stdout.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert after == before
    assert before[0][0] is not unbuffered  # stdout: buffered only without the variable


def test_a_closed_output_pipe_ends_the_launcher_and_its_ranks(launchers: list[Launcher]) -> None:
    launcher = start(launchers, "run", "-n", "2", program("flood.py"))
    pids = launcher.ready_pids(2)
    assert launcher.proc.stdout is not None
    launcher.proc.stdout.close()  # as head does once it has its lines
    assert launcher.proc.wait(TRIPWIRE) == -signal.SIGPIPE
    assert launcher.proc.stderr is not None
    err = launcher.proc.stderr.read().decode()
    launcher.proc.stderr.close()
    assert "Traceback" not in err
    assert wait_until(lambda: all(is_gone(pid) for pid in pids), 10), pids


@pytest.mark.parametrize("mode", ["script", "no-python"])
def test_sigkill_of_the_launcher_leaves_no_rank(mode: str, launchers: list[Launcher]) -> None:
    # A SIGKILLed launcher cannot clean up after multiprocessing: its own temp dir.
    tmp = tempfile.mkdtemp(prefix="aiospawn-cli-")
    try:
        target = (
            [program("sleeper.py")]
            if mode == "script"
            else ["--no-python", "sh", "-c", "echo ready $$; exec sleep 60"]
        )
        launcher = start(launchers, "run", "-n", "2", *target, env=environ(TMPDIR=tmp))
        pids = launcher.ready_pids(2)
        family = pids + [psutil.Process(pid).ppid() for pid in pids if mode == "no-python"]
        launcher.signal(signal.SIGKILL)
        launcher.finish()
        assert wait_until(lambda: all(is_gone(pid) for pid in family), 10), family
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _take_terminal() -> None:
    # In the new session: make the pseudo-terminal on fd 0 our controlling
    # terminal, so that its ^C sends SIGINT to our (foreground) process group.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_ctrl_c_in_a_terminal_stops_the_ranks_and_exits_130() -> None:
    master, terminal = os.openpty()
    launcher = subprocess.Popen(
        [*LAUNCHER, "run", "-n", "2", "--grace-period", "5", program("sleeper.py")],
        cwd=REPO,
        env=environ(),
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
        preexec_fn=_take_terminal,
    )
    os.close(terminal)
    seen = b""
    try:

        def read_until(done: Any) -> None:
            nonlocal seen
            deadline = time.monotonic() + TRIPWIRE
            while not done(seen):
                left = deadline - time.monotonic()
                assert left > 0, f"the terminal showed: {seen!r}"
                if select.select([master], [], [], left)[0]:
                    try:
                        data = os.read(master, 65536)
                    except OSError:  # EIO: every holder of the terminal has closed it
                        data = b""
                    if not data:
                        return
                    seen += data

        read_until(lambda text: len(re.findall(rb"ready \d+", text)) == 2)
        pids = [int(pid) for pid in re.findall(rb"ready (\d+)", seen)]
        os.write(master, b"\x03")
        read_until(lambda text: False)  # to the end of output
        assert launcher.wait(TRIPWIRE) == 130, seen
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in session_members(launcher.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.close(master)
    text = seen.decode(errors="replace")
    assert all(is_gone(pid) for pid in pids)
    assert "SIGINT received" in text
    # Only the launcher got the SIGINT; the ranks were stopped by its SIGTERM.
    assert text.count("SIGTERM (-15), stopped by aiospawn") == 2
    assert "KeyboardInterrupt" not in text
