"""torch's rendezvous, joined by the launcher: this node's place in a round, and the round's end.

Only the multi-node path imports this module, and only it imports torch. Each
round of a job goes::

    Rendezvous.join(restart)  ── torch's handler: next_rendezvous() ──► node rank, node count, store
        │  each node writes its role and rank count under aiospawn/…/role/<node>;
        │  reading every node's gives the global ranks (as torchrun's agent assigns them)
        ▼
    Round ── environment(local_rank): torchrun's variables for that rank
          ── poll(): (from a worker thread) the round's end record, if any; this
          │          node's heartbeat; a node whose heartbeat stopped is lost
          ── end(record): the first record written wins (compare_set), on every node
          ── finish(): this node's ranks all succeeded; done once every node's did

The end record is JSON: ``{"kind": "failure"|"stop"|"lost", "node": K,
"host": ..., "rank": global rank, "local_rank": ..., "time": wall time,
"status": exit status, "error": torchrun's error-file content, ...}``.
All calls here block (they talk to the store): the caller runs them in a
worker thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._nodes import Nodes

__all__ = ["LOST_AFTER", "Rendezvous", "Round"]

#: A node whose heartbeat has not moved for this long is lost (seconds). Each
#: launcher beats on every poll (a few times a second), so this is only
#: reached when a launcher died or stopped answering.
LOST_AFTER = 10.0


class Rendezvous:
    """torch's rendezvous handler for the command line's rendezvous.

    Raises:
        ValueError: torch refused the rendezvous's parameters.
    """

    def __init__(self, nodes: Nodes, role: str) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

        self.nodes = nodes
        self.role = role
        parameters = RendezvousParameters(
            backend=nodes.backend,
            endpoint=nodes.endpoint,
            run_id=nodes.run_id,
            min_nodes=nodes.min_nodes,
            max_nodes=nodes.max_nodes,
            local_addr=nodes.local_addr,
            **nodes.config,
        )
        self._handler = registry.get_rendezvous_handler(parameters)
        self._worker_store: Any = None

    def join(self, restart: int, local_world_size: int) -> Round:
        """Join the next round (blocks until enough nodes have joined); return this node's place.

        Raises:
            RendezvousError: torch's, when the round cannot be made (a timeout,
                a closed rendezvous).
        """
        from torch.distributed.distributed_c10d import PrefixStore

        info = self._handler.next_rendezvous()
        # The static rendezvous hands out the same store every round: the
        # round's keys need the restart count. A c10d round's store is the
        # round's own, and a node that joins late has made fewer restarts.
        prefix = f"aiospawn/{restart}/" if self.nodes.backend == "static" else "aiospawn/"
        store = PrefixStore(prefix, info.store)
        node, nodes = int(info.rank), int(info.world_size)
        store.set(f"role/{node}", json.dumps([self.role, local_world_size]))
        # Blocks until every node of the round has written its own.
        written = store.multi_get([f"role/{n}" for n in range(nodes)])
        roles = [json.loads(value) for value in written]
        before = roles[:node]
        bootstrap = info.bootstrap_store_info
        if bootstrap is None:  # torch's static and c10d handlers always give one
            raise RuntimeError(f"torch's {self.nodes.backend} rendezvous named no master address")
        master_addr, master_port = str(bootstrap.master_addr), int(bootstrap.master_port)
        if restart:
            master_port = self._fresh_worker_store(store, node, restart)
        return Round(
            store=store,
            node=node,
            nodes=nodes,
            restart=restart,
            local_world_size=local_world_size,
            base_rank=sum(size for _, size in before),
            world_size=sum(size for _, size in roles),
            base_role_rank=sum(size for role, size in before if role == self.role),
            role_world_size=sum(size for role, size in roles if role == self.role),
            role=self.role,
            master_addr=master_addr,
            master_port=master_port,
            use_agent_store=bool(self._handler.use_agent_store),
            run_id=str(self._handler.get_run_id()),
            max_restarts=self.nodes.max_restarts,
        )

    def _fresh_worker_store(self, store: Any, node: int, restart: int) -> int:
        """A new store for the ranks of round ``restart``, on node 0; its port.

        With TORCHELASTIC_USE_AGENT_STORE the ranks use the launcher's store
        as it is, with no prefix per attempt (torch expects a new store for
        every retry): the last round's keys are still there, and a rank of
        this round could read a dead rank's address from them (measured: gloo's
        "Connection refused" in the second round). Node 0 serves a new one.
        """
        from datetime import timedelta

        from torch._C._distributed_c10d import TCPStore

        if node == 0:
            self._worker_store = TCPStore(
                host_name="0.0.0.0",  # every address: the other nodes' ranks connect to it
                port=0,
                is_master=True,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=timedelta(seconds=float(self.nodes.config.get("timeout", 900))),
            )
            store.set("worker_store_port", str(self._worker_store.port))
        return int(store.get("worker_store_port"))

    def close(self) -> None:
        """Tell the rendezvous this node leaves it for good, as torchrun's agent does at its end."""
        self._handler.shutdown()


@dataclasses.dataclass(kw_only=True)
class Round:
    """This node's place in one round of the rendezvous, and the round's shared records."""

    store: Any
    node: int
    nodes: int
    restart: int
    local_world_size: int
    base_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int
    role: str
    master_addr: str
    master_port: int
    use_agent_store: bool
    run_id: str
    max_restarts: int
    #: Each node's last heartbeat count seen, and when it last moved (monotonic).
    _beats: dict[int, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def environment(self, local_rank: int) -> dict[str, str]:
        """torchrun's variables for local rank ``local_rank`` of this node in this round."""
        return {
            "RANK": str(self.base_rank + local_rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(self.node),
            "ROLE_RANK": str(self.base_role_rank + local_rank),
            "ROLE_NAME": self.role,
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "WORLD_SIZE": str(self.world_size),
            "GROUP_WORLD_SIZE": str(self.nodes),
            "ROLE_WORLD_SIZE": str(self.role_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(self.use_agent_store),
            # As torchrun: the launcher's own value, else on.
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
        }

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An end record of this node's."""
        return {
            "kind": kind,
            "node": self.node,
            "host": socket.gethostname(),
            "time": time.time(),
            **fields,
        }

    def end(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write ``record`` as the round's end unless another came first; return the first."""
        first = self.store.compare_set("end", "", json.dumps(record))
        return dict(json.loads(first))

    def poll(self) -> dict[str, Any] | None:
        """Beat, and return the round's end record if there is one; a lost node's if one is lost.

        A store that cannot be reached is an end too: the node that held it is gone.
        """
        try:
            self.store.add(f"beat/{self.node}", 1)
            if self.store.check(["end"]):
                return dict(json.loads(self.store.get("end")))
            now = time.monotonic()
            for node in range(self.nodes):
                if node == self.node:
                    continue
                count = int(self.store.add(f"beat/{node}", 0))
                last = self._beats.get(node)
                if last is None or last[0] != count:
                    self._beats[node] = (count, now)
                elif now - last[1] > LOST_AFTER:
                    first = self.end(
                        self.record("lost", lost=node, why=f"no heartbeat for {LOST_AFTER:g} s")
                    )
                    if first.get("kind") == "lost" and first.get("node") == self.node:
                        # The lost node will never count itself as leaving
                        # (leave()): count it once, here, where its loss was
                        # recorded, so that the others do not wait for it.
                        self.store.add("left", 1)
                    return first
        except (RuntimeError, OSError, ValueError) as exc:  # torch's DistError is a RuntimeError
            return {
                "kind": "lost",
                "node": None,
                "lost": None,
                "why": f"the rendezvous store stopped answering ({type(exc).__name__}: {exc})",
                "time": time.time(),
            }
        return None

    def error(self, timeout: float) -> dict[str, Any] | None:
        """The failed node's error-file content, which it writes once its ranks are stopped."""
        from datetime import timedelta

        try:
            self.store.wait(["error"], timedelta(seconds=timeout))
            return dict(json.loads(self.store.get("error")))
        except (RuntimeError, OSError, ValueError):  # not in time, or the store is gone
            return None

    def finish(self) -> None:
        """Count this node's ranks as done; the last node to do so says every node's are."""
        if int(self.store.add("done", 1)) >= self.nodes:
            self.store.set("done/all", "1")

    def done_or_end(self, timeout: float) -> dict[str, Any] | None:
        """Wait up to ``timeout`` s for every node's ranks to be done; the end record if one came.

        Returns ``{"kind": "done"}`` when every node's ranks succeeded, an end
        record, or None when neither came in time.
        """
        from datetime import timedelta

        ending = self.poll()
        if ending is not None:
            return ending
        try:
            self.store.wait(["done/all"], timedelta(seconds=timeout))
        except RuntimeError:  # not yet (torch's DistStoreError)
            return None
        return {"kind": "done"}

    def leave(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until every node is leaving, then let this one go.

        The node that holds the store must outlive every other node's last
        call to it: the end record, the failed node's error, torch's own
        shutdown of the rendezvous. Once every node has counted itself here,
        no node calls the store again. A node that is gone is waited for no
        longer than ``timeout``.
        """
        from datetime import timedelta

        try:
            if int(self.store.add("left", 1)) >= self.nodes:
                self.store.set("left/all", "1")
            else:
                self.store.wait(["left/all"], timedelta(seconds=timeout))
        except RuntimeError:  # a node did not come, or the store is gone: leave anyway
            pass
