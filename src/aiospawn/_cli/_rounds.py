"""The launcher as one node of several: rounds of torch's rendezvous, each a local group.

Each node's launcher runs the same loop; one round::

    join the rendezvous (a daemon thread) ──► this node's ranks, with torchrun's variables
        │                                      (the local group, supervised as on one machine)
        ├── watch (a task, from before the ranks start): every POLL s, in a daemon
        │   thread, read the round's end record and beat; another node's record (or
        │   a node whose beat stopped) stops the ranks here
        ├── a local rank fails ──► the group stops the others ──► write the failure as
        │   the round's end (the first written wins, on every node)
        ├── a signal here ──► write "stop" as the round's end, stop the ranks
        └── every rank here succeeded ──► count this node done; wait for every node
            (or an end record) before leaving, so the store's holder outlives the rest
    a failure or a lost node, restarts left ──► the next round on every node;
    else every node reports the round's first record and exits with its status.

From a record written on one node to the ranks of every other node being sent
SIGTERM takes at most ``POLL`` plus a store round trip; the ranks then have
the grace period. A launcher killed outright stops beating: the others end the
round after ``LOST_AFTER`` seconds (``_rendezvous``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import tempfile
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc

import aiospawn
from aiospawn._core._events import Exited
from aiospawn._core._shutdown import DEFAULT_GRACE_PERIOD

from ._errorfile import ERROR_FILE_VAR, root_cause_error, write_root_cause
from ._plan import error_file
from ._report import Run, report, say
from ._run import STOPPING, start_group

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ._plan import Plan
    from ._rendezvous import Rendezvous, Round

__all__ = ["POLL", "off_loop", "supervise_nodes"]

T = TypeVar("T")

#: How often each launcher reads the round's end record (seconds).
POLL = 0.2

#: How long a launcher gives torch's rendezvous to record that it left (seconds).
CLOSE_WAIT = 5.0

#: How long a node waits at the end for the others to be leaving too (seconds).
LEAVE_WAIT = 10.0

#: How long one wait for every node's ranks to be done lasts before the end
#: record is read again (seconds).
DONE_WAIT = 1.0

#: How long a node waits for the failed node's error (its error file's content).
ERROR_WAIT = 5.0


class _Node:
    """What one node's launcher knows of the job as it goes."""

    def __init__(self, plan: Plan) -> None:
        self.run = Run(plan)
        self.round: Round | None = None
        #: Cancelled by a signal: the rendezvous or the round under way.
        self.scope = anyio.CancelScope()
        self.stopped: int | None = None

    def phase(self) -> anyio.CancelScope:
        """A scope for the next step (a scope is entered once), cancelled if a signal came."""
        self.scope = anyio.CancelScope()
        if self.stopped is not None:
            self.scope.cancel()
        return self.scope

    async def stop(self, signum: int) -> None:
        """A signal here: stop this node's ranks, and tell every other node."""
        self.stopped = signum
        self.scope.cancel()
        current = self.round
        if current is not None:
            record = current.record("stop", signal=signum, status=128 + signum)
            with contextlib.suppress(RuntimeError, OSError):
                await off_loop(current.end, record)


async def supervise_nodes(plan: Plan) -> int:
    """Run this node's part of the job, round after round; return the exit status."""
    node = _Node(plan)
    run = node.run
    error_files = os.path.join(tempfile.gettempdir(), f"aiospawn-{secrets.token_hex(8)}")
    try:
        with anyio.open_signal_receiver(*plan.signals) as received:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_on_signals, received, node)
                status = await _rounds(plan, node, error_files)
                run.finished = True
                tasks.cancel_scope.cancel()
        return status
    finally:
        for rank in range(plan.nprocs):
            with contextlib.suppress(FileNotFoundError):
                os.remove(error_file(error_files, rank))


async def _rounds(plan: Plan, node: _Node, error_files: str) -> int:
    from ._rendezvous import Rendezvous

    assert plan.nodes is not None
    run = node.run
    for flag in plan.ignored:
        say(f"{flag}: not used by the {plan.nodes.backend} rendezvous (ignored, as torchrun does)")
    try:
        rendezvous: Rendezvous = await off_loop(Rendezvous, plan.nodes, plan.role)
    except (ValueError, RuntimeError) as exc:
        say(f"could not make the rendezvous ({plan.nodes.describe()}): {exc}")
        return 1
    try:
        restart = 0
        while True:
            if plan.verbose:
                say(f"joining round {restart} of the {plan.nodes.describe()}")
            with node.phase():
                try:
                    node.round = await off_loop(rendezvous.join, restart, plan.nprocs)
                except Exception as exc:  # torch's RendezvousError and the store's errors
                    say(f"could not join the {plan.nodes.describe()}: {exc}")
                    return 1
            if node.stopped is not None or node.round is None:
                return 128 + (node.stopped or signal.SIGINT)
            ending = await _round(plan, node, node.round, error_files)
            if (
                ending["kind"] in ("failure", "lost")
                and node.stopped is None
                and restart < plan.nodes.max_restarts
            ):
                restart += 1
                say(
                    f"{_first(ending)}; restarting every node's ranks"
                    f" ({restart} of {plan.nodes.max_restarts} restarts)"
                )
                node.round = None
                run.failure = None
                continue
            return _finish(plan, node, ending, error_files)
    finally:
        # Bounded: a store that is gone may not answer at all.
        with anyio.CancelScope(shield=True) as closing:
            closing.deadline = anyio.current_time() + CLOSE_WAIT + LEAVE_WAIT
            with contextlib.suppress(Exception):
                await off_loop(rendezvous.close)
            if node.round is not None:
                with contextlib.suppress(Exception):
                    await off_loop(node.round.leave, LEAVE_WAIT)


async def _round(plan: Plan, node: _Node, current: Round, error_files: str) -> dict[str, Any]:
    """Run this node's ranks for one round; return the round's end record (``done`` on success)."""
    run = node.run
    remote: dict[str, Any] = {}
    announced: dict[str, Any] = {}
    async with anyio.create_task_group() as tasks:
        ranks = node.phase()

        async def watch() -> None:
            # From before the ranks start: this node beats while they start
            # (a --preload template may take a while), and another node's
            # record stops them even part-way through their start.
            record = await _watch(current)
            remote.update(record)
            ranks.cancel()

        tasks.start_soon(watch)
        with ranks:
            run.base_rank = current.base_rank
            run.group = await start_group(plan, error_files, current.environment)
            group = run.group

            async def announce() -> None:
                # The first failure goes out as the rank's exit is seen, not
                # once the ranks here are stopped: the other nodes' ranks may
                # fail of it meanwhile (a peer gone from a collective), and the
                # first record written is the one every node reports.
                async with contextlib.aclosing(group.events()) as events:
                    async for event in events:
                        if isinstance(event, Exited) and _failed(event):
                            break
                    else:
                        return
                record = current.record(
                    "failure",
                    rank=current.base_rank + event.rank,
                    local_rank=event.rank,
                    status=_exit_status(event.exit_code),
                    time=event.wall_time,
                    summary=_exit_words(event),
                )
                with contextlib.suppress(RuntimeError, OSError):
                    announced.update(await off_loop(current.end, record))

            tasks.start_soon(announce)
            try:
                await group.join()
            except aiospawn.ProcessException as exc:
                run.failure = exc
        tasks.cancel_scope.cancel()
    if node.stopped is not None:
        # This node's signal: its record went out from stop(); the ranks are reaped.
        with contextlib.suppress(RuntimeError, OSError):
            first = await off_loop(current.end, current.record("stop", signal=node.stopped))
            if first.get("kind") != "stop" or first.get("node") != current.node:
                return first
        return {"kind": "stop", "node": current.node, "signal": node.stopped, "here": True}
    failure = run.failure
    mine = announced.get("node") == current.node and announced.get("kind") == "failure"
    if isinstance(failure, aiospawn.ProcessException) and (mine or not (remote or announced)):
        local = failure.error_index
        error = root_cause_error(failure, error_files)
        record = current.record(
            "failure",
            rank=current.base_rank + local,
            local_rank=local,
            status=_status(failure),
            summary=str(failure).strip().splitlines()[0] if str(failure).strip() else "",
        )
        try:
            first = announced if mine else await _end(current, record)
            if first.get("node") == current.node:
                await off_loop(current.store.set, "error", json.dumps(error))
        except (RuntimeError, OSError):
            first = record  # no store to tell: this failure is all we know
        if first.get("node") == current.node and first.get("kind") == "failure":
            first["here"] = True
        return first
    if announced or remote:
        first = announced or remote
        if first.get("kind") == "failure" and first.get("node") != current.node:
            first["error"] = await off_loop(current.error, ERROR_WAIT)
        return first
    # Every rank here succeeded: wait for the others, or another node's end.
    try:
        await off_loop(current.finish)
    except (RuntimeError, OSError):
        return {"kind": "done"}  # the store is gone: no one is left to wait for
    while True:
        ending = await off_loop(current.done_or_end, DONE_WAIT)
        if ending is not None:
            return ending


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Call ``fn(*args)``, which blocks on the rendezvous, in a daemon thread; return its result.

    Not in anyio's worker threads: the interpreter waits for those at exit, and
    a call to a store whose node is unreachable, or a rendezvous that never
    fills, blocks for torch's timeout (15 minutes by default). Cancelled, the
    wait ends at once and the thread is left to finish or die with the process.
    """
    reader, writer = socket.socketpair()
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller as it is
            box["error"] = exc
        finally:
            # MSG_NOSIGNAL: the caller may have gone (cancelled), and a SIGPIPE
            # would kill the launcher.
            with contextlib.suppress(OSError):
                writer.send(b"!", socket.MSG_NOSIGNAL)
            writer.close()

    try:
        threading.Thread(target=call, name="aiospawn rendezvous", daemon=True).start()
        await anyio.wait_readable(reader)
    finally:
        reader.close()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


async def _end(current: Round, record: dict[str, Any]) -> dict[str, Any]:
    return await off_loop(current.end, record)


def _failed(event: Exited) -> bool:
    return not event.stopped_by_us and event.exit_code != 0


def _exit_status(code: int) -> int:
    """The launcher's status for a rank's exit code: 128 + signal, the code, or 1."""
    return 128 - code if code < 0 else code if 0 < code < 256 else 1


def _exit_words(event: Exited) -> str:
    if event.signal_name is not None:
        return f"{event.signal_name} ({event.exit_code})"
    return f"exit code {event.exit_code}"


async def _watch(current: Round) -> dict[str, Any]:
    """Wait for the round's end record (another node's, or a lost node's)."""
    while True:
        record = await off_loop(current.poll)
        if record is not None:
            return record
        await anyio.sleep(POLL)


def _status(failure: aiospawn.ProcessException) -> int:
    if isinstance(failure, aiospawn.ProcessExitedException):
        return _exit_status(failure.exit_code)
    return 1


def _first(ending: dict[str, Any]) -> str:
    """The round's first record, in words."""
    where = f"node {ending.get('node')} ({ending.get('host', '?')})"
    if ending["kind"] == "failure":
        return (
            f"{where}, rank {ending.get('rank')} (local rank {ending.get('local_rank')}),"
            f" failed first: {ending.get('summary', '')}"
        )
    if ending["kind"] == "lost":
        if ending.get("lost") is None:
            return str(ending.get("why"))
        return f"node {ending.get('lost')} was lost ({ending.get('why')}), seen by {where}"
    name = signal.Signals(int(ending.get("signal", signal.SIGINT))).name
    return f"{where} was stopped by {name}"


def _finish(plan: Plan, node: _Node, ending: dict[str, Any], error_files: str) -> int:
    """Report the job's end as this node saw it; return the exit status."""
    run = node.run
    kind = ending["kind"]
    if kind == "done":
        return report(run)
    if ending.get("here"):
        if kind == "failure":
            say(_first(ending))
            write_root_cause(run.failure, error_files)
        if node.stopped is not None and not run.signals:
            run.signals.append(node.stopped)
        return report(run)
    say(f"{_first(ending)}; the ranks here were stopped")
    if kind == "failure":
        error = ending.get("error")
        target = os.environ.get(ERROR_FILE_VAR)
        if isinstance(error, dict):
            message = error.get("message")
            if isinstance(message, dict) and message.get("message"):
                say(f"the error on node {ending.get('node')}: {message['message']}")
        if target and isinstance(error, dict):
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
            with open(target, "w", encoding="utf-8") as file:
                json.dump(error, file)
        return int(ending.get("status", 1))
    if kind == "stop":
        return 128 + int(ending.get("signal", signal.SIGINT))
    return 1


async def _on_signals(received: AsyncIterator[signal.Signals], node: _Node) -> None:
    """Act on each signal received until the run ends; a signal passed on waits its grace here."""
    async with anyio.create_task_group() as passing_on:
        await _take_signals(received, node, passing_on)


async def _take_signals(
    received: AsyncIterator[signal.Signals], node: _Node, passing_on: anyio.abc.TaskGroup
) -> None:
    """The first signal stops the job on every node; a second SIGINT kills the ranks here now."""
    run = node.run
    async for signum in received:
        if run.finished:
            continue
        name = signal.Signals(signum).name
        if not run.signals:
            run.signals.append(signum)
            grace = run.plan.grace_period
            until = "30 s" if grace is None else f"{grace:g} s"
            if signum in STOPPING:
                say(
                    f"{name} received: stopping the ranks on every node (SIGTERM, then SIGKILL"
                    f" after {until}; Ctrl-C again kills the ranks here now)"
                )
                await node.stop(signum)
            else:
                say(
                    f"{name} received: sent on to the ranks here, which have {until} to exit"
                    " before the job stops on every node"
                )
                passing_on.start_soon(_pass_on, node, signum)
        elif signum == signal.SIGINT:
            say("SIGINT again: killing the ranks here now")
            if run.group is not None:
                await run.group.terminate(grace_period=0)


async def _pass_on(node: _Node, signum: int) -> None:
    """Send ``signum`` to this node's ranks; after the grace period, stop the job everywhere.

    As torchrun's agent does with a signal of ``--signals-to-handle`` (and the
    launcher on one machine): SLURM sends SIGUSR1 to every node's launcher
    ahead of a preemption, the ranks checkpoint on it, and each node stops
    its ranks once the grace period is over. A node whose ranks are still
    running then stops the others too, as a SIGTERM here would.
    """
    run = node.run
    if run.group is not None:
        run.group.send_signal(signum)
    grace = run.plan.grace_period
    await anyio.sleep(DEFAULT_GRACE_PERIOD if grace is None else grace)
    await node.stop(signum)
    if run.group is not None:
        await run.group.terminate(grace_period=0)  # the grace is spent: SIGKILL
