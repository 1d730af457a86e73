"""The Ray backend against local processes: group start, failure-to-raise, node loss.

Runs on a two-node Ray cluster that it starts on this machine (``tests/ray_cluster.py``:
two ``ray start`` nodes on loopback, 4 logical CPUs each) and stops at the end::

    .venv/bin/pip install -e '.[test,ray]'
    .venv/bin/python benchmarks/bench_ray.py                  # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_ray.py --default-health-checks   # only node loss,
                                                              # with Ray's own settings

Scenarios (each peer alternates with the other, after one untimed warm-up):

* ``start``: 8 trivial ranks. From just before ``spawn()`` to the last rank's entry
  stamp ("all running") and to ``spawn()`` returning the results ("joined"). Ray:
  ``RayBackend(resources_per_rank={"CPU": 1})``, PACK (both nodes are needed); local:
  the ``spawn`` start method.
* ``failure``: 2 ranks, rank 1 raises at once carrying its ``time.monotonic()``; from
  that stamp to ``join()`` raising ``ProcessRaisedException`` (rank 0 stopped with
  SIGTERM and gone). CLOCK_MONOTONIC is system-wide, and both Ray nodes are on this
  machine, so the rank's stamp compares with ours.
* ``node loss``: 2 ranks, one per node (STRICT_SPREAD); SIGKILL of the worker node's
  raylet, to ``join()`` raising ``ProcessExitedException`` for the rank on that node.
  Ray declares a node dead after ``RAY_health_check_failure_threshold`` failed probes,
  one every ``RAY_health_check_period_ms`` (see ``tests/ray_cluster.py``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc

import aiospawn

# Local ranks (spawn) import this file again as their main module: everything
# heavy (Ray, the cluster helpers) is imported inside the functions, so that a
# local rank pays for the interpreter and aiospawn only.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import ray_ranks  # noqa: E402  (standard library only)

if TYPE_CHECKING:
    from aiospawn.ray import RayBackend
    from tests.ray_cluster import LocalCluster

Sample = dict[str, float]


async def start_8(backend: RayBackend | None) -> Sample:
    options = {} if backend is None else {"backend": backend}
    began = time.monotonic()
    stamps = await aiospawn.spawn(ray_ranks.entry_stamp, nprocs=8, **options)  # type: ignore[arg-type]
    joined = time.monotonic()
    return {"all running [ms]": (max(stamps) - began) * 1e3, "joined [ms]": (joined - began) * 1e3}


async def failure(backend: RayBackend | None) -> Sample:
    options = {} if backend is None else {"backend": backend}
    try:
        await aiospawn.spawn(ray_ranks.stamp_and_fail, args=(1,), nprocs=2, **options)  # type: ignore[arg-type]
    except aiospawn.ProcessRaisedException as exc:
        raised = time.monotonic()
        stamp = exc.__cause__.args[0] if isinstance(exc.__cause__, ValueError) else math.nan
        return {"raised [ms]": (raised - stamp) * 1e3}
    raise AssertionError("the group did not fail")


async def node_loss(cluster: LocalCluster, backend: RayBackend) -> Sample:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        (inner,) = listener.listeners
        port = inner.extra(anyio.abc.SocketAttribute.local_port)
        ctx = await aiospawn.start_processes(
            ray_ranks.sleep_forever, args=(port,), nprocs=2, join=False, backend=backend
        )
        for _ in range(2):
            async with await inner.accept() as stream:  # type: ignore[attr-defined]
                await stream.receive()
    worker = next(node for node in cluster.nodes if node.tag == "node2")
    killed = time.monotonic()
    raylet = worker.raylet()
    raylet.kill()
    try:
        await ctx.join()
    except aiospawn.ProcessExitedException as exc:
        detected = time.monotonic()
        print(f"  reported as: {exc.msg.rpartition('): ')[2] or exc.msg}")
    else:
        raise AssertionError("the group did not fail")
    await anyio.to_thread.run_sync(cluster.kill_node, worker)
    await anyio.to_thread.run_sync(cluster.add_worker_node)
    assert await anyio.to_thread.run_sync(cluster.wait_for_nodes, 2)
    return {"detected [ms]": (detected - killed) * 1e3}


async def alternate(
    peers: dict[str, Callable[[], Awaitable[Sample]]], trials: int
) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {name: {} for name in peers}
    for trial in range(trials + 1):
        for name, run in peers.items():
            sample = await run()
            if trial == 0:
                continue  # warm-up
            for metric, value in sample.items():
                results[name].setdefault(metric, []).append(value)
    return results


def report(title: str, results: dict[str, dict[str, list[float]]]) -> None:
    print(f"\n### {title}\n")
    print("| peer | metric | median | min | max | trials |")
    print("|---|---|---|---|---|---|")
    for peer, metrics in results.items():
        for metric, values in metrics.items():
            print(
                f"| {peer} | {metric} | {statistics.median(values):.0f} | {min(values):.0f}"
                f" | {max(values):.0f} | {len(values)} |"
            )


def main() -> None:
    import ray

    from aiospawn.ray import RayBackend
    from tests.ray_cluster import HEALTH_CHECKS, LocalCluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--node-trials", type=int, default=3)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--default-health-checks", action="store_true")
    options = parser.parse_args()

    if options.default_health_checks:
        default_node_loss(options)
        return
    began = time.monotonic()
    cluster = LocalCluster.start()
    print(f"two-node cluster up in {time.monotonic() - began:.1f} s")
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        spread = RayBackend(address=cluster.address)

        async def scenarios() -> None:
            report(
                "start: 8 trivial ranks",
                await alternate(
                    {"ray": lambda: start_8(spread), "local (spawn)": lambda: start_8(None)},
                    options.trials,
                ),
            )
            report(
                "failure: rank raises -> join() raises",
                await alternate(
                    {"ray": lambda: failure(spread), "local (spawn)": lambda: failure(None)},
                    options.trials,
                ),
            )
            strict = RayBackend(address=cluster.address, placement="STRICT_SPREAD")
            settings = ", ".join(f"{key}={value}" for key, value in HEALTH_CHECKS.items())
            report(
                f"node loss: raylet SIGKILL -> join() raises ({settings})",
                await alternate({"ray": lambda: node_loss(cluster, strict)}, options.node_trials),
            )

        anyio.run(scenarios, backend=options.backend)
    finally:
        ray.shutdown()
        cluster.stop()


def default_node_loss(options: argparse.Namespace) -> None:
    """The node-loss scenario alone, on a cluster with Ray's own health-check settings."""
    import ray

    from aiospawn.ray import RayBackend
    from tests.ray_cluster import LocalCluster

    cluster = LocalCluster.start(fast_health_checks=False)
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        strict = RayBackend(address=cluster.address, placement="STRICT_SPREAD")

        async def scenario() -> None:
            report(
                "node loss: raylet SIGKILL -> join() raises (Ray's default health checks)",
                await alternate({"ray": lambda: node_loss(cluster, strict)}, options.node_trials),
            )

        anyio.run(scenario, backend=options.backend)
    finally:
        ray.shutdown()
        cluster.stop()


if __name__ == "__main__":
    main()
