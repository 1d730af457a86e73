"""``aiospawn run`` as torchrun's multi-node command line: two launchers on one machine as nodes.

Each test starts two launchers (2 ranks each) on a localhost rendezvous with
a free port, as torch's own tests of its rendezvous do; their ranks run
``cli_programs/nodes_job.py``, a real gloo job across the "nodes". The
command-line checks at the top start nothing and need no torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec

import psutil
import pytest

from aiospawn._cli._rendezvous import LOST_AFTER
from tests.cli_helpers import (
    REPO,
    TRIPWIRE,
    Launcher,
    basetemp_first,
    environ,
    launchers,
    program,
    run,
    session_members,
    start,
)
from tests.helpers import is_gone, wait_until

__all__ = ["basetemp_first", "launchers"]  # fixtures

_TORCH_MARKS = (
    pytest.mark.torch,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not installed (pip install torch==2.13.0)",
    ),
    # Two launchers of two gloo ranks each: not beside each other.
    pytest.mark.xdist_group("nodes"),
)


def needs_torch(test: Callable[P, None]) -> Callable[P, None]:
    """Mark a test that runs real nodes: torch's marker, skipped without torch."""
    for mark in _TORCH_MARKS:
        test = mark(test)
    return test


P = ParamSpec("P")

JOB = program("nodes_job.py")

#: From a rank's failure on one node to the other node's ranks gone (seconds):
#: the launchers read the round's end record every 0.2 s; the rest is margin
#: for a loaded machine.
STOP_BOUND = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def static(port: int, node: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(node), "--master-port", str(port)]


def c10d(port: int, node: int) -> list[str]:
    del node  # the rendezvous assigns it
    return ["--nnodes", "2", "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]


FORMS = {"static": static, "c10d": c10d}


def start_nodes(
    started: list[Launcher], form: str, *args: str, options: tuple[str, ...] = ()
) -> list[Launcher]:
    """Two launchers as the nodes of one job: ``options`` theirs, ``args`` the job's."""
    port = free_port()
    return [
        start(started, "run", *FORMS[form](port, node), *options, "-n", "2", JOB, *args)
        for node in range(2)
    ]


def results(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines of a node's ranks (prefixed ``[rankN]: ``, but not a lone rank's)."""
    found = []
    for line in stdout.splitlines():
        text = line if line.startswith("{") else line.partition(": ")[2]
        if text.startswith("{"):
            found.append(json.loads(text))
    return found


# ------------------------------------------------------------------ the command line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "0"], "--nnodes 0: wants 0 < MIN <= MAX"),
        (["--nnodes", "3:2"], "--nnodes 3:2: wants 0 < MIN <= MAX"),
        (["--nnodes", "a:b"], "--nnodes wants N or MIN:MAX, got 'a:b'"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2: wants a number from 0 to 1"),
        (["--nnodes", "1:2"], "its node count is fixed"),
        (["--nnodes", "2", "--rdzv-backend", "c10d"], "wants --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2"),
        (["--nnodes", "2", "--standalone"], "--standalone with --nnodes 2"),
        (["--nnodes", "2", "--ray", "auto"], "--nnodes 2 with --ray"),
        (["--nnodes", "2", "--rdzv-conf", "timeout"], "--rdzv-conf 'timeout'"),
        (["--nnodes", "2", "--max-restarts", "-1"], "wants a non-negative whole number"),
        (
            ["--nnodes", "2", "--max-restarts", "1", "--restart-strategy", "one_for_one"],
            "--restart-strategy with --nnodes 2",
        ),
        (["--nnodes", "2", "--master-port", "x"], "--master-port wants a port number"),
        (["--nnodes", "2", "--master-port", "65536"], "from 1 to 65535, got '65536'"),
        (
            ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:99999"],
            "--rdzv-endpoint 127.0.0.1:99999: wants a port number from 0 to 65535",
        ),
    ],
)
def test_bad_multi_node_lines_are_refused_before_anything_starts(
    args: list[str], message: str
) -> None:
    result = run("run", *args, program("show_vars.py"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert result.stdout == ""


def test_pet_variables_give_the_flags_the_command_line_leaves_out() -> None:
    # As torchrun reads them (Kubeflow's PyTorchJob sets them): the line wins.
    result = run("run", program("show_vars.py"), env=environ(PET_NNODES="2", PET_NODE_RANK="5"))
    assert result.returncode == 2
    assert "--node-rank 5: wants a number from 0 to 1 (--nnodes 2)" in result.stderr
    result = run(
        "run",
        "--nnodes",
        "1",
        program("show_vars.py"),
        "WORLD_SIZE",
        env=environ(PET_NNODES="2", PET_NPROC_PER_NODE="2"),
    )
    assert result.returncode == 0, result.stderr
    assert len(results(result.stdout)) == 2


# ------------------------------------------------------------------ real nodes


@needs_torch
@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_nodes_all_reduce_across_the_nodes(form: str, launchers: list[Launcher]) -> None:
    nodes = start_nodes(launchers, form)
    outcomes = [node.finish() for node in nodes]
    for status, _, err in outcomes:
        assert status == 0, err
    ranks = {int(r["env"]["RANK"]): r for _, out, _ in outcomes for r in results(out)}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert {r["sum"] for r in ranks.values()} == {6}  # 0 + 1 + 2 + 3, across both nodes
    for rank, shown in ranks.items():
        env = shown["env"]
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == env["GROUP_WORLD_SIZE"] == "2"
        assert env["ROLE_RANK"] == str(rank)
        assert int(env["GROUP_RANK"]) * 2 + int(env["LOCAL_RANK"]) == rank
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"


@needs_torch
def test_a_node_ends_as_a_program_ends_leaving_nothing(launchers: list[Launcher]) -> None:
    # A node ends without the interpreter's finalization (a store call left in
    # a thread could abort it there), but with a program's exit steps: here
    # multiprocessing's finalizers remove the fork server's temp dir.
    # A temp dir of the nodes' own, with a short path: the fork server's
    # socket is made in it, and a socket's path holds 107 bytes.
    tmp = Path(tempfile.mkdtemp(prefix="nodes-", dir="/tmp"))
    try:
        env = environ(TMPDIR=str(tmp))
        port = free_port()
        nodes = [
            start(
                launchers,
                "run",
                *static(port, node),
                "--start-method",
                "forkserver",
                "-n",
                "2",
                JOB,
                env=env,
            )
            for node in range(2)
        ]
        for node in nodes:
            status, _, err = node.finish()
            assert status == 0, err
        assert sorted(path.name for path in tmp.iterdir()) == []
        assert wait_until(
            lambda: not alive([p for n in nodes for p in session_members(n.proc.pid)]), 10
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def alive(pids: list[int]) -> list[list[str]]:
    """The command lines of the processes of ``pids`` that have not exited."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.cmdline())
    return found


def torchrun_environments(form: str, run_id: str, tmp: Path) -> dict[int, dict[str, str]]:
    """Each rank's variables under torchrun itself, for the same two-node command line."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *FORMS[form](port, node),
                "--rdzv-id",
                run_id,
                "--nproc-per-node",
                "2",
                JOB,
            ],
            cwd=REPO,
            # torchrun keeps its log directories in the temp dir.
            env=environ(TMPDIR=str(tmp)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for node in range(2)
    ]
    shown: dict[int, dict[str, str]] = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TRIPWIRE)
            assert proc.returncode == 0, err
            for line in out.splitlines():
                if line.startswith("{"):
                    env = json.loads(line)["env"]
                    shown[int(env["RANK"])] = env
    finally:
        for proc in procs:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return shown


@needs_torch
@pytest.mark.parametrize("form", ["static", "c10d"])
def test_each_rank_gets_the_environment_torchrun_gives_it(
    form: str, launchers: list[Launcher], tmp_path: Path
) -> None:
    expected = torchrun_environments(form, "same-job", tmp_path)
    port = free_port()
    nodes = [
        start(
            launchers,
            "run",
            *FORMS[form](port, node),
            "--rdzv-id",
            "same-job",
            "--nproc-per-node",
            "2",
            JOB,
        )
        for node in range(2)
    ]
    shown: dict[int, dict[str, str]] = {}
    for node in nodes:
        status, out, err = node.finish()
        assert status == 0, err
        for result in results(out):
            shown[int(result["env"]["RANK"])] = result["env"]
    # Each run has a port of its own (static: the one given; c10d: a fresh one).
    varies = {"MASTER_PORT"}
    if form == "static":
        assert {env["MASTER_PORT"] for env in shown.values()} == {str(port)}
    assert sorted(shown) == sorted(expected) == [0, 1, 2, 3]
    for rank, env in expected.items():
        assert {k: v for k, v in shown[rank].items() if k not in varies} == {
            k: v for k, v in env.items() if k not in varies
        }, rank


@needs_torch
def test_a_failing_rank_on_one_node_stops_the_ranks_of_the_other(
    launchers: list[Launcher], tmp_path: Path
) -> None:
    error_file = tmp_path / "error.json"
    # Node 0's ranks wait in a way no peer's death ends: only the launcher can
    # stop them (a gloo collective would fail of the peer's death by itself).
    port = free_port()
    node0 = start(
        launchers,
        "run",
        *static(port, 0),
        "-n",
        "2",
        JOB,
        "--fail-rank",
        "3",
        "--wait",
        "sleep",
        env=environ(TORCHELASTIC_ERROR_FILE=str(error_file)),
    )
    node1 = start(
        launchers, "run", *static(port, 1), "-n", "2", JOB, "--fail-rank", "3", "--wait", "sleep"
    )
    waiting = _waiting(node0, 2)
    seen = time.monotonic()
    assert wait_until(lambda: all(is_gone(pid) for pid in waiting), STOP_BOUND)
    assert time.monotonic() - seen < STOP_BOUND
    status0, _, err0 = node0.finish()
    status1, _, err1 = node1.finish()
    # Every node exits with the root cause's status and names it.
    assert (status0, status1) == (3, 3), (err0, err1)
    assert "node 1 (" in err0
    assert "rank 3 (local rank 1), failed first: exit code 3" in err0
    assert "the ranks here were stopped" in err0
    assert "rank 3 (local rank 1), failed first" in err1
    # The failed node's own report counts the job's ranks and its local ones.
    assert "rank 3 (local rank 1) failed (root cause)" in err1
    rows = err1[err1.index("summary of") :].splitlines()[1:]
    assert rows[0].split()[:2] == ["rank", "(local)"], rows
    assert [row.split()[:2] for row in rows[1:3]] == [["2", "(0)"], ["3", "(1)"]], rows
    error = json.loads(error_file.read_text())
    assert error["message"]["errorCode"] == 3


def _waiting(node: Launcher, count: int) -> list[int]:
    return [int(match[1]) for match in node.wait_for_lines(r"waiting (\d+)$", count)]


@needs_torch
@pytest.mark.parametrize("form", ["static", "c10d"])
def test_ctrl_c_on_one_node_stops_every_node(form: str, launchers: list[Launcher]) -> None:
    nodes = start_nodes(launchers, form, "--hang", "--wait", "sleep")
    waiting = [pid for node in nodes for pid in _waiting(node, 2)]
    nodes[1].signal(signal.SIGINT)
    assert wait_until(lambda: all(is_gone(pid) for pid in waiting), STOP_BOUND)
    outcomes = [node.finish() for node in nodes]
    assert [status for status, _, _ in outcomes] == [130, 130], outcomes
    assert "was stopped by SIGINT; the ranks here were stopped" in outcomes[0][2]
    assert "SIGINT received: stopping the ranks on every node" in outcomes[1][2]


@needs_torch
def test_max_restarts_makes_a_new_round_on_every_node(launchers: list[Launcher]) -> None:
    nodes = start_nodes(
        launchers, "c10d", "--fail-rank", "3", "--fail-once", options=("--max-restarts", "1")
    )
    outcomes = [node.finish() for node in nodes]
    for status, _, err in outcomes:
        assert status == 0, err
        assert "failed first: exit code 3; restarting every node's ranks (1 of 1" in err
    rounds: dict[str, set[int]] = {}
    for _, out, _ in outcomes:
        for result in results(out):
            env = result["env"]
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
            rounds.setdefault(env["TORCHELASTIC_RESTART_COUNT"], set()).add(int(env["RANK"]))
    assert rounds == {"0": {0, 1, 2, 3}, "1": {0, 1, 2, 3}}


#: From a launcher's SIGKILL to its ranks gone (seconds): each rank's guard
#: thread waits on a pidfd of its launcher and kills the rank's process group
#: at once (``aiospawn._rank.guard``); the rest is margin for a loaded machine.
RANK_DEATH_BOUND = 5.0


@needs_torch
@pytest.mark.parametrize("killed", [0, 1])
def test_a_node_whose_launcher_is_killed_outright_takes_its_ranks_and_the_job_with_it(
    killed: int, launchers: list[Launcher]
) -> None:
    # Node 0 holds the static rendezvous's store. Node 1's death is noticed by
    # its heartbeat (LOST_AFTER, 10 s); node 0's by node 1's next read of the
    # store, which fails.
    nodes = start_nodes(launchers, "static", "--hang", "--wait", "sleep")
    waiting = [_waiting(node, 2) for node in nodes]
    other = 1 - killed
    nodes[killed].proc.kill()
    killed_at = time.monotonic()
    # (a) Its ranks die with it: no launcher is left to stop them.
    assert wait_until(lambda: all(is_gone(pid) for pid in waiting[killed]), RANK_DEATH_BOUND)
    # (b) The other node stops its ranks and exits 1, naming the lost node.
    bound = LOST_AFTER + STOP_BOUND if killed == 1 else STOP_BOUND
    assert wait_until(lambda: all(is_gone(pid) for pid in waiting[other]), bound)
    stopped_at = time.monotonic()
    assert stopped_at - killed_at < bound
    status, _, err = nodes[other].finish()
    assert status == 1, err
    # It does not wait for the lost node to leave with it (LEAVE_WAIT, 10 s).
    assert time.monotonic() - stopped_at < STOP_BOUND, "the launcher waited for the lost node"
    if killed == 1:
        assert "node 1 was lost (no heartbeat for 10 s), seen by node 0" in err
    else:
        assert "the rendezvous store stopped answering" in err
    assert "the ranks here were stopped" in err


@needs_torch
def test_a_signal_passed_on_reaches_the_ranks_then_the_job_stops_on_every_node(
    launchers: list[Launcher],
) -> None:
    # SLURM's preemption warning, SIGUSR1 with --signals-to-handle: the
    # ranks of the node that received it get it (to checkpoint), and once
    # the shutdown timeout is over the job stops on every node, as torchrun's
    # agent stops its workers.
    nodes = start_nodes(
        launchers,
        "static",
        "--hang",
        "--wait",
        "sleep",
        "--on-usr1",
        options=("--signals-to-handle", "SIGUSR1,SIGTERM,SIGINT", "--shutdown-timeout", "1"),
    )
    waiting = [pid for node in nodes for pid in _waiting(node, 2)]
    nodes[1].signal(signal.SIGUSR1)
    got = nodes[1].wait_for_lines(r"got SIGUSR1 (\d+)$", 2)
    assert sorted(int(match[1]) for match in got) == [2, 3]
    assert wait_until(lambda: all(is_gone(pid) for pid in waiting), STOP_BOUND)
    outcomes = [node.finish() for node in nodes]
    status = 128 + signal.SIGUSR1
    assert [status for status, _, _ in outcomes] == [status, status], outcomes
    assert "SIGUSR1 received: sent on to the ranks here" in outcomes[1][2]
    assert "node 1 (" in outcomes[0][2]
    assert "was stopped by SIGUSR1; the ranks here were stopped" in outcomes[0][2]
    assert "got SIGUSR1" not in outcomes[0][1]  # sent on to the ranks of its own node only


@needs_torch
def test_with_min_max_nodes_the_nodes_left_go_on_without_a_killed_one(
    launchers: list[Launcher],
) -> None:
    # Three nodes of one rank; node A holds the c10d store (is_host), so that
    # the one killed is never the store's holder. A short last call: the
    # second round starts as soon as the two nodes left have joined it.
    port = free_port()
    nodes = [
        start(
            launchers,
            "run",
            "--nnodes",
            "2:3",
            "--rdzv-backend",
            "c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf",
            f"is_host={'true' if index == 0 else 'false'},last_call_timeout=1",
            "--max-restarts",
            "1",
            "-n",
            "1",
            JOB,
            "--hang-once",
            "--wait",
            "sleep",
        )
        for index in range(3)
    ]
    waiting = [_waiting(node, 1)[0] for node in nodes]
    # The launcher and its rank, by pid, as a machine's sudden death would.
    nodes[2].proc.kill()
    os.kill(waiting[2], signal.SIGKILL)
    nodes[2].proc.communicate()
    # LOST_AFTER (10 s), torch's rendezvous forgetting the dead node (its
    # keep-alive: 15 s by default), the second round: generous.
    outcomes = []
    for node in nodes[:2]:
        out, err = node.proc.communicate(timeout=180.0)
        outcomes.append(
            (node.proc.returncode, (node.out + out).decode(), (node.err + err).decode())
        )
    for status, _, err in outcomes:
        assert status == 0, err
        assert "restarting every node's ranks (1 of 1 restarts)" in err
    assert any("was lost (no heartbeat for 10 s)" in err for _, _, err in outcomes), outcomes
    rounds: dict[str, list[dict[str, Any]]] = {}
    for _, out, _ in outcomes:
        for result in results(out):
            rounds.setdefault(result["env"]["TORCHELASTIC_RESTART_COUNT"], []).append(result)
    assert {r["env"]["WORLD_SIZE"] for r in rounds.get("0", [])} == {"3"}, rounds
    second = rounds.get("1", [])
    assert sorted(int(r["env"]["RANK"]) for r in second) == [0, 1], rounds
    for result in second:
        assert result["env"]["WORLD_SIZE"] == "2"
        assert result["sum"] == 1  # 0 + 1: the all-reduce of the two nodes left
