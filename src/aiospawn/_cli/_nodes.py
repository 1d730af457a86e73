"""torchrun's multi-node command line: which rendezvous to join, checked before anything starts.

torchrun runs the same command line on every node of a job, in one of two
forms (both also readable from ``PET_*`` variables, as Kubeflow's PyTorchJob
sets them)::

    static:  --nnodes=N --node-rank=K --master-addr=HOST --master-port=PORT
    c10d:    --nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=JOB

:func:`read_nodes` turns such a line into a :class:`Nodes`, or ``None`` when
it describes one machine (``--nnodes 1``, ``--standalone``), which the rest of
the launcher runs as it always has; on one machine, :func:`refuse_other_machines`
refuses the rendezvous values that name another, and :func:`one_machine_port`
says what ``MASTER_PORT`` the ones it takes ask for. What is refused, and where that differs
from torchrun, is listed in ``docs/cli-torchrun.md``. Joining the rendezvous
is :mod:`._rendezvous`'s work; this module imports nothing of torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

from ._parse import UsageError
from ._values import count, nprocs

__all__ = ["C10D_PORT", "STATIC_PORT", "Nodes", "read_nodes"]

#: torchrun's default --master-port, the static rendezvous's store.
STATIC_PORT = 29500

#: Hosts that name this machine, for torchrun's --master-addr and --rdzv-endpoint.
LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")

#: torch's default port of a c10d --rdzv-endpoint given without one.
C10D_PORT = 29400

#: torchrun's rendezvous timeout when --rdzv-conf names none (seconds).
RENDEZVOUS_TIMEOUT = "900"

#: The options torchrun also reads from ``PET_<DEST>`` when the command line
#: leaves them out: option dest here, torchrun's dest, and the value's reader.
PET_OPTIONS: tuple[tuple[str, str, object], ...] = (
    ("nnodes", "NNODES", str),
    ("nprocs", "NPROC_PER_NODE", nprocs),
    ("node_rank", "NODE_RANK", str),
    ("master_addr", "MASTER_ADDR", str),
    ("master_port", "MASTER_PORT", str),
    ("rdzv_backend", "RDZV_BACKEND", str),
    ("rdzv_endpoint", "RDZV_ENDPOINT", str),
    ("run_id", "RDZV_ID", str),
    ("rdzv_conf", "RDZV_CONF", str),
    ("local_addr", "LOCAL_ADDR", str),
    ("max_restarts", "MAX_RESTARTS", count),
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Nodes:
    """A rendezvous of several nodes, as torchrun's command line describes it."""

    #: ``static`` (fixed nodes, each with its --node-rank) or ``c10d`` (torch's
    #: dynamic rendezvous, ranks assigned as nodes join).
    backend: str
    #: ``HOST:PORT`` of the rendezvous's store.
    endpoint: str
    #: The job's id, the same on every node (TORCHELASTIC_RUN_ID).
    run_id: str
    min_nodes: int
    max_nodes: int
    #: This node's rank, for the static rendezvous; the c10d one assigns it.
    node_rank: int | None
    #: Configuration handed to torch's rendezvous handler (--rdzv-conf, and
    #: for static the node's rank).
    config: dict[str, str | int]
    #: New rounds after a failure, on every node.
    max_restarts: int
    local_addr: str | None

    def describe(self) -> str:
        """One line naming the rendezvous, for the launcher's notes."""
        size = (
            str(self.max_nodes)
            if self.min_nodes == self.max_nodes
            else f"{self.min_nodes}:{self.max_nodes}"
        )
        node = f", node {self.node_rank}" if self.node_rank is not None else ""
        return (
            f"{self.backend} rendezvous at {self.endpoint} ({size} nodes{node}, id {self.run_id!r})"
        )


def read_pet_environment(options: argparse.Namespace) -> None:
    """Fill in the options the command line left out from torchrun's ``PET_*`` variables.

    As torchrun's: a flag given on the command line wins over its variable.

    Raises:
        UsageError: A variable's value is not one the flag takes.
    """
    for dest, name, reader in PET_OPTIONS:
        text = os.environ.get(f"PET_{name}")
        if getattr(options, dest) is not None or not text:
            continue
        try:
            value = reader(text)  # type: ignore[operator]
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"PET_{name} {exc}") from None
        setattr(options, dest, value)
    if not options.standalone and os.environ.get("PET_STANDALONE", "0") not in ("", "0"):
        options.standalone = True
    if options.nprocs is None:
        options.nprocs = 1
    if options.max_restarts is None:
        options.max_restarts = 0


def node_counts(text: str) -> tuple[int, int]:
    """``--nnodes``: ``N``, or ``MIN:MAX``, with ``0 < MIN <= MAX``."""
    parts = text.split(":")
    try:
        if len(parts) > 2:
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise UsageError(f"--nnodes wants N or MIN:MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise UsageError(f"--nnodes {text}: wants 0 < MIN <= MAX")
    return low, high


def read_nodes(options: argparse.Namespace) -> Nodes | None:
    """The rendezvous the command line asks to join, or None for one machine.

    ``options`` must have been through :func:`read_pet_environment`.

    Raises:
        UsageError: The flags contradict each other, name a rendezvous we do
            not join, or torch is not installed; nothing has started.
    """
    if options.master_port is not None:  # on one machine too: it is MASTER_PORT there
        check_port("--master-port", options.master_port)
    low, high = node_counts(options.nnodes) if options.nnodes is not None else (1, 1)
    if options.standalone:
        if high > 1:
            raise UsageError(
                f"--standalone with --nnodes {options.nnodes}: a standalone rendezvous is one"
                " node's; for several give --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
            )
        return None
    if high == 1:
        return None
    if options.ray is not None:
        raise UsageError(
            f"--nnodes {options.nnodes} with --ray: Ray places the ranks on its nodes itself;"
            " give -n with the total number of ranks"
        )
    backend = options.rdzv_backend or "static"
    if backend not in ("static", "c10d"):
        raise UsageError(
            f"--rdzv-backend {backend}: aiospawn joins torch's static and c10d rendezvous;"
            " use c10d (etcd's backends are deprecated in torch too)"
        )
    for flag, value in (
        ("--restart-strategy", options.restart_strategy),
        ("--restart-window", options.restart_window),
        ("--restart-backoff", options.restart_backoff),
    ):
        if value is not None:
            raise UsageError(
                f"{flag} with --nnodes {options.nnodes}: across nodes a restart is a new"
                " rendezvous round on every node, as torchrun's; only --max-restarts applies"
            )
    try:
        config: dict[str, str | int] = dict(_rendezvous_config(options.rdzv_conf or ""))
    except ValueError as exc:
        raise UsageError(f"--rdzv-conf {options.rdzv_conf!r}: {exc}") from None
    config.setdefault("timeout", RENDEZVOUS_TIMEOUT)
    node_rank: int | None = None
    if backend == "static":
        if low != high:
            raise UsageError(
                f"--nnodes {options.nnodes} with the static rendezvous: its node count is"
                " fixed (torchrun would wait for MAX nodes); give --nnodes N, or use"
                " --rdzv-backend c10d for MIN:MAX"
            )
        text = options.node_rank if options.node_rank is not None else "0"
        if not text.isdigit() or int(text) >= high:
            raise UsageError(
                f"--node-rank {text}: wants a number from 0 to {high - 1} (--nnodes {high})"
            )
        node_rank = int(text)
        config["rank"] = node_rank  # torch's static handler compares it with 0
        endpoint = options.rdzv_endpoint or (
            f"{options.master_addr or '127.0.0.1'}:{options.master_port or STATIC_PORT}"
        )
        if not endpoint_port(endpoint):
            raise UsageError(f"--rdzv-endpoint {endpoint}: the static rendezvous wants HOST:PORT")
    else:
        if not options.rdzv_endpoint:
            raise UsageError(
                "--rdzv-backend c10d wants --rdzv-endpoint HOST:PORT, the same on every node"
            )
        endpoint = options.rdzv_endpoint
        if endpoint_port(endpoint) is None:
            endpoint = f"{endpoint}:{C10D_PORT}"
    if importlib.util.find_spec("torch") is None:
        raise UsageError(
            f"--nnodes {options.nnodes}: joining torchrun's rendezvous needs torch, which is"
            " not installed here (pip install torch)"
        )
    return Nodes(
        backend=backend,
        endpoint=endpoint,
        run_id=options.run_id or "none",  # torchrun's default id
        min_nodes=low,
        max_nodes=high,
        node_rank=node_rank,
        config=config,
        max_restarts=options.max_restarts,
        local_addr=options.local_addr,
    )


def one_machine_port(options: argparse.Namespace) -> int | None:
    """``MASTER_PORT`` on one machine: ``--master-port``, else a static ``--rdzv-endpoint``'s.

    As torchrun's: the static rendezvous's endpoint stands for
    ``--master-addr``/``--master-port``. None: a free port, fresh for each start.
    """
    if options.master_port is not None:
        return int(options.master_port)
    if options.rdzv_endpoint is not None and options.rdzv_backend in (None, "static"):
        return endpoint_port(options.rdzv_endpoint) or None  # 0: any free port
    return None


def refuse_other_machines(options: argparse.Namespace) -> None:
    """On one machine: refuse rendezvous values that name another machine."""
    elsewhere = (
        "with one node (--nnodes 1) aiospawn run starts every rank itself, on this machine"
        " or, with --ray ADDRESS, on a Ray cluster: there is no rendezvous to join"
    )
    if options.node_rank is not None and options.node_rank != "0":
        raise UsageError(f"--node-rank {options.node_rank}: {elsewhere}")
    if options.rdzv_backend is not None and options.rdzv_backend not in ("static", "c10d"):
        raise UsageError(f"--rdzv-backend {options.rdzv_backend}: {elsewhere}")
    if options.rdzv_endpoint is not None:
        host = options.rdzv_endpoint.rpartition(":")[0] or options.rdzv_endpoint
        if host.strip("[]") not in LOCAL_HOSTS:
            raise UsageError(f"--rdzv-endpoint {options.rdzv_endpoint}: {elsewhere}")
        endpoint_port(options.rdzv_endpoint)  # refuses a port out of range
    if options.master_addr is not None and options.master_addr not in LOCAL_HOSTS:
        raise UsageError(
            f"--master-addr {options.master_addr}: the ranks of one machine meet on"
            " 127.0.0.1; on Ray, MASTER_ADDR is rank 0's node"
        )
    for flag, value in (
        ("--rdzv-conf", options.rdzv_conf),
        ("--local-addr", options.local_addr),
    ):
        if value is not None:
            raise UsageError(f"{flag} {value}: {elsewhere}")


def ignored_flags(options: argparse.Namespace, nodes: Nodes) -> list[str]:
    """The flags this rendezvous does not use, which torchrun ignores with a warning too."""
    if nodes.backend == "static":
        return []
    ignored = []
    if options.node_rank is not None and options.node_rank != "0":
        ignored.append(f"--node-rank {options.node_rank}")
    if options.master_addr is not None:
        ignored.append(f"--master-addr {options.master_addr}")
    if options.master_port is not None:
        ignored.append(f"--master-port {options.master_port}")
    return ignored


def check_port(flag: str, text: str, lowest: int = 1) -> int:
    """``text`` as a port number from ``lowest`` (1: one every rank can reach) to 65535.

    Raises:
        UsageError: It is not one.
    """
    if not text.isdigit() or not lowest <= int(text) < 65536:
        raise UsageError(f"{flag} wants a port number from {lowest} to 65535, got {text!r}")
    return int(text)


def endpoint_port(endpoint: str) -> int | None:
    """The port of ``HOST:PORT`` (``[::1]:PORT`` for IPv6), or None without one.

    Port 0 is one: a c10d store on one machine then picks a free port
    (torchrun's ``--standalone`` asks for ``localhost:0``).

    Raises:
        UsageError: The port is out of range.
    """
    host, colon, port = endpoint.rpartition(":")
    if not colon or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
        return None
    if not host or (":" in host and not host.startswith("[")):
        return None  # an IPv6 address without brackets, or no host
    return check_port(f"--rdzv-endpoint {endpoint}:", port, lowest=0)


def _rendezvous_config(text: str) -> dict[str, str]:
    """``--rdzv-conf``: ``KEY=VALUE,...``, each with a value (torch's format)."""
    config: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            raise ValueError("wants KEY=VALUE,KEY=VALUE, each with a value")
        config[key.strip()] = value.strip()
    return config
