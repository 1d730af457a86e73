"""Every example in examples/ runs as a user would run it, and says what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str) -> str:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_every_example_is_covered() -> None:
    assert {path.name for path in EXAMPLES.glob("*.py")} == set(EXPECTED)


EXPECTED = {
    "quickstart.py": ["rank 0 (pid", "computed 100", "rank 3 (pid", "computed 109"],
    "open_group_cancel.py": [
        "started ranks with pids",
        "event loop: still responsive",
        "rank 0: got SIGTERM, shutting down cleanly",
        "rank 1: got SIGTERM, shutting down cleanly",
        "cancelled: True; every rank has been reaped",
    ],
    "failure.py": [
        "rank 1 (pid",
        "-- Process 1 terminated with the following error:",
        "ValueError: rank 1: loss became NaN at step 3",
        "the original exception is chained: ValueError('rank 1: loss became NaN at step 3')",
    ],
    "restart.py": [
        "rank 1: run 0, resuming at step 0",
        "event: Exited rank 1: raised",
        "event: Restarting rank 1",
        "rank 1: run 1, resuming at step 3",
        "results: [6, 6]; restarts: 1",
    ],
    "warm_start.py": [
        "rank 0: run 0, preloaded: True",
        "rank 1: run 1, preloaded: True",
        "every rank and the restart forked from one template: True",
        "a later group reuses it: True",
    ],
    "hang_detection.py": [
        "rank 1 (pid",
        "is hung: it sent no heartbeat for",
        "in wait_for_peer_that_never_comes",
        "in train",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_prints_what_it_promises(name: str) -> None:
    output = run_example(name)
    for expected in EXPECTED[name]:
        assert expected in output, f"{name} did not print {expected!r}:\n{output}"
