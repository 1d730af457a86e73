"""``aiospawn run --ray``: the same command on the two-node Ray cluster the Ray tests start.

The cluster (``tests/ray_cluster.py``) has two nodes on this machine; with
``--placement STRICT_SPREAD`` the two ranks run on different nodes, so the
torchrun variables come from the placement (``GROUP_RANK`` 0 and 1, one
local rank each) and a ``torch.distributed`` job meets across the nodes.
Ray prints each rank's lines behind its actor's name: ``(rank0 pid=..., ...)``;
on this cluster every line comes twice (see the first test), so lines are
compared as sets.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_helpers import (
    Launcher,
    basetemp_first,
    environ,
    launchers,
    program,
    run,
    start,
)
from tests.helpers import is_gone, wait_until

pytest.importorskip("ray")

from tests.ray_cluster import LocalCluster

__all__ = ["basetemp_first", "launchers"]  # fixtures

# One worker runs the module, which starts one Ray cluster for all its tests.
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray-cli")]

#: A line a rank printed, as Ray shows it on the driver.
RAY_LINE = re.compile(r"^\(rank(\d+) pid=\d+[^)]*\) (.*)$")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    started = LocalCluster.start()
    try:
        yield started
    finally:
        started.stop()


def ray_lines(text: str) -> dict[int, list[str]]:
    """The lines the ranks printed, by rank (Ray's own lines left out)."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = RAY_LINE.match(line)
        if match:
            lines.setdefault(int(match[1]), []).append(match[2])
    return lines


def ray_json(text: str) -> dict[int, Any]:
    return {rank: json.loads(lines[-1]) for rank, lines in ray_lines(text).items()}


def test_ranks_on_both_nodes_get_torchruns_variables_from_the_placement(
    cluster: LocalCluster,
) -> None:
    names = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
    result = run(
        "run",
        "--ray",
        cluster.address,
        "-n",
        "2",
        "--placement",
        "STRICT_SPREAD",
        program("show_vars.py"),
        *names,
    )
    assert result.returncode == 0, result.stderr
    shown = ray_json(result.stdout)
    assert sorted(shown) == [0, 1]
    for rank in (0, 1):
        assert shown[rank]["RANK"] == str(rank)
        assert shown[rank]["LOCAL_RANK"] == "0"
        assert shown[rank]["LOCAL_WORLD_SIZE"] == "1"
        assert shown[rank]["WORLD_SIZE"] == "2"
    assert {shown[rank]["GROUP_RANK"] for rank in (0, 1)} == {"0", "1"}
    assert shown[0]["MASTER_PORT"] == shown[1]["MASTER_PORT"]
    # stderr too, behind the rank. (Both nodes of this cluster share one log
    # directory, so each node's log monitor sends every line: it comes twice.)
    assert {rank: set(lines) for rank, lines in ray_lines(result.stderr).items()} == {
        0: {"stderr of rank 0"},
        1: {"stderr of rank 1"},
    }


def test_a_failing_rank_sets_the_status_and_restarts_work(cluster: LocalCluster) -> None:
    failed = run(
        "run",
        "--ray",
        cluster.address,
        "-n",
        "2",
        "--grace-period",
        "1",
        program("fail.py"),
        "exit3",
        "1",
    )
    assert failed.returncode == 3, failed.stderr
    assert "aiospawn: rank 1 failed (root cause)" in failed.stderr
    restarted = run(
        "run",
        "--ray",
        cluster.address,
        "-n",
        "2",
        "--max-restarts",
        "1",
        program("fail_first_run.py"),
    )
    assert restarted.returncode == 0, restarted.stderr
    runs = [json.loads(line) for lines in ray_lines(restarted.stdout).values() for line in lines]
    assert {("0", "1"), ("1", "1")} <= {(run["rank"], run["restart"]) for run in runs}


def test_ctrl_c_stops_the_ranks_on_the_cluster(
    cluster: LocalCluster, launchers: list[Launcher]
) -> None:
    launcher = start(
        launchers,
        "run",
        "--ray",
        cluster.address,
        "-n",
        "2",
        "--placement",
        "SPREAD",
        "--grace-period",
        "5",
        program("sleeper.py"),
    )
    pids = launcher.ready_pids(2)
    launcher.signal(signal.SIGINT)
    status, _, err = launcher.finish()
    assert status == 130, err
    assert "SIGINT received" in err
    # The ranks' worker processes run on this machine's two nodes.
    assert wait_until(lambda: all(is_gone(pid) for pid in pids), 30), pids


def test_torch_distributed_with_gloo_across_both_nodes(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    pytest.importorskip("torch", reason="the DDP script needs torch (pip install torch==2.13.0)")
    result = run(
        "run",
        "--ray",
        cluster.address,
        "-n",
        "2",
        "--placement",
        "STRICT_SPREAD",
        "--env",
        f"SNAPSHOT_DIR={tmp_path}",
        program("multigpu_torchrun.py"),
        "3",
        "1",
        env=environ(),
    )
    assert result.returncode == 0, result.stderr
    reports = ray_json(result.stdout)
    assert sorted(reports) == [0, 1]
    assert {reports[rank]["GROUP_RANK"] for rank in (0, 1)} == {"0", "1"}
    assert reports[0]["checksum"] == reports[1]["checksum"]  # one DDP job over both nodes
    assert (tmp_path / "snapshot.pt").exists()
