"""Scenario ``ray``: the Ray backend against local processes: group start, failure, node loss.

Needs the ray extra; without it the scenario is reported as skipped. It starts a
two-node Ray cluster on this machine (``tests/ray_cluster.py``: two ``ray start``
nodes on loopback, 4 logical CPUs each, stopped by pid at the end), so a default
run leaves it out: ``run.py --only ray`` or ``run.py --with-ray``.

Cases (the peers of each alternate, after one untimed warm-up each):

* start: 8 trivial ranks. From just before ``spawn()`` to the last rank's entry
  stamp ("all running") and to ``spawn()`` returning the results ("joined").
  Ray: ``RayBackend(resources_per_rank={"CPU": 1})``, PACK (both nodes are
  needed); local: the ``spawn`` start method.
* failure: 2 ranks, rank 1 raises at once carrying its ``time.monotonic()``; from
  that stamp to ``join()`` raising ``ProcessRaisedException`` (rank 0 stopped with
  SIGTERM and gone). CLOCK_MONOTONIC is system-wide, and both Ray nodes are on
  this machine, so the rank's stamp compares with ours.
* node loss: 2 ranks, one per node (STRICT_SPREAD); SIGKILL of the worker node's
  raylet, to ``join()`` raising ``ProcessExitedException`` for the rank on that
  node. Ray declares a node dead after ``RAY_health_check_failure_threshold``
  failed probes, one every ``RAY_health_check_period_ms``: once on a cluster with
  the fast settings the tests use (``tests/ray_cluster.py``), once on a second
  cluster with Ray's own.
* round trip: one rank (``tests/ray_ranks.py``), 64 B: a message sent on
  ``ctx.channel(0)`` and the rank's echo received; ``ctx.call`` to that one
  rank; and the floor, a method of a plain Ray actor (``PlainEcho``) on the
  same cluster awaited from the event loop (``await ref`` on asyncio, through
  ``aiospawn.ray._bridge`` on trio). Each trial is the median of
  :data:`ROUND_TRIPS` round trips, after the groups and the actor are up.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.to_thread
from harness import Measure, Peer, ScenarioResult, Skipped, alternate, ms, progress

import aiospawn

# Local ranks (spawn) import run.py again as their main module, and the rank
# functions from the tests' package: everything heavy (Ray, the cluster
# helpers) is imported inside the functions, so that a local rank pays for
# the interpreter and aiospawn only.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import ray_ranks  # noqa: E402  (standard library only)

if TYPE_CHECKING:
    from aiospawn.ray import RayBackend
    from tests.ray_cluster import LocalCluster

START_RANKS = 8

#: Round trips one trial of the round-trip case times (its median is the trial's figure).
ROUND_TRIPS = 50

#: The message of the round-trip case.
SMALL = bytes(64)


async def _start(backend: RayBackend | None) -> Measure:
    options = {} if backend is None else {"backend": backend}
    began = time.monotonic()
    stamps = await aiospawn.spawn(ray_ranks.entry_stamp, nprocs=START_RANKS, **options)  # type: ignore[arg-type]
    joined = time.monotonic()
    return {"all running [ms]": ms(max(stamps) - began), "joined [ms]": ms(joined - began)}


async def _failure(backend: RayBackend | None) -> Measure:
    options = {} if backend is None else {"backend": backend}
    try:
        await aiospawn.spawn(ray_ranks.stamp_and_fail, args=(1,), nprocs=2, **options)  # type: ignore[arg-type]
    except aiospawn.ProcessRaisedException as exc:
        raised = time.monotonic()
        stamp = exc.__cause__.args[0] if isinstance(exc.__cause__, ValueError) else math.nan
        return {"raised [ms]": ms(raised - stamp)}
    raise AssertionError("the group did not fail")


async def _node_loss(
    result: ScenarioResult, case: str, cluster: LocalCluster, backend: RayBackend
) -> Measure:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        (inner,) = listener.listeners
        port = inner.extra(anyio.abc.SocketAttribute.local_port)
        ctx = await aiospawn.start_processes(
            ray_ranks.sleep_forever, args=(port,), nprocs=2, join=False, backend=backend
        )
        for _ in range(2):  # both ranks running
            async with await inner.accept() as stream:  # type: ignore[attr-defined]
                await stream.receive()
    worker = next(node for node in cluster.nodes if node.tag == "node2")
    killed = time.monotonic()
    worker.raylet().kill()
    try:
        await ctx.join()
    except aiospawn.ProcessExitedException as exc:
        detected = time.monotonic()
        result.note(f"{case}: reported as: {exc.msg.rpartition('): ')[2] or exc.msg}")
    else:
        raise AssertionError("the group did not fail")
    # A fresh worker node for the next trial, outside the timing.
    await anyio.to_thread.run_sync(cluster.kill_node, worker)
    await anyio.to_thread.run_sync(cluster.add_worker_node)
    assert await anyio.to_thread.run_sync(cluster.wait_for_nodes, 2), "node2 did not come back"
    return {"detected [ms]": ms(detected - killed)}


def _median_round_trip(samples: list[float]) -> Measure:
    samples.sort()
    return {"round trip [us]": samples[len(samples) // 2] * 1e6}


async def _plain_actor(actor: object) -> Measure:
    import sniffio

    from aiospawn.ray._bridge import get

    asyncio = sniffio.current_async_library() == "asyncio"
    samples = []
    for _ in range(ROUND_TRIPS):
        began = time.perf_counter()
        ref = actor.echo.remote(SMALL)  # type: ignore[attr-defined]
        echoed = await ref if asyncio else await get(ref)
        samples.append(time.perf_counter() - began)
        assert echoed == SMALL
    return _median_round_trip(samples)


async def _channel(channel: aiospawn.RankChannel) -> Measure:
    samples = []
    for _ in range(ROUND_TRIPS):
        began = time.perf_counter()
        await channel.send(SMALL)
        echoed = await channel.receive()
        samples.append(time.perf_counter() - began)
        assert echoed == (0, SMALL)
    return _median_round_trip(samples)


async def _call(ctx: aiospawn.AsyncProcessContext[object]) -> Measure:
    samples = []
    for _ in range(ROUND_TRIPS):
        began = time.perf_counter()
        answer = await ctx.call("add", 1, ranks=[0])
        samples.append(time.perf_counter() - began)
        assert answer == [(0, 1)]
    return _median_round_trip(samples)


async def round_trips(result: ScenarioResult, backend: RayBackend, trials: int) -> None:
    """The round-trip case: aiospawn's channel and call to one Ray rank, and a plain actor call."""
    import ray

    plain = ray.remote(ray_ranks.PlainEcho).options(num_cpus=0).remote()
    try:
        async with (
            aiospawn.open_group(ray_ranks.echo, nprocs=1, backend=backend) as echo,
            aiospawn.open_group(
                ray_ranks.serve_shard, nprocs=1, backend=backend, wait_ready=True
            ) as served,
        ):
            channel = echo.channel(0)
            assert await channel.receive() == ("hello", 0)
            await alternate(
                result,
                "round trip, 64 B, one rank",
                [
                    Peer("plain Ray actor call", partial(_plain_actor, plain), trials, warmup=1),
                    Peer("aiospawn channel", partial(_channel, channel), trials, warmup=1),
                    Peer("aiospawn ctx.call", partial(_call, served), trials, warmup=1),
                ],
                rotate=True,
            )
            result.floors["round trip, 64 B, one rank"] = "plain Ray actor call"
    finally:
        ray.kill(plain)


async def _on_cluster(
    fast_health_checks: bool, body: Callable[[LocalCluster], Awaitable[None]]
) -> float:
    """Start a two-node cluster, run ``body(cluster)`` connected to it, stop it.

    Returns the seconds the cluster took to start.
    """
    import ray

    from tests.ray_cluster import LocalCluster

    began = time.monotonic()
    cluster = await anyio.to_thread.run_sync(
        partial(LocalCluster.start, fast_health_checks=fast_health_checks)
    )
    up = time.monotonic() - began
    progress(f"[ray] two-node cluster up in {up:.1f} s at {cluster.address}")
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        await body(cluster)
    finally:
        ray.shutdown()
        cluster.stop()
    return up


async def ray_backend(result: ScenarioResult, quick: bool) -> None:
    """Group start, failure-to-raise and node-loss detection, Ray against local ranks."""
    try:
        import ray  # noqa: F401  (only to learn whether the extra is installed)
    except ImportError as exc:
        raise Skipped(
            f"ray is not importable ({exc}); install the extra: pip install -e '.[bench,ray]'"
        ) from exc
    from aiospawn.ray import RayBackend
    from tests.ray_cluster import CPUS_PER_NODE, HEALTH_CHECKS

    trials, node_trials = (2, 1) if quick else (5, 3)

    async def fast(cluster: LocalCluster) -> None:
        pack = RayBackend(address=cluster.address)
        await alternate(
            result,
            f"start, N={START_RANKS}",
            [
                Peer("ray", partial(_start, pack), trials, warmup=1),
                Peer("local (spawn)", partial(_start, None), trials, warmup=1),
            ],
        )
        await alternate(
            result,
            "failure, N=2",
            [
                Peer("ray", partial(_failure, pack), trials, warmup=1),
                Peer("local (spawn)", partial(_failure, None), trials, warmup=1),
            ],
        )
        await round_trips(result, pack, trials)
        await node_loss("node loss, N=2, fast health checks")(cluster)

    def node_loss(case: str) -> Callable[[LocalCluster], Awaitable[None]]:
        async def body(cluster: LocalCluster) -> None:
            strict = RayBackend(address=cluster.address, placement="STRICT_SPREAD")
            run = partial(_node_loss, result, case, cluster, strict)
            await alternate(result, case, [Peer("ray", run, node_trials, warmup=1)])

        return body

    result.note(
        f"Two `ray start` nodes on loopback, {CPUS_PER_NODE} logical CPUs each"
        " (`tests/ray_cluster.py`). start: Ray with"
        ' `RayBackend(resources_per_rank={"CPU": 1})`, PACK (both nodes are needed), local'
        " with the `spawn` start method; 'all running' is the last rank's entry stamp,"
        " 'joined' is `spawn()` returning the results. failure: from rank 1's"
        " `time.monotonic()`, carried by its exception, to `join()` raising (rank 0 stopped"
        " and gone). node loss: one rank per node (STRICT_SPREAD), from SIGKILL of the worker"
        " node's raylet to `join()` raising; a fresh worker node is started between trials."
        " 'fast health checks': every node started with"
        f" {', '.join(f'{key}={value}' for key, value in HEALTH_CHECKS.items())}, as the tests"
        " do (a crashed node is declared dead after 3 refused probes, 0.5 s apart); 'Ray's"
        " default health checks': a second cluster with Ray's own settings (a probe every"
        " 3 s, 5 failures)."
    )
    fast_up = await _on_cluster(True, fast)
    default_up = await _on_cluster(False, node_loss("node loss, N=2, Ray's default health checks"))
    result.note(
        f"The cluster took {fast_up:.1f} s to start with the fast health checks and"
        f" {default_up:.1f} s with Ray's defaults (not timed in the table)."
    )
