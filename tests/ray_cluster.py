"""A real two-node Ray cluster on this machine, for the Ray backend's tests and benchmark.

Both nodes are started with ``ray start``, each in a session of its own
(``start_new_session``): the ``ray start`` command exits once its node is
up, so the node's processes (GCS, raylet, agents, and the workers the raylet
starts for actors) are re-parented away from the test process. The leak
checks, which look at the test process's descendants, therefore see none of
them, and a rank's worker process is never mistaken for a leaked child. The
processes of a node are found by that session id, and are stopped by pid:
never ``ray stop``, which stops every Ray process on the machine.

Node-loss detection is made fast with the GCS health-check settings, given
to every node as environment variables (Ray's defaults: 5 s initial delay,
a probe every 3 s, 10 s timeout, 5 failures, so about 15 s for a crashed node)::

    RAY_health_check_initial_delay_ms=0
    RAY_health_check_period_ms=500
    RAY_health_check_timeout_ms=2000
    RAY_health_check_failure_threshold=3

A crashed node refuses the probe at once, so it is declared dead after three
probes, about 1.5 s; a node that stalls (a loaded 2-core machine) gets 2 s per
probe before one counts as failed, so it is not declared dead by mistake.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from aiospawn._core._env import free_port

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))

#: Logical CPUs each node offers: 8 ranks of {"CPU": 1} fit on the two nodes.
CPUS_PER_NODE = 4

#: The environment of every node's processes (see the module docstring).
HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}


@dataclass
class Node:
    """One ``ray start`` node: its session id (the ``ray start`` pid) and its resource tag."""

    sid: int
    tag: str

    def processes(self) -> list[psutil.Process]:
        """Every live process of the node, workers included."""
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(process.pid) == self.sid:
                    found[process.pid] = process
                    for child in process.children(recursive=True):
                        found[child.pid] = child
        return list(found.values())

    def raylet(self) -> psutil.Process:
        """The node's raylet."""
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                if process.name() == "raylet":
                    return process
        raise LookupError(f"node {self.tag} has no raylet")


@dataclass
class LocalCluster:
    """A head node and a worker node on loopback, started and stopped by this process."""

    temp_dir: str
    port: int
    env: dict[str, str]
    nodes: list[Node] = field(default_factory=list)

    @property
    def address(self) -> str:
        """What ``ray.init(address=...)`` and ``RayBackend(address=...)`` take."""
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, *, fast_health_checks: bool = True) -> LocalCluster:
        """Start the head node and one worker node; return once both are up.

        Args:
            fast_health_checks: Use :data:`HEALTH_CHECKS`; False keeps Ray's defaults.
        """
        # A short path: Ray's unix sockets live under it (108-byte limit).
        temp_dir = tempfile.mkdtemp(prefix="aiospawn-ray-", dir="/tmp")
        env = dict(
            os.environ,
            **(HEALTH_CHECKS if fast_health_checks else {}),
            RAY_USAGE_STATS_ENABLED="0",
            # A throwaway cluster on loopback needs no token (and none is written
            # to ~/.ray/auth_token).
            RAY_AUTH_MODE="disabled",
            # The ranks import the tests' rank functions, as a real cluster has
            # the job's code on every node.
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        )
        env.pop("TMPDIR", None)  # the tests' private temp dir is checked for leftovers
        cluster = cls(temp_dir, free_port(), env)
        try:
            cluster._start_node(
                "head",
                [
                    "--head",
                    f"--port={cluster.port}",
                    f"--temp-dir={temp_dir}",
                    "--include-dashboard=false",
                ],
            )
            cluster.add_worker_node()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_worker_node(self, tag: str = "node2") -> Node:
        """Start a worker node offering the custom resource ``tag``."""
        return self._start_node(tag, [f"--address={self.address}"])

    def _start_node(self, tag: str, options: list[str]) -> Node:
        command = [
            RAY,
            "start",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={CPUS_PER_NODE}",
            "--resources",
            json.dumps({tag: 100}),
            "--disable-usage-stats",
            "--dashboard-agent-listen-port=0",
            "--metrics-export-port=0",
            *options,
        ]
        process = subprocess.Popen(
            command,
            env=self.env,
            cwd=ROOT,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        node = Node(process.pid, tag)
        self.nodes.append(node)
        output, _ = process.communicate(timeout=120)
        if process.returncode != 0:
            raise RuntimeError(f"`ray start` for {tag} failed:\n{output.decode(errors='replace')}")
        return node

    def wait_for_nodes(self, count: int, seconds: float = 30) -> bool:
        """Wait until Ray shows ``count`` live nodes (needs ``ray.init`` in this process)."""
        import ray

        deadline = time.monotonic() + seconds
        while len([node for node in ray.nodes() if node["Alive"]]) != count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill_node(self, node: Node) -> None:
        """Kill a node abruptly: SIGKILL its raylet, then the rest of its processes."""
        with contextlib.suppress(LookupError, psutil.Error):
            raylet = node.raylet()
            raylet.kill()
            raylet.wait(10)
        self._kill(node, signal.SIGKILL)
        self.nodes.remove(node)

    def stop(self) -> None:
        """Stop every node (workers last to first, then the head) and remove the temp dir."""
        for node in reversed(self.nodes):
            self._kill(node, signal.SIGTERM)
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    @staticmethod
    def _kill(node: Node, signum: int) -> None:
        processes = node.processes()
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signum)
        # Ray's daemons take their time over SIGTERM; this cluster holds nothing worth it.
        _, alive = psutil.wait_procs(processes, timeout=2)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        # Processes re-parented to init are reaped by it, a moment later.
        deadline = time.monotonic() + 10
        while node.processes() and time.monotonic() < deadline:
            time.sleep(0.05)
