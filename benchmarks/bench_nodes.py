"""Across nodes, from a rank's failure to every other rank stopped: aiospawn run against torchrun.

Two launchers on this machine are the nodes of one job (the static
rendezvous on a free localhost port, 2 ranks each), running
``tests/cli_programs/nodes_job.py --fail-rank 3``: global rank 3 (node 1)
exits with status 3 after a first all-reduce, and the three others then wait,
in one of two ways:

* ``collective``: in a second gloo all-reduce, which gloo itself ends when it
  sees the peer's connection close;
* ``sleep``: in a wait no peer's death ends, as an NCCL collective often is
  until its watchdog (10 min by default): only a launcher can stop them.

Each trial is timed from the failing rank's own ``time.time()`` just before
it exits to the moment the last of the other three ranks is gone (polled every
10 ms), capped at ``CAP`` seconds. The peers alternate, trial by trial, in the
same run. Usage: ``python benchmarks/bench_nodes.py [TRIALS]`` (default 3);
it prints one line per trial and a summary with the load average.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "tests" / "cli_programs" / "nodes_job.py")

#: A trial gives up waiting for the ranks to stop after this long (seconds).
CAP = 30.0

LAUNCHERS = {
    "aiospawn": [sys.executable, "-m", "aiospawn", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def trial(peer: str, wait: str) -> float | None:
    """One job; the seconds from the failure to the other ranks gone (None: over CAP)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                *LAUNCHERS[peer],
                "--nnodes=2",
                f"--node-rank={node}",
                f"--master-port={port}",
                "--nproc-per-node=2",
                JOB,
                "--fail-rank=3",
                f"--wait={wait}",
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for node in range(2)
    ]
    waiting: list[int] = []
    try:
        failed_at: float | None = None
        deadline = time.monotonic() + 120
        out = b""
        # Read both launchers' lines until the failure and three waiting ranks are seen.
        streams = [proc.stdout.fileno() for proc in procs if proc.stdout is not None]
        while failed_at is None or len(waiting) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{peer}: the job did not get going: {out!r}")
            ready, _, _ = select.select(streams, [], [], 0.01)
            for fd in ready:
                out += os.read(fd, 65536)
            lines = out.decode().splitlines()
            waiting = [int(m[1]) for line in lines if (m := re.search(r"waiting (\d+)$", line))]
            for line in lines:
                if m := re.search(r"failing \d+ (\S+)$", line):
                    failed_at = float(m[1])
        while time.time() - failed_at < CAP:
            if not any(_alive(pid) for pid in waiting):
                return time.time() - failed_at
            time.sleep(0.01)
        return None
    finally:
        # torchrun's workers leave the launcher's session: find every
        # descendant before killing anything, and the waiting ranks by pid.
        doomed = set(waiting)
        for proc in procs:
            doomed.update(_session(proc.pid))
            with contextlib.suppress(psutil.NoSuchProcess):
                doomed.update(child.pid for child in psutil.Process(proc.pid).children(True))
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in procs:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _session(sid: int) -> list[int]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid:
                found.append(process.pid)
        except OSError:
            pass
    return found


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results: dict[tuple[str, str], list[float | None]] = {}
    for wait in ("collective", "sleep"):
        for index in range(trials):
            for peer in ("aiospawn", "torchrun") if index % 2 == 0 else ("torchrun", "aiospawn"):
                seconds = trial(peer, wait)
                results.setdefault((peer, wait), []).append(seconds)
                shown = f"{seconds:.2f} s" if seconds is not None else f"over {CAP:g} s"
                print(f"{wait:10} {peer:8} trial {index}: {shown}", flush=True)
    print(f"load average: {os.getloadavg()}")
    for (peer, wait), samples in results.items():
        done = [s for s in samples if s is not None]
        median = f"median {statistics.median(done):.2f} s" if done else ""
        print(f"{wait:10} {peer:8} {len(done)}/{len(samples)} stopped within {CAP:g} s {median}")


if __name__ == "__main__":
    main()
