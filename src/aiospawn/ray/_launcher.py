"""A group's ranks as Ray actors: gang reservation, start, exit detection, stop.

The supervisor side of ``aiospawn.ray.RayBackend``; the cluster side is
``_actor`` (the ranks) and ``_board`` (a board per node). One group, from
the supervisor's point of view::

    open()   connect (once per process) ─► placement group, one bundle per rank,
             reserved all at once or not at all (placement_timeout) ─► layout:
             which node each rank runs on, local ranks, node ranks
             ─► a board on each node of the layout, and its socket
    start()  a board on each node of the layout that has none yet ─► one actor
             per rank, pinned to its bundle ─► describe() (pid, node) and rank
             0's free port ─► run(fn, rank, args, env, board's socket) submitted
    wait()   the run() result is the rank's sentinel (``_rank``), waited
             on through its future (``_bridge``), never a blocking ray.get
    stop     SIGTERM through the SignalBoard on the rank's node, with the
             group's token; SIGKILL is ray.kill
    aclose() kill every actor and every board, remove the placement group

Neither the boards nor the rank actors are named: Ray lists named actors to
every job on the cluster (``ray.util.list_named_actors``), and a name is all
``ray.get_actor`` needs. The launcher holds their handles, and the ranks get
their board's handle, socket and token in ``run()``.

A board sits on each node that runs ranks of the group (pinned there, no
CPU): a rank's channel is a Unix socket to it, so a message costs one actor
call from the supervisor to the board, and a hop on the node (``_relay``).
It is lost only with its node, whose ranks are lost with it. The placement group keeps a name,
which gives no way to reach the ranks.

Calls that talk to Ray's control service and may wait on it (creating the
placement group and actors, ``ray.put``, removal) run on worker threads.
Submitting an actor call or a kill only queues it (measured: 0.13 ms and
0.03 ms median), so those run on the event loop.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._core._backend import RankHandle, raise_start_error
from aiospawn._core._concurrency import run_to_completion
from aiospawn._core._env import rank_environment, torchrun_environment
from aiospawn._core._spec import LaunchSpec

from ._actor import RankActor
from ._board import CALLS_PER_RANK, SPARE_CALLS, SignalBoard
from ._bridge import get
from ._link import RayLink
from ._rank import RayRank

#: Serialises ``ray.init``: two groups opening at once must not both connect.
_connect_lock = threading.Lock()

#: The Ray actor classes, made once per process (each ``ray.remote`` call
#: would export the class to the cluster again).
_actor_classes: dict[type, Any] = {}


def _actor_class(cls: type) -> Any:
    import ray

    if cls not in _actor_classes:
        _actor_classes[cls] = ray.remote(cls)
    return _actor_classes[cls]


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a rank runs, fixed for the life of the placement group.

    Attributes:
        bundle: The placement group bundle the rank's actors are pinned to.
        node_id: Ray's id of the node holding the bundle.
        address: That node's address.
        local_rank: The rank's index among the group's ranks on that node.
        local_world_size: How many of the group's ranks run on that node.
        node_rank: The node's index among the group's nodes (rank 0's is 0).
        nodes: How many nodes the group spans.
    """

    bundle: int
    node_id: str
    address: str
    local_rank: int
    local_world_size: int
    node_rank: int
    nodes: int


def layout(bundle_nodes: Sequence[str], addresses: Mapping[str, str]) -> list[Slot]:
    """Give rank ``r`` the ``r``-th bundle once bundles are grouped by node.

    Nodes keep the order in which their first bundle appears, so bundle 0's
    node hosts rank 0, and each node's ranks are consecutive, as torchrun
    numbers them.
    """
    order: dict[str, list[int]] = {}
    for bundle, node in enumerate(bundle_nodes):
        order.setdefault(node, []).append(bundle)
    slots = []
    for node_rank, (node, bundles) in enumerate(order.items()):
        for local_rank, bundle in enumerate(bundles):
            slots.append(
                Slot(
                    bundle=bundle,
                    node_id=node,
                    address=addresses.get(node, "?"),
                    local_rank=local_rank,
                    local_world_size=len(bundles),
                    node_rank=node_rank,
                    nodes=len(order),
                )
            )
    return slots


def rank_resources(spec: LaunchSpec, resources_per_rank: Mapping[str, float]) -> dict[str, float]:
    """What each rank reserves: ``resources_per_rank``, with ``devices_per_rank`` as its GPUs.

    Raises:
        ValueError: Both name a number of GPUs, and the numbers differ.
    """
    resources = dict(resources_per_rank)
    per_rank = spec.devices_per_rank
    if per_rank is not None:
        if resources.get("GPU", per_rank) != per_rank:
            raise ValueError(
                f"devices_per_rank={per_rank} and resources_per_rank={resources!r} ask for"
                " different numbers of GPUs per rank; give one of them"
            )
        resources["GPU"] = per_rank
        if not per_rank:
            del resources["GPU"]  # a bundle may not hold a zero amount
    return resources


class RayLauncher:
    """Makes and starts the actors of one group (see ``_backend.GroupLauncher``)."""

    def __init__(self, spec: LaunchSpec, options: Any) -> None:
        import ray

        self._ray = ray
        self._spec = spec
        self._options = options
        self._name = f"aiospawn-{uuid.uuid4().hex[:12]}"
        self._token = secrets.token_hex(16)  # asked of every call to the board
        self._pg: Any = None
        #: The boards, by node id: (handle, socket address).
        self._boards: dict[str, tuple[Any, str]] = {}
        #: The board of each started attempt, by key ("rank.restart").
        self._board_of: dict[str, Any] = {}
        self._slots: list[Slot] = []
        self._actors: list[Any] = []  # every actor made, for aclose()
        self._master_port: int | None = None
        self._closed = False

    @property
    def ray(self) -> Any:
        """The ``ray`` module (imported when the launcher is made)."""
        return self._ray

    @property
    def slots(self) -> list[Slot]:
        """Where each rank runs, index = rank."""
        return self._slots

    @property
    def placement_group(self) -> Any:
        """The group's Ray placement group."""
        return self._pg

    @classmethod
    async def open(cls, spec: LaunchSpec, options: Any) -> RayLauncher:
        """Connect, reserve every rank's resources at once, and learn the layout."""
        await anyio.to_thread.run_sync(_connect, options.address)
        self = cls(spec, options)
        try:
            await self._reserve()
        except BaseException:
            await run_to_completion(self.aclose)
            raise
        return self

    async def _reserve(self) -> None:
        ray = self._ray
        options = self._options
        nprocs = self._spec.nprocs

        def create() -> None:
            self._pg = ray.util.placement_group(
                [rank_resources(self._spec, options.resources_per_rank) for _ in range(nprocs)],
                strategy=options.placement,
                name=self._name,
            )

        await anyio.to_thread.run_sync(create)
        await self._placed()
        await self._make_boards({slot.node_id for slot in self._slots})

    async def _make_boards(self, wanted: set[str]) -> None:
        """Start a board on each node of ``wanted`` that has none (together); learn its socket."""
        nodes = sorted(wanted - set(self._boards))
        if not nodes:
            return

        def create() -> dict[str, Any]:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            made = {}
            for node in nodes:
                made[node] = (
                    _actor_class(SignalBoard)
                    .options(
                        num_cpus=0,
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                        # A thread per call that may wait (see CALLS_PER_RANK).
                        max_concurrency=CALLS_PER_RANK * self._spec.nprocs + SPARE_CALLS,
                    )
                    .remote(self._token)
                )
                self._actors.append(made[node])
            return made

        made = await anyio.to_thread.run_sync(create)
        addresses: dict[str, str] = {}

        async def address(node: str) -> None:
            addresses[node] = await get(made[node].address.remote(self._token))

        async with anyio.create_task_group() as tg:
            for node in nodes:
                tg.start_soon(address, node)
        for node in nodes:
            self._boards[node] = (made[node], addresses[node])

    async def _placed(self) -> None:
        """Wait until every bundle is placed; learn where (see :func:`layout`)."""
        ray = self._ray
        options = self._options
        nprocs = self._spec.nprocs
        with anyio.move_on_after(options.placement_timeout) as scope:
            await get(self._pg.ready())
        if scope.cancelled_caught:
            available = await anyio.to_thread.run_sync(ray.available_resources)
            raise TimeoutError(
                f"Ray could not place {nprocs} ranks of {dict(options.resources_per_rank)!r}"
                f" each with placement={options.placement!r} within"
                f" placement_timeout={options.placement_timeout!r} s; the cluster has"
                f" {_summary(available)} available. Add nodes, ask for fewer resources"
                " per rank, or use a looser placement strategy"
            )
        self._slots = await anyio.to_thread.run_sync(self._learn_layout)

    def _learn_layout(self) -> list[Slot]:
        ray = self._ray
        table = ray.util.placement_group_table(self._pg)
        by_bundle = table["bundles_to_node_id"]
        bundle_nodes = [by_bundle[index] for index in range(self._spec.nprocs)]
        addresses = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        return layout(bundle_nodes, addresses)

    def make_rank(self, index: int, restart: int) -> RayRank:
        """Create, without starting, attempt number ``restart`` of rank ``index``."""
        link = RayLink(f"{index}.{restart}")
        return RayRank(index, restart, ray=self.ray, post=self.send, forget=self._forget, link=link)

    async def start(self, handles: Sequence[RankHandle]) -> None:
        """Start ``handles``, made by :meth:`make_rank`, together; return once each has ``fn``.

        Raises:
            Exception: The start error of the lowest failing rank, with a note.
        """
        # The protocol's parameter, so that RayBackend is a Backend to the type checker.
        ranks = [rank for rank in handles if isinstance(rank, RayRank)]
        assert len(ranks) == len(handles), "a Ray launcher starts the ranks it made"
        errors: dict[int, BaseException] = {}
        try:
            if self._master_port is None and len(ranks) == self._spec.nprocs and self._actors:
                # A whole-group restart: Ray re-places the bundles of a lost node
                # elsewhere, so the layout (and MASTER_ADDR) may have changed.
                await self._placed()
            await anyio.to_thread.run_sync(self._create_actors, ranks)
            wants_port = self._spec.torchrun_env and self._master_port is None
            first = next((rank for rank in ranks if rank.rank == 0), None)

            async def describe(rank: RayRank) -> None:
                try:
                    rank.described(await get(rank.actor.describe.remote()))
                except Exception as exc:
                    errors[rank.rank] = exc

            async def ask_port(rank: RayRank) -> None:
                try:
                    self._master_port = await get(rank.actor.free_port.remote())
                except Exception as exc:
                    errors[rank.rank] = exc

            async with anyio.create_task_group() as tg:
                for rank in ranks:
                    tg.start_soon(describe, rank)
                if wants_port and first is not None:
                    tg.start_soon(ask_port, first)
            if not errors:
                # Where each rank runs now: a rank restarted alone after its
                # node was lost runs where Ray placed its bundle again.
                nodes = {rank.node[0] for rank in ranks if rank.node is not None}
                await self._make_boards(nodes)
                work = await anyio.to_thread.run_sync(self._put_work)
                for rank in ranks:
                    env = self._environment(rank.rank, rank.restart)
                    assert rank.node is not None
                    board, address = self._boards[rank.node[0]]
                    self._board_of[f"{rank.rank}.{rank.restart}"] = board
                    rank.begin(work, env, board, address, self._token, self._spec.rank_loop)
        finally:
            unstarted = [rank.actor for rank in ranks if not rank.started]
            if unstarted:
                await run_to_completion(lambda: anyio.to_thread.run_sync(_kill, unstarted))
        raise_start_error(errors, len(ranks), " on Ray")

    def _put_work(self) -> Any:
        # Pickled here, unpickled by each rank after its environment is set.
        from ray import cloudpickle

        payload: bytes = cloudpickle.dumps((self._spec.fn, self._spec.args))  # type: ignore[no-untyped-call]
        return self._ray.put(payload)

    def _create_actors(self, ranks: Sequence[RayRank]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = rank_resources(self._spec, self._options.resources_per_rank)
        standard = {
            "num_cpus": resources.pop("CPU", 0),
            "num_gpus": resources.pop("GPU", 0),
        }
        if "memory" in resources:
            standard["memory"] = resources.pop("memory")
        actor_class = _actor_class(RankActor)
        runtime_env = self._options.runtime_env
        for rank in ranks:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg,
                placement_group_bundle_index=self._slots[rank.rank].bundle,
            )
            rank.actor = actor_class.options(
                **standard,
                resources=resources or None,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=strategy,
                runtime_env=None if runtime_env is None else dict(runtime_env),
            ).remote(rank.rank)
            self._actors.append(rank.actor)

    def _environment(self, index: int, restart: int) -> dict[str, str]:
        spec = self._spec
        torchrun = None
        if spec.torchrun_env:
            assert self._master_port is not None
            slot, master = self._slots[index], self._slots[0]
            torchrun = torchrun_environment(
                index,
                spec.nprocs,
                restart,
                self._master_port,
                master_addr=master.address,
                local_rank=slot.local_rank,
                local_world_size=slot.local_world_size,
                group_rank=slot.node_rank,
                group_world_size=slot.nodes,
            )
        return rank_environment(spec, index, restart, torchrun)

    def new_rendezvous(self) -> None:
        """Let the next whole-group start ask rank 0's node for a fresh ``MASTER_PORT``."""
        self._master_port = None

    def send(self, key: str, signum: int) -> None:
        """Post ``signum`` for the rank attempt ``key`` on its board (does not wait)."""
        self._board_of[key].send.remote(self._token, key, signum)

    def _forget(self, key: str) -> None:
        """Let the board drop what it holds for the ended attempt ``key`` (does not wait)."""
        board = self._board_of.pop(key, None)
        if not self._closed and board is not None:
            with contextlib.suppress(Exception):
                board.forget.remote(self._token, key)

    async def aclose(self) -> None:
        """Kill every actor and every board, and remove the placement group. Idempotent."""
        if self._closed:
            await checkpoint()
            return
        self._closed = True
        actors = list(self._actors)
        pg, self._pg = self._pg, None

        def release() -> None:
            _kill(actors)
            if pg is not None:
                with contextlib.suppress(Exception):
                    self._ray.util.remove_placement_group(pg)

        await run_to_completion(lambda: anyio.to_thread.run_sync(release))


def _kill(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        if actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)


def _connect(address: str) -> None:
    import ray

    with _connect_lock:
        if ray.is_initialized():
            return
        _init(ray, address)


def _init(ray: Any, address: str) -> None:
    try:
        _probe(address)
        ray.init(address=address)
    except ConnectionError as exc:
        raise ConnectionError(
            f"aiospawn found no running Ray cluster at address={address!r}. RayBackend"
            " connects to an existing cluster and never starts one: start it with"
            " `ray start --head` on the head machine and `ray start --address=HEAD:6379`"
            " on the others, then pass address='HEAD:6379' (or 'auto' on a cluster"
            " machine). For a one-machine trial, `ray start --head` is enough."
        ) from exc


def _probe(address: str) -> None:
    """Fail fast if nothing listens at a ``host:port`` address.

    Ray keeps retrying an unreachable control service for minutes before it
    gives up; a refused connection says at once that no cluster is there.
    """
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # "auto", or a Ray Client address: Ray finds out quickly itself
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise ConnectionError(f"cannot reach {address}: {exc}") from exc


def _summary(resources: Mapping[str, float]) -> str:
    shown = {
        key: value
        for key, value in resources.items()
        if not key.startswith("node:") and key != "object_store_memory"
    }
    return repr(shown) if shown else "nothing"
