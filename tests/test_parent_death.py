"""When the supervising process is SIGKILLed, its ranks and their children die with it.

Each trial runs tests/reliability_supervisor.py in a session of its own. It
starts two ranks; each rank starts two grandchildren in the rank's process
group (one plain ``os.fork``, one ``subprocess.Popen``) and reports every pid.
The test SIGKILLs the supervisor and polls until every rank and grandchild is
gone: reparented to init (or a subreaper), so "gone" means no such process or
a zombie, not something we could reap. Variants: the supervisor ignores SIGINT
as a background job does (inherited through exec), and ranks that ignore
SIGTERM and SIGINT (so do their grandchildren), which only SIGKILL stops.

``AIOSPAWN_STRESS`` scales the number of trials of the slow variant.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import is_gone

SUPERVISOR = Path(__file__).resolve().parent / "reliability_supervisor.py"
STRESS = float(os.environ.get("AIOSPAWN_STRESS", "1"))

#: Seconds within which every rank and grandchild must be gone.
DEATH_BOUND = 2.0

#: The slowest death seen by any trial in this session, for the report.
SLOWEST: dict[str, float] = {}

#: variant: (the supervisor ignores SIGINT, the ranks ignore SIGTERM and SIGINT)
VARIANTS = {
    "plain": (False, False),
    "supervisor-ignores-sigint": (True, False),
    "ranks-ignore-term-and-int": (False, True),
}


def ignored_signals(pid: int) -> set[int]:
    """The signals ``pid`` ignores, from the SigIgn mask in /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigIgn:"):
                mask = int(line.split()[1], 16)
                return {signum for signum in range(1, 65) if mask & (1 << (signum - 1))}
    raise AssertionError(f"no SigIgn line for pid {pid}")


def ignore_sigint() -> None:
    # Runs in the child between fork and exec, as a shell does for a background
    # job: the ignored disposition survives exec, and Python keeps it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def read_report(supervisor: subprocess.Popen[bytes], seconds: float) -> dict[str, Any]:
    """The supervisor's one JSON line, or an AssertionError with its stderr."""
    assert supervisor.stdout is not None
    ready, _, _ = select.select([supervisor.stdout], [], [], seconds)
    line = supervisor.stdout.readline() if ready else b""
    if not line:
        supervisor.kill()
        _, err = supervisor.communicate()
        raise AssertionError(f"the supervisor reported nothing in {seconds} s:\n{err.decode()}")
    report: dict[str, Any] = json.loads(line)
    return report


def kill_leftovers(supervisor: subprocess.Popen[bytes], pids: list[int]) -> None:
    """After a failed trial: SIGKILL what this trial started, by process group and pid.

    The supervisor's group (its session: the fork server and resource tracker
    live there) and each rank's group (its grandchildren) are ours alone.
    """
    for group in [supervisor.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    for pid in pids:
        if not is_gone(pid):
            os.kill(pid, signal.SIGKILL)


def one_trial(start_method: str, variant: str) -> float:
    """Run one supervisor, SIGKILL it, and return how long its family took to die."""
    supervisor_ignores_sigint, ranks_ignore_term_int = VARIANTS[variant]
    # A SIGKILLed supervisor cannot remove multiprocessing's temp dir (the fork
    # server's socket lives there): give it one of its own, removed here.
    tmp = tempfile.mkdtemp(prefix="aiospawn-rel-supervisor-")
    supervisor = subprocess.Popen(
        [
            sys.executable,
            str(SUPERVISOR),
            "family",
            start_method,
            "1" if ranks_ignore_term_int else "0",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=ignore_sigint if supervisor_ignores_sigint else None,
        env={**os.environ, "TMPDIR": tmp},
    )
    pids: list[int] = []
    try:
        report = read_report(supervisor, seconds=60)
        assert report["supervisor"] == supervisor.pid
        rank_pids = [entry["pid"] for entry in report["ranks"]]
        grandchildren = [pid for entry in report["ranks"] for pid in entry["grandchildren"]]
        pids = rank_pids + grandchildren
        assert len(set(pids)) == 6, report
        assert not any(is_gone(pid) for pid in pids), report
        for pid in rank_pids:  # each rank leads its group, which holds its grandchildren
            assert os.getpgid(pid) == pid
        for entry in report["ranks"]:
            assert {os.getpgid(pid) for pid in entry["grandchildren"]} == {entry["pid"]}
        if supervisor_ignores_sigint:
            assert signal.SIGINT in ignored_signals(supervisor.pid)
            # The ranks get Python's default SIGINT handling back.
            assert not any(signal.SIGINT in ignored_signals(pid) for pid in rank_pids)
        if ranks_ignore_term_int:
            for pid in pids:
                assert {signal.SIGTERM, signal.SIGINT} <= ignored_signals(pid)

        killed_at = time.monotonic()
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait()
        while not all(is_gone(pid) for pid in pids):
            elapsed = time.monotonic() - killed_at
            if elapsed > DEATH_BOUND:
                alive = [pid for pid in pids if not is_gone(pid)]
                raise AssertionError(
                    f"{start_method}/{variant}: still running {elapsed:.2f} s after the"
                    f" supervisor was SIGKILLed: {alive} of {report}"
                )
            time.sleep(0.005)
        took = time.monotonic() - killed_at
        # Everything that inherited the supervisor's stdout (ranks, grandchildren,
        # the fork server, the resource tracker) is gone once the pipe reads EOF.
        assert supervisor.stdout is not None
        ready, _, _ = select.select([supervisor.stdout], [], [], 10)
        assert ready, "a descendant still holds the supervisor's stdout after 10 s"
        assert supervisor.stdout.read() == b""
        return took
    except BaseException:
        kill_leftovers(supervisor, pids)
        raise
    finally:
        supervisor.kill()  # no-op once it is dead; reaped by communicate()
        supervisor.communicate()
        shutil.rmtree(tmp)


def run_trials(start_method: str, variant: str, trials: int) -> None:
    times = [one_trial(start_method, variant) for _ in range(trials)]
    key = f"{start_method}/{variant}"
    SLOWEST[key] = max(SLOWEST.get(key, 0.0), *times)
    print(
        f"parent death {key}: {trials} trials, time to death max {max(times) * 1000:.1f} ms,"
        f" median {sorted(times)[len(times) // 2] * 1000:.1f} ms"
    )


@pytest.fixture(scope="module", autouse=True)
def _report_slowest() -> Iterator[None]:
    yield
    if SLOWEST:
        worst = max(SLOWEST, key=SLOWEST.__getitem__)
        print(f"\nparent death: slowest {SLOWEST[worst] * 1000:.1f} ms ({worst})")


START_METHODS = ["spawn", "fork", "forkserver"]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("start_method", START_METHODS)
def test_ranks_and_grandchildren_die_with_a_sigkilled_supervisor(
    start_method: str, variant: str
) -> None:
    run_trials(start_method, variant, trials=1)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("start_method", START_METHODS)
def test_ranks_and_grandchildren_die_with_a_sigkilled_supervisor_many_times(
    start_method: str, variant: str
) -> None:
    run_trials(start_method, variant, trials=max(1, int(8 * STRESS)))
