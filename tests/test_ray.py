"""The Ray backend on a real two-node Ray cluster started on this machine.

One cluster serves the whole module (see ``tests/ray_cluster.py`` for how
it is started, why its processes are not children of the test process, and
its fast node health checks). After every test, Ray's control service must
show no actor and no placement group of ours still alive, and every rank's
worker process must be gone from the machine.

Ray's HTTP state API (``ray.util.state``) needs the dashboard and
``ray[default]``; the same facts come from the control service directly:
its actor table (``ray._private.state.actors``: aiospawn's actors are
anonymous, so other jobs cannot look them up, and are found by class) and
``ray.util.placement_group_table``.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import psutil
import pytest

import aiospawn
from aiospawn import ProcessExitedException, ProcessRaisedException
from tests import ray_ranks, shm_ranks
from tests.helpers import send_storm, tripwire, wait_until

ray = pytest.importorskip("ray")

import numpy  # noqa: E402  (Ray's own dependency)

from aiospawn._core._context import group_of  # noqa: E402
from aiospawn._core._env import free_port  # noqa: E402
from aiospawn.ray import RayBackend  # noqa: E402  (after the skip: needs ray)
from tests.ray_cluster import LocalCluster  # noqa: E402

# One worker runs the module, which starts one Ray cluster for all its tests.
pytestmark = [pytest.mark.ray, pytest.mark.anyio, pytest.mark.xdist_group("ray")]

TORCHRUN = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    # Module scope: the tests that follow in the same run fork and spawn local
    # ranks, which should not inherit a live Ray connection and its threads.
    cluster = LocalCluster.start()
    try:
        # Connected once, before any test's leak baseline: the driver's own
        # threads and descriptors belong to the session, not to a test.
        previous = signal.getsignal(signal.SIGTERM)
        ray.init(address=cluster.address, logging_level="WARNING")
        signal.signal(signal.SIGTERM, previous)  # ray.init makes SIGTERM exit the process
        backend = RayBackend(address=cluster.address)
        # Ray exports the actor classes on first use.
        assert anyio.run(lambda: aiospawn.spawn(ray_ranks.square, nprocs=2, backend=backend)) == [
            0,
            1,
        ]
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


#: The classes of the actors aiospawn makes.
OUR_ACTORS = ("RankActor", "SignalBoard")


def our_actors() -> list[str]:
    """``Class:id`` of our actors that Ray does not yet show as dead."""
    from ray._private import state

    return sorted(
        f"{info['ActorClassName']}:{actor_id[:8]}"
        for actor_id, info in state.actors().items()
        if info["ActorClassName"].rpartition(".")[2] in OUR_ACTORS and info["State"] != "DEAD"
    )


def ours_alive() -> tuple[list[str], list[str]]:
    """Our actors and placement groups that Ray does not yet show as gone."""
    actors = our_actors()
    groups = [
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info["name"].startswith("aiospawn-") and info["state"] != "REMOVED"
    ]
    return actors, groups


@pytest.fixture
def cluster(ray_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The session's cluster with both nodes up; checked for leftovers afterwards."""
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    yield ray_cluster
    assert wait_until(lambda: ours_alive() == ([], []), 10), f"left on the cluster: {ours_alive()}"


def backend_for(cluster: LocalCluster, **options: object) -> RayBackend:
    return RayBackend(address=cluster.address, **options)  # type: ignore[arg-type]


class Ready:
    """The ranks' handshake: each connects to ``port`` and sends its rank once running."""

    def __init__(self, listener: anyio.abc.SocketListener) -> None:
        self._listener = listener
        self.port: int = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def wait(self, nprocs: int) -> set[int]:
        """Wait until ``nprocs`` ranks have reported; return their ranks."""
        ranks = set()
        with tripwire(60, f"{nprocs} ranks reporting ready"):
            for _ in range(nprocs):
                async with await self._listener.accept() as stream:
                    ranks.add(int(await stream.receive()))
        return ranks


@asynccontextmanager
async def ready_channel() -> AsyncIterator[Ready]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        (inner,) = listener.listeners
        assert isinstance(inner, anyio.abc.SocketListener)
        yield Ready(inner)


async def start_ready(
    fn: Any, nprocs: int, backend: RayBackend, **options: Any
) -> aiospawn.AsyncProcessContext[Any]:
    """Start ``fn(rank, port)`` ranks that report on a ready channel; return once all have."""
    async with ready_channel() as ready:
        ctx = await aiospawn.start_processes(
            fn, args=(ready.port,), nprocs=nprocs, join=False, backend=backend, **options
        )
        await ready.wait(nprocs)
    return ctx


def assert_gone(pids: list[int]) -> None:
    assert wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids), 10), pids


async def test_results_and_torchrun_environment_across_nodes(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, placement="SPREAD")
    with tripwire(60, "a 4-rank group on two nodes"):
        results = await aiospawn.spawn(
            ray_ranks.environment, args=(TORCHRUN,), nprocs=4, backend=backend, torchrun_env=True
        )
    nodes = [result["node_id"] for result in results]
    assert len(set(nodes)) == 2, "SPREAD placed every rank on one node"
    envs = [result["env"] for result in results]
    assert [env["RANK"] for env in envs] == ["0", "1", "2", "3"]
    assert {env["WORLD_SIZE"] for env in envs} == {"4"}
    assert len({(env["MASTER_ADDR"], env["MASTER_PORT"]) for env in envs}) == 1
    assert int(envs[0]["MASTER_PORT"]) > 0
    # Ranks on one node are consecutive, and numbered 0.. on each node.
    for node in set(nodes):
        mine = [index for index, each in enumerate(nodes) if each == node]
        assert mine == list(range(mine[0], mine[0] + len(mine)))
        assert [envs[index]["LOCAL_RANK"] for index in mine] == [str(i) for i in range(len(mine))]
        assert {envs[index]["LOCAL_WORLD_SIZE"] for index in mine} == {str(len(mine))}
    assert {env["GROUP_RANK"] for env in envs} == {"0", "1"}
    assert envs[0]["GROUP_RANK"] == "0"
    assert_gone([result["pid"] for result in results])


async def test_environment_is_set_before_fn_is_imported(cluster: LocalCluster) -> None:
    results = await aiospawn.spawn(
        ray_ranks.imported_with,
        args=("SHARD",),
        nprocs=2,
        backend=backend_for(cluster),
        env=lambda rank: {"SHARD": f"s{rank}"},
    )
    assert results == ["s0", "s1"]


async def test_runtime_env_reaches_the_ranks(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, runtime_env={"env_vars": {"FROM_RUNTIME_ENV": "yes"}})
    results = await aiospawn.spawn(
        ray_ranks.imported_with, args=("FROM_RUNTIME_ENV",), nprocs=2, backend=backend
    )
    assert results == ["yes", "yes"]


async def test_raised_exception_is_unwrapped_and_siblings_stopped(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, placement="SPREAD")
    ctx = await aiospawn.start_processes(
        ray_ranks.fail_rank, args=(2,), nprocs=4, join=False, backend=backend, grace_period=1
    )
    pids = ctx.pids()
    with tripwire(60, "fail-fast of a Ray group"), pytest.raises(ProcessRaisedException) as info:
        await ctx.join()
    error = info.value
    assert error.error_index == 2
    assert type(error.__cause__) is ValueError
    assert error.__cause__.args == ("bad shard 2",)
    assert "-- Process 2 terminated with the following error:" in str(error)
    assert any("on Ray node" in note for note in error.__notes__)
    assert_gone(pids)
    # Idempotent: the same failure again, never a rank we stopped.
    with pytest.raises(ProcessRaisedException) as again:
        await ctx.join()
    assert again.value.error_index == 2


async def test_sys_exit_code_is_reported(cluster: LocalCluster) -> None:
    with tripwire(60, "a Ray group exiting"), pytest.raises(ProcessExitedException) as info:
        await aiospawn.spawn(ray_ranks.exit_with, args=(3,), nprocs=2, backend=backend_for(cluster))
    assert info.value.exit_code == 3
    assert info.value.error_index in (0, 1)


async def test_killed_worker_process_is_reported_with_its_node(cluster: LocalCluster) -> None:
    ctx = await start_ready(ray_ranks.sleep_forever, 3, backend_for(cluster), grace_period=1)
    pids = ctx.pids()
    psutil.Process(pids[1]).kill()
    with (
        tripwire(60, "a Ray group whose rank was killed"),
        pytest.raises(ProcessExitedException) as info,
    ):
        await ctx.join()
    error = info.value
    assert (error.error_index, error.error_pid) == (1, pids[1])
    assert error.signal_name == "SIGKILL"
    notes = "\n".join(error.__notes__)
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    assert any(f"on Ray node {address} " in notes for address in addresses), notes
    assert "worker process has died" in notes
    assert_gone(pids)


async def test_terminate_escalates_from_sigterm_to_ray_kill(cluster: LocalCluster) -> None:
    ctx = await start_ready(ray_ranks.ignore_sigterm, 2, backend_for(cluster))
    pids = ctx.pids()
    assert await ctx.join(timeout=0) is False
    with tripwire(60, "terminate() of a Ray group"):
        await ctx.terminate(grace_period=1)
    with pytest.raises(ProcessExitedException) as info:
        await ctx.join()
    assert info.value.error_index == 0
    assert info.value.signal_name == "SIGKILL"
    assert "sent by aiospawn" in str(info.value)
    assert_gone(pids)


async def test_sigterm_runs_the_ranks_own_handler(cluster: LocalCluster) -> None:
    # Once ready, the ranks' handlers are installed.
    ctx = await start_ready(ray_ranks.handle_sigterm, 2, backend_for(cluster))
    with tripwire(60, "terminate() of a Ray group"):
        await ctx.terminate(grace_period=30)
    with pytest.raises(ProcessExitedException) as info:
        await ctx.join()
    assert info.value.exit_code == 7


async def test_send_signal_is_refused_on_ray_and_the_group_goes_on(cluster: LocalCluster) -> None:
    # The board carries only the SIGTERM of a stop: nothing else reaches a rank.
    ctx = await start_ready(ray_ranks.handle_sigterm, 1, backend_for(cluster))
    with pytest.raises(RuntimeError, match="cannot pass signals"):
        ctx.send_signal(signal.SIGUSR1)
    assert await ctx.join(timeout=0) is False
    with tripwire(60, "terminate() of a Ray group"):
        await ctx.terminate(grace_period=30)
    with pytest.raises(ProcessExitedException) as info:
        await ctx.join()
    assert info.value.exit_code == 7  # its SIGTERM handler ran: the first signal it got


async def test_cancellation_stops_the_group(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, placement="SPREAD")
    async with ready_channel() as ready:
        ctx = await aiospawn.start_processes(
            ray_ranks.sleep_forever,
            args=(ready.port,),
            nprocs=4,
            join=False,
            backend=backend,
            grace_period=2,
        )
        pids = ctx.pids()
        with tripwire(60, "cancelling a Ray group's join"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ctx.join)
                await ready.wait(4)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
    assert_gone(pids)
    with pytest.raises(ProcessExitedException) as info:
        await ctx.join()
    assert info.value.signal_name == "SIGTERM"


async def test_open_group_block_is_cancelled_by_a_failing_rank(cluster: LocalCluster) -> None:
    with (
        tripwire(60, "an async with block over a Ray group"),
        pytest.raises(ProcessRaisedException) as info,
    ):
        async with aiospawn.open_group(
            ray_ranks.fail_rank, args=(1,), nprocs=2, backend=backend_for(cluster), grace_period=0.5
        ):
            await anyio.sleep(120)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [("one_for_one", [(0, 0), (1, 1)]), ("one_for_all", [(0, 1), (1, 1)])],
)
async def test_restart_policy_on_ray(
    cluster: LocalCluster, strategy: str, expected: list[tuple[int, int]]
) -> None:
    policy = aiospawn.RestartPolicy(
        max_restarts=1,
        strategy=strategy,  # type: ignore[arg-type]
        backoff=aiospawn.Backoff(initial=0),
    )
    with tripwire(60, "a Ray group restarting"):
        results = await aiospawn.spawn(
            ray_ranks.flaky,
            args=(strategy == "one_for_all",),
            nprocs=2,
            backend=backend_for(cluster),
            restart=policy,
            grace_period=1,
            torchrun_env=True,
        )
    assert results == expected


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_unplaceable_group_times_out_and_releases(
    cluster: LocalCluster, anyio_backend: str
) -> None:
    backend = backend_for(cluster, placement="STRICT_SPREAD", placement_timeout=2)
    with tripwire(60, "an unplaceable Ray group"), pytest.raises(TimeoutError) as info:
        await aiospawn.spawn(ray_ranks.square, nprocs=3, backend=backend)
    message = str(info.value)
    assert "could not place 3 ranks" in message
    assert "STRICT_SPREAD" in message


async def test_cancellation_while_placing_releases_the_reservation(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, placement="STRICT_SPREAD", placement_timeout=600)
    with tripwire(60, "cancelling a Ray group waiting for placement"):
        with anyio.move_on_after(1) as scope:  # the group can never be placed
            await aiospawn.spawn(ray_ranks.square, nprocs=3, backend=backend)
    assert scope.cancelled_caught


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_node_loss_fails_the_group(cluster: LocalCluster, anyio_backend: str) -> None:
    # One rank per node; the worker node's rank needs its resource.
    backend = backend_for(cluster, placement="STRICT_SPREAD")
    ctx = await start_ready(ray_ranks.sleep_forever, 2, backend, grace_period=2)
    pids = ctx.pids()
    worker = next(node for node in cluster.nodes if node.tag == "node2")
    on_worker = {process.pid for process in worker.processes()}
    lost = next(rank for rank, pid in enumerate(pids) if pid in on_worker)
    try:
        cluster.kill_node(worker)
        with (
            tripwire(60, "a Ray group losing a node"),
            pytest.raises(ProcessExitedException) as info,
        ):
            await ctx.join()
    finally:
        cluster.add_worker_node()
        assert cluster.wait_for_nodes(2)
    assert info.value.error_index == lost
    assert info.value.error_pid == pids[lost]
    assert "its Ray node died" in str(info.value)
    assert "Ray says" in "\n".join(info.value.__notes__)
    assert_gone(pids)
    assert cluster.wait_for_nodes(2)


def test_output_other_than_inherit_is_refused(ray_cluster: LocalCluster) -> None:
    backend = RayBackend(address=ray_cluster.address)
    with pytest.raises(ValueError, match="inherit"):
        anyio.run(
            lambda: aiospawn.start_processes(
                ray_ranks.square, nprocs=1, join=False, backend=backend, stdout="capture"
            )
        )


def test_backend_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="placement"):
        RayBackend(placement="DIAGONAL")
    with pytest.raises(ValueError, match="resources_per_rank"):
        RayBackend(resources_per_rank={"CPU": -1})
    with pytest.raises(ValueError, match="placement_timeout"):
        RayBackend(placement_timeout=0)


def test_no_cluster_is_a_clear_error_and_none_is_started() -> None:
    # A fresh interpreter (this one is connected already), pointed at a port
    # where nothing listens.
    script = textwrap.dedent(
        f"""
        import anyio, aiospawn, ray
        from aiospawn.ray import RayBackend
        from tests import ray_ranks
        backend = RayBackend(address="127.0.0.1:{free_port()}")
        try:
            anyio.run(lambda: aiospawn.spawn(ray_ranks.square, backend=backend))
        except ConnectionError as exc:
            print("ConnectionError:", exc)
        print("initialized:", ray.is_initialized())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert "ConnectionError:" in done.stdout, done.stderr
    assert "ray start --head" in done.stdout
    assert "initialized: False" in done.stdout


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_importing_aiospawn_never_imports_ray() -> None:
    out = run_python(
        """
        import sys
        import aiospawn, aiospawn.ray
        aiospawn.spawn, aiospawn.open_group  # the lazily loaded names too
        print("ray" in sys.modules)
        """
    )
    assert out.strip() == "False"


def test_without_ray_the_backend_names_the_extra() -> None:
    out = run_python(
        """
        import sys
        sys.modules["ray"] = None  # as if it were not installed
        import aiospawn.ray
        try:
            aiospawn.ray.RayBackend()
        except ImportError as exc:
            print(exc)
        """
    )
    assert 'pip install "aiospawn[ray]"' in out


def test_supervisor_death_leaves_nothing_on_the_cluster(ray_cluster: LocalCluster) -> None:
    # A supervisor in a process of its own starts a group, then is SIGKILLed:
    # Ray ends the actors of a dead owner and the placement groups of a dead job.
    script = textwrap.dedent(
        f"""
        import anyio, aiospawn
        from aiospawn.ray import RayBackend
        from tests import ray_ranks

        async def main():
            backend = RayBackend(address="{ray_cluster.address}")
            ctx = await aiospawn.start_processes(
                ray_ranks.sleep_forever, args=(0,), nprocs=2, join=False, backend=backend
            )
            print(*ctx.pids(), flush=True)
            await anyio.sleep_forever()

        anyio.run(main)
        """
    )
    supervisor = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert supervisor.stdout is not None
        pids = [int(pid) for pid in supervisor.stdout.readline().split()]
        assert len(pids) == 2, "the supervisor did not start its group"
        assert ours_alive() != ([], [])
    finally:
        supervisor.kill()
        supervisor.wait()
        if supervisor.stdout is not None:
            supervisor.stdout.close()
    assert wait_until(lambda: ours_alive() == ([], []), 30), f"left: {ours_alive()}"
    assert_gone(pids)


def test_layout_numbers_ranks_node_by_node() -> None:
    from aiospawn.ray._launcher import layout

    slots = layout(["b", "a", "b", "a", "c"], {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"})
    # Rank 0 keeps bundle 0's node; each node's ranks are consecutive.
    assert [slot.bundle for slot in slots] == [0, 2, 1, 3, 4]
    assert [slot.address for slot in slots] == ["10.0.0.2"] * 2 + ["10.0.0.1"] * 2 + ["10.0.0.3"]
    assert [slot.local_rank for slot in slots] == [0, 1, 0, 1, 0]
    assert [slot.local_world_size for slot in slots] == [2, 2, 2, 2, 1]
    assert [slot.node_rank for slot in slots] == [0, 0, 1, 1, 2]
    assert {slot.nodes for slot in slots} == {3}


def test_devices_per_rank_is_each_ranks_gpus() -> None:
    from aiospawn._core._spec import make_output_spec, make_spec
    from aiospawn.ray import check_group
    from aiospawn.ray._launcher import rank_resources

    def spec(**devices: Any) -> Any:
        output = make_output_spec("inherit", "inherit", False, "[rank{rank}]: ")
        return make_spec(ray_ranks.square, (), 2, "spawn", False, output=output, **devices)

    assert rank_resources(spec(devices_per_rank=2), {"CPU": 1}) == {"CPU": 1, "GPU": 2}
    assert rank_resources(spec(devices_per_rank=0), {"CPU": 1, "GPU": 0}) == {"CPU": 1}
    assert rank_resources(spec(), {"CPU": 1, "GPU": 1}) == {"CPU": 1, "GPU": 1}
    with pytest.raises(ValueError, match="different numbers of GPUs"):
        rank_resources(spec(devices_per_rank=1), {"CPU": 1, "GPU": 2})
    with pytest.raises(ValueError, match="names devices of this machine"):
        check_group(spec(devices=[0, 1]))


async def test_other_jobs_can_neither_find_nor_signal_our_ranks(cluster: LocalCluster) -> None:
    ctx = await start_ready(ray_ranks.sleep_forever, 2, backend_for(cluster), grace_period=1)
    pids = ctx.pids()
    try:
        # Running: two rank actors and the board of their node (PACK: one node
        # holds both) exist, and none has a name.
        assert [name.partition(":")[0] for name in our_actors()] == [
            "RankActor",
            "RankActor",
            "SignalBoard",
        ]
        named = ray.util.list_named_actors(all_namespaces=True)
        assert not [entry for entry in named if entry["name"].startswith("aiospawn-")], named
        # The handle a caller could only get from the supervisor itself.
        launcher: Any = group_of(ctx)._launcher
        board, token = launcher._board_of["0.0"], launcher._token
        with pytest.raises(PermissionError, match="token"):
            await anyio.to_thread.run_sync(
                ray.get, board.send.remote("0" * 32, "0.0", signal.SIGTERM)
            )
        with pytest.raises(PermissionError, match="token"):
            await anyio.to_thread.run_sync(ray.get, board.next_signal.remote("", "0.0"))
        with pytest.raises(PermissionError, match="token"):
            await anyio.to_thread.run_sync(ray.get, board.collect.remote(f"{'0' * 32} 0.0 0"))
        for refused in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
            with pytest.raises(ValueError, match="carries"):
                await anyio.to_thread.run_sync(ray.get, board.send.remote(token, "0.0", refused))
        assert await ctx.join(timeout=0) is False  # nothing refused reached a rank
    finally:
        with tripwire(60, "terminate() after refused signal requests"):
            await ctx.terminate()
    # Ended by our SIGTERM: a SIGKILL or SIGSTOP let through would show instead.
    with pytest.raises(ProcessExitedException) as info:
        await ctx.join()
    assert info.value.signal_name == "SIGTERM"
    assert_gone(pids)


def test_the_board_refuses_foreign_tokens_and_signals_and_prunes_its_queues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The board's own logic, without a cluster (a plain class; Ray runs its
    # methods on threads).
    from aiospawn.ray import _board

    monkeypatch.setattr(_board, "SIGNAL_WAIT", 0.01)
    board = _board.SignalBoard("secret")
    for call in (
        lambda: board.send("wrong", "0.0", signal.SIGTERM),
        lambda: board.next_signal("wrong", "0.0"),
        lambda: board.forget("wrong", "0.0"),
        lambda: board.keys("wrong"),
        lambda: board.address("wrong"),
        lambda: board.deliver(b"wrong 0.0 0 0\nhello"),
        lambda: board.collect("wrong 0.0 0"),
        lambda: board.release("wrong", "0.0"),
    ):
        with pytest.raises(PermissionError):
            call()
    for refused in (signal.SIGKILL, signal.SIGSTOP, signal.SIGUSR1, 0):
        with pytest.raises(ValueError, match="carries"):
            board.send("secret", "0.0", refused)
    # Taken: nothing left. Timed out: nothing left.
    board.send("secret", "0.0", signal.SIGTERM)
    assert board.next_signal("secret", "0.0") == signal.SIGTERM
    assert board.next_signal("secret", "1.0") == 0
    assert board.keys("secret") == []
    # Sent to an attempt that ended before taking it: dropped once forgotten.
    board.send("secret", "2.0", signal.SIGTERM)
    assert board.keys("secret") == ["2.0"]
    board.forget("secret", "2.0")
    assert board.keys("secret") == []


@contextlib.contextmanager
def board_in_this_process(token: str) -> Iterator[Any]:
    """A group's board as a plain object, its listening thread ended on exit.

    A Ray board's thread ends with its actor's process; here it would outlive
    the test, blocked in ``accept()``, in every later test of this process.
    """
    import socket
    import threading

    from aiospawn.ray import _board

    board = _board.SignalBoard(token)
    try:
        yield board
    finally:
        listener = board._listener
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept(), which then returns
            listener.close()
        for thread in threading.enumerate():
            if thread.name == "aiospawn-board":
                thread.join(10)
                assert not thread.is_alive(), "the board's accepting thread did not end"


def test_the_board_takes_channels_with_the_groups_token_only() -> None:
    # The board's socket, without a cluster: a rank's end connects as in run().
    import socket

    from aiospawn.ray import _board, _relay

    with board_in_this_process("secret") as board:
        address = board.address("secret")
        # A connection without the token is closed; its attempt gets nothing.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:
            stranger.connect(address)
            stranger.sendall(b"guess 0.0\n")
            assert stranger.recv(16) == b""
        rank = socket.socket(fileno=_relay.connect(address, "secret", "0.0"))
        with rank:
            assert board.deliver(b"secret 0.0 0 0\nhello") == _board.WRITTEN
            assert rank.recv(16) == b"hello"
            rank.sendall(b"world")
            assert board.collect("secret 0.0 10") == _board.GOING + b"world"
            # A delivery that polls brings the rank's answer back.
            with ThreadPoolExecutor(1) as pool:
                polled = pool.submit(board.deliver, b"secret 0.0 1 10\nping")
                assert rank.recv(16) == b"ping"
                rank.sendall(b"pong")
                assert polled.result(10) == _board.WRITTEN + _board.GOING + b"pong"
            # A rank blocked sending, which does not read: a delivery that polls
            # waits neither for its turn (behind a piece the rank does not take)
            # nor for room in the socket; it reads what the rank sent, and the
            # pieces are written in order once the rank reads again.
            rank.setblocking(False)
            sent = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    sent += rank.send(bytes(65536))
            rank.setblocking(True)
            big = bytes(range(256)) * 4096
            # Not `with`: a delivery that waited forever would hang its exit.
            pool = ThreadPoolExecutor(2)
            try:
                blocked = pool.submit(board.deliver, b"secret 0.0 2 0\n" + big)
                polled = pool.submit(board.deliver, b"secret 0.0 3 10\n" + big[::-1])
                # Within the deadlock tripwire: a delivery that waited would wait forever.
                answer = polled.result(10)
                assert answer[:2] == _board.WRITTEN + _board.GOING
                got = len(answer) - 2
                while got < sent:  # the rest of what the rank sent, read
                    got += len(board.collect("secret 0.0 10")) - 1
                assert got == sent
                received = bytearray()
                while len(received) < 2 * len(big):
                    received += rank.recv(2 * len(big) - len(received))
                assert received == big + big[::-1]
                assert blocked.result(10) == _board.WRITTEN
            finally:
                pool.shutdown(wait=False)
            # Pieces are written in their order, whatever order the calls start in.
            with ThreadPoolExecutor(2) as pool:
                later = pool.submit(board.deliver, b"secret 0.0 5 0\n!")
                assert board.deliver(b"secret 0.0 4 0\nagain") == _board.WRITTEN
                assert later.result(10) == _board.WRITTEN
            received = b""
            while len(received) < 6:
                received += rank.recv(16)
            assert received == b"again!"
            board.release("secret", "0.0")
            # The rank's end sees the end of the stream, and nothing more is taken.
            assert rank.recv(16) == b""
            assert board.deliver(b"secret 0.0 6 0\nlate") == _board.NOT_WRITTEN
            assert board.collect("secret 0.0 0") == _board.ENDED
        # A rank that ends before it connects ends its stream at once.
        board.finished("secret", "1.0")
        assert board.collect("secret 1.0 10") == _board.ENDED
        assert board.deliver(b"secret 1.0 0 0\nlost") == _board.NOT_WRITTEN


# ------------------------------------------------------------------ live ranks
# async def fn, readiness, channels and collective calls on Ray ranks: their
# frames travel through the group's board (``aiospawn.ray._relay``).


@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_async_fn_result_and_error(cluster: LocalCluster, rank_loop: str) -> None:
    backend = backend_for(cluster)
    with tripwire(60, "async Ray ranks returning"):
        assert await aiospawn.spawn(
            ray_ranks.async_square, args=(False,), nprocs=2, backend=backend, rank_loop=rank_loop
        ) == [0, 1]
        with pytest.raises(ProcessRaisedException, match="async shard 1 failed") as caught:
            await aiospawn.spawn(
                ray_ranks.async_square, args=(True,), nprocs=2, backend=backend, rank_loop=rank_loop
            )
    assert caught.value.error_index == 1
    assert isinstance(caught.value.__cause__ or caught.value, Exception)


async def test_ready_payloads_and_channel_round_trips(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, placement="SPREAD")
    with tripwire(60, "a channel round trip with Ray ranks"):
        async with aiospawn.open_group(ray_ranks.echo, nprocs=2, backend=backend) as ctx:
            payloads = await ctx.wait_ready()
            assert [payload["rank"] for payload in payloads] == [0, 1]
            assert [payload["pid"] for payload in payloads] == ctx.pids()
            assert all(rank.ready for rank in ctx.statistics().ranks)
            for rank in (0, 1):
                channel = ctx.channel(rank)
                assert await channel.receive() == ("hello", rank)
                big = bytes(range(256)) * 4096 * 3  # 3 MiB: several chunks and pipe-fulls
                for message in ("ping", big, {"n": rank}):
                    await channel.send(message)
                for message in ("ping", big, {"n": rank}):
                    assert await channel.receive() == (rank, message)
                # What users send: arrays whose pickles carry out-of-band
                # buffers, at 64 KiB and past the local backend's sharing size.
                arrays = [
                    numpy.arange(8192, dtype=numpy.float64) + rank,  # 64 KiB
                    numpy.asfortranarray(numpy.arange(24576, dtype=numpy.int32).reshape(128, 192)),
                    numpy.asfortranarray(numpy.ones((512, 768), dtype=numpy.float32)) * rank,
                ]
                for array in arrays:
                    await channel.send(array)
                for array in arrays:
                    got_rank, got = await channel.receive()
                    assert got_rank == rank
                    numpy.testing.assert_array_equal(got, array)
                    assert got.dtype == array.dtype
                    assert got.flags.f_contiguous == array.flags.f_contiguous
        # The block closed the channels: each rank's loop ended and it returned.
    assert ctx.results == ["closed", "closed"]


async def test_rank_dying_with_a_receive_pending(cluster: LocalCluster) -> None:
    ctx = await aiospawn.start_processes(
        ray_ranks.echo, nprocs=1, join=False, backend=backend_for(cluster)
    )
    try:
        with tripwire(60, "a receive pending on a Ray rank that dies"):
            await ctx.wait_ready()
            channel = ctx.channel(0)
            assert await channel.receive() == ("hello", 0)

            async def kill_soon() -> None:
                await anyio.wait_all_tasks_blocked()
                await channel.send("die")

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_soon)
                with pytest.raises(ProcessExitedException) as caught:
                    await channel.receive()
            assert caught.value.exit_code == -signal.SIGKILL
            with pytest.raises(ProcessExitedException):
                await channel.send("too late")
    finally:
        await ctx.terminate()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_sigterm_cancels_an_async_rank_after_a_round_trip(
    cluster: LocalCluster, rank_loop: str
) -> None:
    ctx = await aiospawn.start_processes(
        ray_ranks.async_echo,
        nprocs=1,
        join=False,
        backend=backend_for(cluster),
        rank_loop=rank_loop,
    )
    try:
        with tripwire(60, "an async Ray rank's round trip and SIGTERM"):
            assert await ctx.wait_ready() == [0]
            channel = ctx.channel(0)
            await channel.send("ping")
            assert await channel.receive() == (0, "ping")
            await ctx.terminate(grace_period=20)
            # Its cleanup ran: its last message came before its end.
            assert await channel.receive() == "cleaned up"
            with pytest.raises(aiospawn.ProcessException) as caught:
                await channel.receive()
    finally:
        await ctx.terminate()
    assert caught.value.exit_code == -signal.SIGTERM


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_back_pressure_and_aclose(cluster: LocalCluster) -> None:
    ctx = await aiospawn.start_processes(
        ray_ranks.unread_or_closed, nprocs=2, join=False, backend=backend_for(cluster)
    )
    try:
        with tripwire(60, "back-pressure and aclose on Ray ranks"):
            await ctx.wait_ready()
            sent = 0
            # Rank 0 reads nothing: the socket pair, the board's pipe and one
            # chunk in flight fill up, and send() waits (bounded buffering).
            with anyio.move_on_after(3):
                while True:
                    await ctx.channel(0).send(bytes(256 * 1024))
                    sent += 1
            assert 0 < sent < 64, f"{sent} messages of 256 KiB went to a rank that reads nothing"
            await ctx.channel(1).aclose()
            with pytest.raises(ProcessRaisedException, match="EOFError, then BrokenPipeError"):
                await ctx.join()
    finally:
        await ctx.terminate()


async def test_collective_calls(cluster: LocalCluster) -> None:
    backend = backend_for(cluster, placement="SPREAD")
    with tripwire(60, "collective calls on Ray ranks"):
        async with aiospawn.open_group(
            ray_ranks.serve_shard, nprocs=2, backend=backend, wait_ready=True
        ) as ctx:
            assert await ctx.call("scale", 3) == [(0, 0), (1, 3)]
            assert await ctx.call("scale", x=2, ranks=[1]) == [(1, 2)]
            with pytest.raises(ValueError, match="shard 1 cannot") as caught:
                await ctx.call("fail_on", 1)
            assert any("rank 1" in note for note in caught.value.__notes__)
            with pytest.raises(TimeoutError, match=r"rank\(s\) 0 did not answer"):
                await ctx.call("stall", 0, 2.0, timeout=0.5)
            # The late answer is dropped, never taken for the next call's.
            assert await ctx.call("scale", 5) == [(0, 0), (1, 5)]
    assert ctx.results == [0, 0]
    with (
        tripwire(60, "a collective call on a dying Ray rank"),
        pytest.raises(ProcessExitedException) as died,
    ):
        async with aiospawn.open_group(
            ray_ranks.serve_shard, nprocs=2, backend=backend, wait_ready=True
        ) as ctx:
            await ctx.call("die", 1)
    assert died.value.error_index == 1
    assert died.value.exit_code == -signal.SIGKILL


async def test_a_restarted_rank_gets_a_new_channel(cluster: LocalCluster) -> None:
    policy = aiospawn.RestartPolicy(max_restarts=1, backoff=aiospawn.Backoff(initial=0))
    with tripwire(60, "a restarted Ray rank's channel"):
        async with aiospawn.open_group(
            ray_ranks.restarted_inbox, nprocs=1, backend=backend_for(cluster), restart=policy
        ) as ctx:
            assert await ctx.wait_ready() == [0]
            old = ctx.channel(0)
            await old.send("for attempt 0")
            with contextlib.suppress(aiospawn.ProcessException):
                await old.send("also for attempt 0")
            with pytest.raises(ProcessRaisedException, match="first message"):
                await old.receive()
            assert await ctx.wait_ready() == [1]
            fresh = ctx.channel(0)
            assert fresh is not old
            await fresh.send("for attempt 1")
    assert ctx.results == [["for attempt 1"]]


async def test_a_rank_failing_before_it_is_ready_fails_wait_ready(cluster: LocalCluster) -> None:
    ctx = await aiospawn.start_processes(
        ray_ranks.fail_before_ready, args=(1,), nprocs=2, join=False, backend=backend_for(cluster)
    )
    try:
        with tripwire(60, "wait_ready() on a Ray rank that failed before it was ready"):
            with pytest.raises(ProcessRaisedException, match="rank 1 failed before") as caught:
                await ctx.wait_ready()
            assert ctx.statistics().alive == 0  # the group was shut down first
    finally:
        await ctx.terminate()
    assert caught.value.error_index == 1


async def test_wait_ready_counts_a_restarted_rank_once_its_new_attempt_is_ready(
    cluster: LocalCluster,
) -> None:
    policy = aiospawn.RestartPolicy(max_restarts=1, backoff=aiospawn.Backoff(initial=0))
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    (inner,) = listener.listeners
    assert isinstance(inner, anyio.abc.SocketListener)
    with tripwire(60, "wait_ready() across a Ray rank's restart"):
        async with (
            listener,
            aiospawn.open_group(
                ray_ranks.ready_again_when_told,
                args=(inner.extra(anyio.abc.SocketAttribute.local_port),),
                nprocs=1,
                backend=backend_for(cluster),
                restart=policy,
            ) as ctx,
        ):
            assert await ctx.wait_ready() == [0]
            # The rank may take the message and fail before the board tells
            # this send() its frame was written: then send() raises its failure.
            with contextlib.suppress(aiospawn.ProcessException):
                await ctx.channel(0).send("fail now")
            # Attempt 1 runs and is held before its ready(): attempt 0's
            # readiness must not count for it.
            async with await inner.accept() as attempt_1:
                assert await attempt_1.receive() == b"0\n"
                assert [rank.ready for rank in ctx.statistics().ranks] == [False]
                with pytest.raises(TimeoutError, match="0"):
                    await ctx.wait_ready(timeout=1)
                await attempt_1.send(b"!")
                assert await ctx.wait_ready() == [1]
            assert [rank.restarts for rank in ctx.statistics().ranks] == [1]
    assert ctx.results == [1]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_100_mb_message_goes_both_ways(cluster: LocalCluster) -> None:
    """100 MB to the rank and back through the board: 5 to 10 s on the machine it was written on."""
    payload = os.urandom(100 << 20)
    with tripwire(60, "a 100 MB echo through a Ray rank"):
        async with aiospawn.open_group(
            ray_ranks.echo, nprocs=1, backend=backend_for(cluster)
        ) as ctx:
            channel = ctx.channel(0)
            assert await channel.receive() == ("hello", 0)
            await channel.send(payload)
            rank, echoed = await channel.receive()
            assert rank == 0
            assert echoed == payload


def deadlines(seed: int, count: int) -> list[float]:
    """Tiny random deadlines, some zero (cancelled at the first checkpoint), some none.

    Up to 20 ms, ten times the local tests' longest, and a third without a
    deadline (``math.inf``): a message through the board takes about a
    millisecond, a call to two ranks several, and how many fit in a tiny
    deadline varies too much from run to run to be sure some complete.
    """
    rng = random.Random(seed)
    return [rng.choice([0.0, rng.uniform(0, 0.02), math.inf]) for _ in range(count)]


STORM = 50


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_send_storm_loses_and_duplicates_nothing(cluster: LocalCluster) -> None:
    with tripwire(60, "a send storm to a Ray rank"):
        async with aiospawn.open_group(
            ray_ranks.echo, nprocs=1, backend=backend_for(cluster)
        ) as ctx:
            channel = ctx.channel(0)
            assert await channel.receive() == ("hello", 0)
            # Up to 600 kB: a send often waits for the board, then is cancelled.
            completed, _ = await send_storm(
                channel, deadlines(1, STORM), lambda seq: seq % 5 * 150_000
            )
    assert len(completed) < STORM, "no send was cancelled: the storm tested nothing"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_receive_storm_loses_and_duplicates_nothing(cluster: LocalCluster) -> None:
    received = []
    cancelled = 0
    with tripwire(60, "a receive storm from a Ray rank"):
        async with aiospawn.open_group(
            ray_ranks.send_sized, args=(STORM,), nprocs=1, backend=backend_for(cluster)
        ) as ctx:
            channel = ctx.channel(0)
            rng = random.Random(2)
            while True:
                with anyio.move_on_after(rng.choice([0.0, rng.uniform(0, 0.02)])) as scope:
                    try:
                        seq, payload = await channel.receive()
                    except anyio.EndOfStream:
                        break
                    assert payload == ray_ranks.sized(seq)
                    received.append(seq)
                cancelled += scope.cancelled_caught
    assert received == list(range(STORM))
    assert cancelled, "no receive was cancelled: the storm tested nothing"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_call_storm_never_answers_a_call_with_another_calls_reply(
    cluster: LocalCluster,
) -> None:
    answered = [0, 0]
    with tripwire(60, "a call storm on Ray ranks"):
        async with aiospawn.open_group(
            ray_ranks.serve_shard, nprocs=2, backend=backend_for(cluster), wait_ready=True
        ) as ctx:

            async def storm(caller: int) -> None:
                # Two callers at once, each its own numbers: a reply to the wrong
                # call shows as a wrong sum.
                base = caller * 1_000_000
                for seq, deadline in enumerate(deadlines(3 + caller, STORM)):
                    with anyio.move_on_after(deadline):
                        if seq % 2:
                            answer = await ctx.call("add", base + seq, b=1)
                        else:  # ended by the call's own timeout instead
                            try:
                                answer = await ctx.call(
                                    "add", base + seq, b=1, timeout=min(deadline, 60)
                                )
                            except TimeoutError:
                                continue
                        assert answer == [(0, base + seq + 1), (1, base + seq + 1)]
                        answered[caller] += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(storm, 0)
                tg.start_soon(storm, 1)
            assert await ctx.call("add", -1) == [(0, -1), (1, -1)]
    assert ctx.results == [0, 0]
    assert all(answered), f"every call was cancelled, {answered}: the storm tested nothing"
    assert sum(answered) < 2 * STORM, "no call was cancelled: the storm tested nothing"


@pytest.mark.parametrize("rank_loop", ["asyncio", "trio"])
async def test_an_async_rank_serves_with_async_handler_methods(
    cluster: LocalCluster, rank_loop: str
) -> None:
    with tripwire(60, "an async Ray rank serving async handler methods"):
        async with aiospawn.open_group(
            ray_ranks.serve_shard_async,
            nprocs=2,
            backend=backend_for(cluster),
            rank_loop=rank_loop,
            wait_ready=True,
        ) as ctx:
            assert await ctx.call("add", 3, b=4) == [(0, 7), (1, 7)]
            assert await ctx.call("whoami", ranks=[1]) == [1]
            with pytest.raises(ValueError, match="async shard 0 cannot") as caught:
                await ctx.call("fail_on", 0)
            assert any("rank 0" in note for note in caught.value.__notes__)
            # The handler's error did not end serving.
            assert await ctx.call("add", 1) == [(0, 1), (1, 1)]
    assert ctx.results == ["served", "served"]


# ------------------------------------------------------- the board on the node
# A rank's channel is a Unix socket to the board on its node, which the
# supervisor calls directly (``aiospawn.ray._relay``).

#: Sizes of the payloads echoed both ways: one piece, an out-of-band array past
#: Ray's 100 KiB inline limit (the object store carries it), and one of several
#: pieces of ``_relay.CHUNK`` (4 MiB), more than the window holds at once.
ECHO_SIZES = (64, 256 * 1024, 3 * 1024 * 1024 + 8, 12 * 1024 * 1024 + 24)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_numpy_and_torch_payloads_of_every_size_go_both_ways(cluster: LocalCluster) -> None:
    torch = pytest.importorskip("torch", reason="the torch cases need torch==2.13.0")
    payloads: list[Any] = []
    for size in ECHO_SIZES:
        payloads.append(numpy.arange(size // 8, dtype=numpy.float64))
        payloads.append(numpy.asfortranarray(numpy.arange(size // 4, dtype=numpy.int32)))
        payloads.append(torch.arange(size // 4, dtype=torch.float32))
        payloads.append({"mixed": [numpy.ones(size // 8), bytes(size // 2)]})
    with tripwire(120, "numpy and torch payloads through a Ray rank's board"):
        async with aiospawn.open_group(
            ray_ranks.echo, nprocs=1, backend=backend_for(cluster)
        ) as ctx:
            channel = ctx.channel(0)
            assert await channel.receive() == ("hello", 0)
            # All sent before any is received: the pieces of several messages
            # are in flight at once, and must reach the rank in order.
            async with anyio.create_task_group() as tg:

                async def send_all() -> None:
                    for payload in payloads:
                        await channel.send(payload)

                tg.start_soon(send_all)
                for sent in payloads:
                    rank, echoed = await channel.receive()
                    assert rank == 0
                    if isinstance(sent, dict):
                        numpy.testing.assert_array_equal(echoed["mixed"][0], sent["mixed"][0])
                        assert echoed["mixed"][1] == sent["mixed"][1]
                    elif isinstance(sent, numpy.ndarray):
                        numpy.testing.assert_array_equal(echoed, sent)
                        assert echoed.flags.f_contiguous == sent.flags.f_contiguous
                    else:
                        assert torch.equal(echoed, sent)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_ray_rank_returns_memoryviews(cluster: LocalCluster) -> None:
    # Ray's ranks encode their result as local ranks do: a view they received
    # (Ray sends buffers in-band, so a view arrives as a view, not as a
    # mapping) and views of their own come back as views; a view of a format
    # no receiver could rebuild fails the rank, saying why.
    large = memoryview(bytes(range(256)) * (8 * 1024))
    with tripwire(120, "memoryviews returned by a Ray rank"):
        async with aiospawn.open_group(
            shm_ranks.return_views, nprocs=1, backend=backend_for(cluster)
        ) as ctx:
            await ctx.channel(0).send(large)
            assert await ctx.join()
            [[received, own, grid]] = ctx.results
    assert isinstance(received, memoryview)
    assert received.tobytes() == large.tobytes()
    assert received.readonly  # as sent: the flag is kept both ways
    assert own.tobytes() == b"own" * 10
    assert (grid.format, grid.shape, grid.tolist()) == ("i", (2, 3), [[0, 1, 2], [3, 4, 5]])
    with (
        tripwire(120, "a record view returned by a Ray rank"),
        pytest.raises(ProcessRaisedException) as failed,
    ):
        await aiospawn.start_processes(
            shm_ranks.return_record_view, nprocs=1, backend=backend_for(cluster)
        )
    assert "cannot pickle a memoryview of format" in str(failed.value)


async def test_a_receive_cancelled_on_a_ray_rank_loses_nothing(cluster: LocalCluster) -> None:
    with tripwire(60, "a cancelled receive on a Ray rank"):
        async with aiospawn.open_group(
            ray_ranks.echo, nprocs=1, backend=backend_for(cluster)
        ) as ctx:
            channel = ctx.channel(0)
            assert await channel.receive() == ("hello", 0)
            for message in ("first", "second"):
                # A receive waiting on the board's long poll, cancelled: the
                # poll stays, and what it brings waits for the next receive.
                with anyio.CancelScope() as scope:

                    async def cancel_soon(scope: anyio.CancelScope = scope) -> None:
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(cancel_soon)
                        await channel.receive()
                assert scope.cancelled_caught
                await channel.send(message)
                assert await channel.receive() == (0, message)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_rank_killed_mid_round_trip_fails_both_ends(cluster: LocalCluster) -> None:
    ctx = await aiospawn.start_processes(
        ray_ranks.echo, nprocs=1, join=False, backend=backend_for(cluster)
    )
    try:
        with tripwire(60, "a round trip with a Ray rank killed mid-way"):
            await ctx.wait_ready()
            channel = ctx.channel(0)
            assert await channel.receive() == ("hello", 0)
            (pid,) = ctx.pids()
            # The rank echoes a message of several pieces; it is killed (by
            # nobody the supervisor knows of) while the pieces are on their
            # way and the supervisor waits for the echo.
            failures: list[BaseException] = []

            async def send_big() -> None:
                try:
                    for _ in range(4):
                        await channel.send(bytes(12 * 1024 * 1024))
                except aiospawn.ProcessException as exc:
                    failures.append(exc)

            async def receive_to_the_end() -> None:
                while True:
                    await channel.receive()

            await channel.send("ping")
            assert await channel.receive() == (0, "ping")
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_big)
                # The first echo is back: the next messages' pieces are on their way.
                assert await channel.receive() == (0, bytes(12 * 1024 * 1024))
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(ProcessExitedException) as caught:
                    await receive_to_the_end()
            assert caught.value.exit_code == -signal.SIGKILL
            assert all(isinstance(exc, ProcessExitedException) for exc in failures)
            with pytest.raises(ProcessExitedException):
                await channel.send("too late")
    finally:
        await ctx.terminate()
    assert_gone([pid])
