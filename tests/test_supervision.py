"""Supervision: restart policies, hang detection with stacks, lifecycle events, torchrun env."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from contextlib import aclosing
from typing import Any

import anyio
import pytest

import aiospawn
from aiospawn._core._events import EventLog
from tests import env_probe_module, ranks, slow_import_module, supervision_ranks
from tests.helpers import Events, drain, receive, tripwire

pytestmark = pytest.mark.anyio

FAST = aiospawn.Backoff(initial=0.0)


def per_rank(events: list[aiospawn.Event], rank: int) -> list[str]:
    """The kinds of ``events`` that concern ``rank``, in order."""
    return [
        type(event).__name__
        for event in events
        if isinstance(event, aiospawn.RankEvent) and event.rank == rank
    ]


async def collect(ctx: aiospawn.AsyncProcessContext[Any]) -> list[aiospawn.Event]:
    return [event async for event in ctx.events()]


# Restarts


async def test_one_for_all_restarts_the_group_until_it_succeeds() -> None:
    policy = aiospawn.RestartPolicy(max_restarts=3, backoff=FAST)
    ctx = await aiospawn.start_processes(
        supervision_ranks.fail_first_runs, (1, 2), nprocs=2, join=False, restart=policy
    )
    with tripwire(60, "a group restarted twice"):
        assert await ctx.join() is True
    # Both ranks were started three times, and each knows it.
    assert ctx.results == [(0, 2, "2"), (1, 2, "2")]
    stats = ctx.statistics()
    assert stats.restarts == 2
    assert [rank.restarts for rank in stats.ranks] == [2, 2]
    assert [rank.state for rank in stats.ranks] == ["exited", "exited"]
    events = await collect(ctx)
    restarting = [event for event in events if isinstance(event, aiospawn.Restarting)]
    assert sorted((event.rank, event.attempt) for event in restarting) == [
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
    ]


async def test_restarts_beyond_the_intensity_give_up_with_the_history() -> None:
    policy = aiospawn.RestartPolicy(max_restarts=2, window=60, backoff=FAST)
    with (
        tripwire(60, "a group that gives up"),
        pytest.raises(aiospawn.ProcessRaisedException) as caught,
    ):
        await aiospawn.start_processes(
            supervision_ranks.always_fail, nprocs=1, restart=policy, start_method="fork"
        )
    error = caught.value
    assert isinstance(error.__cause__, ValueError)
    assert [record.restart for record in error.restarts] == [0, 1, 2]
    assert {(record.rank, record.outcome) for record in error.restarts} == {(0, "raised")}
    assert all(record.exit_code == 1 for record in error.restarts)
    times = [record.time for record in error.restarts]
    assert times == sorted(times)
    assert any("restart policy gave up" in note for note in error.__notes__)
    assert pickle.loads(pickle.dumps(error)).restarts == error.restarts


async def test_one_for_one_restarts_the_failed_rank_and_keeps_the_others(events: Events) -> None:
    reader, writer = events
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=FAST)
    with tripwire(60, "a one_for_one restart"):
        async with aiospawn.open_group(
            supervision_ranks.run_until_stopped_unless_failing,
            (1, writer),
            nprocs=2,
            restart=policy,
            start_method="fork",
        ) as ctx:
            first = {}
            for _ in range(3):  # both first runs, then rank 1 again
                rank, restart, pid = await receive(reader, "report")
                first.setdefault((rank, restart), pid)
            assert set(first) == {(0, 0), (1, 0), (1, 1)}
            assert ctx.pids() == [first[0, 0], first[1, 1]]
            assert ctx.statistics().ranks[0].restarts == 0
            await ctx.terminate(grace_period=5)
    assert ctx.results == [None, None]  # both stopped by the block's own terminate()


async def test_cancelling_during_the_backoff_leaves_nothing_running() -> None:
    policy = aiospawn.RestartPolicy(backoff=aiospawn.Backoff(initial=60))
    ctx = await aiospawn.start_processes(
        supervision_ranks.always_fail, nprocs=2, join=False, restart=policy, start_method="fork"
    )
    seen: list[aiospawn.Event] = []
    with tripwire(30, "cancelling a backoff"):
        async with anyio.create_task_group() as tg, aclosing(ctx.events()) as events:
            tg.start_soon(ctx.join)
            async for event in events:
                seen.append(event)
                if isinstance(event, aiospawn.Restarting):
                    tg.cancel_scope.cancel()
                    break
    assert ctx.statistics().alive == 0
    assert not any(isinstance(event, aiospawn.Started) and event.restart > 0 for event in seen)
    # Every rank ends with Stopped: the restart it waited for will not come.
    events = await collect(ctx)
    for rank in range(2):
        assert per_rank(events, rank)[-1] == "Stopped"
    with pytest.raises(aiospawn.ProcessException):
        await ctx.join()  # the shutdown after the cancellation is the group's end


async def test_cancelling_while_a_restart_starts_ranks_leaves_nothing_running() -> None:
    # No backoff: the cancellation lands while the new spawn ranks start.
    policy = aiospawn.RestartPolicy(backoff=FAST)
    ctx = await aiospawn.start_processes(
        supervision_ranks.always_fail, nprocs=2, join=False, restart=policy
    )
    with tripwire(30, "cancelling a restart"):
        async with anyio.create_task_group() as tg, aclosing(ctx.events()) as events:
            tg.start_soon(ctx.join)
            async for event in events:
                if isinstance(event, aiospawn.Restarting):
                    tg.cancel_scope.cancel()
                    break
    stats = ctx.statistics()
    assert stats.alive == 0
    assert [rank.state for rank in stats.ranks] == ["exited", "exited"]


async def test_terminate_during_a_backoff_ends_the_output_and_events() -> None:
    policy = aiospawn.RestartPolicy(backoff=aiospawn.Backoff(initial=60))
    ctx = await aiospawn.start_processes(
        supervision_ranks.print_then_fail,
        nprocs=1,
        join=False,
        restart=policy,
        stdout="capture",  # spawn: a fork rank would print into pytest's own capture
    )
    with tripwire(30, "output and events after a dropped restart"):
        async with anyio.create_task_group() as tg, aclosing(ctx.events()) as events:
            tg.start_soon(ctx.join)
            async for event in events:
                if isinstance(event, aiospawn.Restarting):
                    tg.cancel_scope.cancel()
                    break
        await ctx.terminate()
        lines = [line.line async for line in ctx.output()]
        kinds = per_rank(await collect(ctx), 0)
    assert lines == ["rank 0 run 0"]
    assert kinds[-1] == "Stopped"


async def test_on_any_restarts_ranks_that_return() -> None:
    policy = aiospawn.RestartPolicy(max_restarts=2, backoff=FAST, on="any")
    ctx = await aiospawn.start_processes(
        supervision_ranks.return_quickly, nprocs=1, join=False, restart=policy, start_method="fork"
    )
    with (
        tripwire(30, "a rank restarted after each return"),
        pytest.raises(aiospawn.ProcessExitedException, match="exit code 0") as caught,
    ):
        await ctx.join()
    assert [record.outcome for record in caught.value.restarts] == ["returned"] * 3


# Hang detection


@pytest.mark.parametrize("how", ["busy", "sleep"])
async def test_a_hung_rank_is_reported_with_its_stack(how: str) -> None:
    with tripwire(60, "hang detection"), pytest.raises(aiospawn.ProcessHungException) as caught:
        await aiospawn.start_processes(
            supervision_ranks.beat_then,
            (how,),
            nprocs=2,
            heartbeat_timeout=1,
            grace_period=1,
            start_method="fork",
        )
    error = caught.value
    assert error.seconds >= 1
    assert error.stack is not None
    assert "in beat_then" in error.stack
    if how == "busy":
        assert "in wait_for_peer_in_a_busy_loop" in error.stack
    assert "_die_with_supervisor" not in error.stack  # our guard thread is left out
    assert "run_rank" not in error.stack  # and so is the bootstrap
    assert "run_fn" not in error.stack  # and the rule that calls fn
    assert error.stack.rstrip().splitlines()[-1].endswith(" in beat_then")  # fn's is the last
    assert error.stack in str(error)
    assert "sent no heartbeat" in str(error)


async def test_a_rank_blocking_every_signal_is_killed_and_reported_without_a_stack() -> None:
    ctx = await aiospawn.start_processes(
        supervision_ranks.beat_then,
        ("blocked",),
        nprocs=1,
        join=False,
        heartbeat_timeout=0.5,
        grace_period=0.2,
    )
    with (
        tripwire(60, "a hung rank that blocks signals"),
        pytest.raises(aiospawn.ProcessHungException) as caught,
    ):
        await ctx.join()
    assert caught.value.stack is None
    assert "no stack could be taken" in str(caught.value)
    events = await collect(ctx)
    assert per_rank(events, 0) == [
        "Started",
        "Hung",
        "Terminating",
        "Terminating",
        "Exited",
        "Stopped",
    ]
    terminating = [event for event in events if isinstance(event, aiospawn.Terminating)]
    assert [event.signal_name for event in terminating] == ["SIGTERM", "SIGKILL"]
    exited = next(event for event in events if isinstance(event, aiospawn.Exited))
    assert exited.signal_name == "SIGKILL"
    assert exited.stopped_by_us


async def test_a_hung_rank_gets_sigterm_without_waiting_for_the_grace_period() -> None:
    # The grace wait after a failure is for the others to exit by themselves;
    # a hung rank will not, so it is stopped at once (and honours SIGTERM).
    with (
        tripwire(20, "a hung rank waiting out grace_period=60"),
        pytest.raises(aiospawn.ProcessHungException),
    ):
        await aiospawn.start_processes(
            supervision_ranks.beat_then,
            ("sleep",),
            nprocs=1,
            heartbeat_timeout=0.5,
            grace_period=60,
            start_method="fork",
        )


async def test_a_failure_the_policy_absorbs_is_logged_with_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = aiospawn.RestartPolicy(backoff=FAST)
    await aiospawn.start_processes(
        supervision_ranks.fail_first_runs, (0, 1), nprocs=1, restart=policy, start_method="fork"
    )
    [message] = [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
    assert message.startswith("Rank 0 (pid ")
    assert "failed (raised); restarting the group in 0 s (restart 1 of at most 3" in message
    assert "ValueError: rank 0 fails in run 0" in message


async def test_a_rank_that_never_beats_is_hung_after_the_startup_timeout() -> None:
    with tripwire(60, "startup timeout"), pytest.raises(aiospawn.ProcessHungException) as caught:
        await aiospawn.start_processes(
            supervision_ranks.never_beat,
            nprocs=1,
            startup_timeout=0.5,
            grace_period=0.5,
            start_method="fork",
        )
    assert "no first heartbeat" in str(caught.value)
    assert "startup_timeout=0.5" in str(caught.value)


async def test_a_rank_that_never_beats_without_a_startup_timeout_is_not_hung() -> None:
    results = await aiospawn.start_processes(
        supervision_ranks.beat_and_return, (0,), nprocs=2, heartbeat_timeout=0.2
    )
    assert results == [0, 1]


async def test_a_hung_rank_is_restarted_by_the_policy() -> None:
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=FAST)
    ctx = await aiospawn.start_processes(
        supervision_ranks.hang_in_first_run,
        nprocs=1,
        join=False,
        heartbeat_timeout=0.5,
        grace_period=0.5,
        restart=policy,
        start_method="fork",
    )
    with tripwire(60, "restarting a hung rank"):
        assert await ctx.join() is True
    assert ctx.results == [1]
    kinds = per_rank(await collect(ctx), 0)
    assert kinds == [
        "Started",
        "Hung",
        "Terminating",
        "Exited",
        "Restarting",
        "Started",
        "Exited",
        "Stopped",
    ]


async def test_a_rank_still_importing_is_not_sent_the_stack_signal() -> None:
    # fn's module takes 1 s to import (spawn); the startup timeout is shorter,
    # so the rank is found hung before it can answer: the stack request would
    # have ended it with SIGRTMIN+3. It is stopped by our SIGTERM instead.
    ctx = await aiospawn.start_processes(
        slow_import_module.payload_size, (b"",), nprocs=1, join=False, startup_timeout=0.3
    )
    with (
        tripwire(30, "a hung rank still importing"),
        pytest.raises(aiospawn.ProcessHungException, match="had not finished importing") as caught,
    ):
        await ctx.join()
    assert caught.value.stack is None
    exited = [event for event in await collect(ctx) if isinstance(event, aiospawn.Exited)]
    assert [(event.signal_name, event.stopped_by_us) for event in exited] == [("SIGTERM", True)]


async def test_join_timeouts_while_a_stack_is_taken_still_find_the_hang() -> None:
    ctx = await aiospawn.start_processes(
        supervision_ranks.beat_then,
        ("blocked",),
        nprocs=1,
        join=False,
        heartbeat_timeout=0.5,
        grace_period=0.2,
        start_method="fork",
    )
    with tripwire(30, "join(timeout) polls of a hung rank"):
        while True:
            try:
                if await ctx.join(timeout=0.3):  # shorter than the 1 s stack wait
                    pytest.fail("a hung rank's group returned")
            except aiospawn.ProcessHungException:
                break


async def test_hang_detection_stops_during_a_shutdown(events: Events) -> None:
    # The rank takes 1 s to act on SIGTERM and beats no more meanwhile: a rank
    # we are stopping is never reported hung.
    reader, writer = events
    ctx = await aiospawn.start_processes(
        supervision_ranks.beat_until_sigterm,
        (writer,),
        nprocs=1,
        join=False,
        heartbeat_timeout=0.3,
        start_method="fork",
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(ctx.join)
        await receive(reader, "first heartbeat")
        with tripwire(30, "terminate() of a slow rank"):
            await ctx.terminate(grace_period=10)
    assert await ctx.join() is True  # it exited with 0 after our SIGTERM
    kinds = per_rank(await collect(ctx), 0)
    assert "Hung" not in kinds


async def test_terminate_during_a_backoff_ends_a_waiting_join() -> None:
    policy = aiospawn.RestartPolicy(backoff=aiospawn.Backoff(initial=60))
    ctx = await aiospawn.start_processes(
        supervision_ranks.always_fail, nprocs=1, join=False, restart=policy, start_method="fork"
    )
    outcome: list[BaseException] = []

    async def join() -> None:
        try:
            await ctx.join()
        except aiospawn.ProcessException as exc:
            outcome.append(exc)

    with tripwire(20, "a join() waiting out a dropped backoff"):
        async with anyio.create_task_group() as tg, aclosing(ctx.events()) as events:
            tg.start_soon(join)
            async for event in events:
                if isinstance(event, aiospawn.Restarting):
                    await ctx.terminate()
                    break
    [error] = outcome
    assert isinstance(error, aiospawn.ProcessRaisedException)
    assert isinstance(error.__cause__, ValueError)


async def test_a_restart_that_cannot_start_raises_the_failure_it_answered() -> None:
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=FAST)
    ctx = await aiospawn.start_processes(
        supervision_ranks.fail_first_runs,
        (0, 1),
        nprocs=1,
        join=False,
        restart=policy,
        env=supervision_ranks.EnvOnce(),
        start_method="fork",
    )
    with tripwire(30, "a failed restart"):
        with pytest.raises(aiospawn.ProcessRaisedException) as first:
            await ctx.join()
        with pytest.raises(aiospawn.ProcessRaisedException) as second:
            await ctx.join()
    assert str(first.value) == str(second.value)
    assert isinstance(first.value.__cause__, ValueError)
    assert any("could not restart after it" in note for note in first.value.__notes__)


def test_env_reaches_a_spawn_rank_that_finds_aiospawn_only_on_a_runtime_path() -> None:
    # Without site-packages (python -S) aiospawn and anyio are found through
    # sys.path entries the program adds itself; the rank learns them only
    # after it has unpickled its environment.
    import anyio as anyio_module

    paths = [
        os.path.dirname(os.path.dirname(aiospawn.__file__)),
        os.path.dirname(os.path.dirname(anyio_module.__file__)),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ]
    program = (
        "import sys\n"
        f"sys.path[:0] = {paths!r}\n"
        "import anyio, aiospawn\n"
        "from tests import env_probe_module\n"
        "async def main():\n"
        "    print(await aiospawn.start_processes(env_probe_module.probe_at_import,"
        " env={'AIOSPAWN_PROBE': 'set'}))\n"
        "if __name__ == '__main__':\n"
        "    anyio.run(main)\n"
    )
    with tempfile.TemporaryDirectory() as directory:
        script = os.path.join(directory, "runtime_path.py")
        with open(script, "w") as file:
            file.write(program)
        result = subprocess.run(
            [sys.executable, "-S", script], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['set']"


# Events and statistics


async def test_events_of_a_failing_group_in_order() -> None:
    ctx = await aiospawn.start_processes(
        ranks.raise_in, (1,), nprocs=2, join=False, start_method="fork"
    )
    with pytest.raises(aiospawn.ProcessRaisedException):
        await ctx.join()
    events = await collect(ctx)
    assert per_rank(events, 1) == ["Started", "Exited", "Stopped"]
    assert per_rank(events, 0) == ["Started", "Terminating", "Exited", "Stopped"]
    started = [event for event in events if isinstance(event, aiospawn.Started)]
    assert [event.pid for event in started] == ctx.pids()
    failed = next(e for e in events if isinstance(e, aiospawn.Exited) and e.rank == 1)
    assert (failed.outcome, failed.exit_code, failed.stopped_by_us) == ("raised", 1, False)
    times = [event.time for event in events]
    assert times == sorted(times)
    assert all(event.wall_time > 1e9 for event in events)


async def test_several_consumers_each_see_every_event() -> None:
    ctx = await aiospawn.start_processes(
        supervision_ranks.return_quickly, nprocs=2, join=False, start_method="fork"
    )
    seen: list[list[str]] = [[], []]

    async def consume(into: list[str]) -> None:
        async for event in ctx.events():
            into.append(type(event).__name__)

    with tripwire(30, "two consumers"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, seen[0])
            tg.start_soon(consume, seen[1])
            assert await ctx.join() is True
    assert seen[0] == seen[1]
    assert sorted(seen[0]) == sorted(["Started", "Exited", "Stopped"] * 2)


async def test_a_consumer_that_falls_behind_is_told_what_it_lost() -> None:
    log = EventLog(size=3)
    for rank in range(5):
        log.append(aiospawn.Stopped(rank=rank, pid=None))
    log.close()
    events = [event async for event in log.follow()]
    assert isinstance(events[0], aiospawn.EventsLost)
    assert events[0].count == 2
    assert [event.rank for event in events[1:]] == [2, 3, 4]  # type: ignore[attr-defined]


async def test_statistics_of_a_running_group() -> None:
    ctx = await aiospawn.start_processes(
        supervision_ranks.never_beat, nprocs=2, join=False, start_method="fork"
    )
    stats = ctx.statistics()
    assert stats.alive == 2
    assert [rank.state for rank in stats.ranks] == ["running", "running"]
    assert [rank.pid for rank in stats.ranks] == ctx.pids()
    assert all(rank.last_exit is None for rank in stats.ranks)
    await ctx.terminate(grace_period=5)
    stats = ctx.statistics()
    assert stats.alive == 0
    assert [rank.last_exit.signal_name for rank in stats.ranks if rank.last_exit] == [
        "SIGTERM",
        "SIGTERM",
    ]


# The environment


async def test_torchrun_env_is_set_as_torchrun_sets_it() -> None:
    with tripwire(60, "torchrun env"):
        results = await aiospawn.start_processes(
            supervision_ranks.torchrun_variables, nprocs=2, torchrun_env=True
        )
    assert [env["RANK"] for env in results] == ["0", "1"]
    assert [env["LOCAL_RANK"] for env in results] == ["0", "1"]
    for env in results:
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["AIOSPAWN_RESTART_COUNT"] == "0"
    # One rendezvous port for the group, free: rank 0 could listen on it.
    assert results[0]["MASTER_PORT"] == results[1]["MASTER_PORT"]


async def test_each_group_restart_gets_a_fresh_master_port(events: Events) -> None:
    reader, writer = events
    policy = aiospawn.RestartPolicy(backoff=FAST)
    results = await aiospawn.start_processes(
        supervision_ranks.port_after_first_run,
        (writer,),
        nprocs=2,
        torchrun_env=True,
        restart=policy,
        start_method="fork",
    )
    # Rank 0 reported its first run's port before it failed.
    first_port = next(port for restart, port in drain(reader) if restart == 0)
    assert results[0] == results[1]  # one port for the group's second run
    port, restart = results[0].split("/")
    assert restart == "1"
    assert port != first_port


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_env_is_set_before_a_rank_imports_the_function_module(start_method: str) -> None:
    results = await aiospawn.start_processes(
        env_probe_module.probe_at_import,
        nprocs=2,
        env=lambda rank: {"AIOSPAWN_PROBE": f"rank {rank}"},
        start_method=start_method,
    )
    assert results == ["rank 0", "rank 1"]


# Outside a group, and bad options


def test_heartbeat_and_restart_count_outside_a_rank() -> None:
    aiospawn.heartbeat()  # a no-op here
    assert aiospawn.restart_count() == 0


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: aiospawn.RestartPolicy(max_restarts=-1), ValueError),
        (lambda: aiospawn.RestartPolicy(window=0), ValueError),
        (lambda: aiospawn.RestartPolicy(strategy="rest_for_one"), ValueError),  # type: ignore[arg-type]
        (lambda: aiospawn.RestartPolicy(on="success"), ValueError),  # type: ignore[arg-type]
        (lambda: aiospawn.Backoff(factor=0.5), ValueError),
        (lambda: aiospawn.Backoff(initial=-1), ValueError),
        (lambda: aiospawn.RestartPolicy(backoff=2.0), TypeError),  # type: ignore[arg-type]
    ],
)
def test_bad_policies_are_refused(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        make()


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"heartbeat_timeout": -1}, ValueError),
        ({"startup_timeout": "1"}, ValueError),
        ({"restart": 3}, TypeError),
    ],
)
async def test_bad_supervision_options_are_refused_before_anything_starts(
    options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        await aiospawn.start_processes(supervision_ranks.return_quickly, nprocs=1, **options)
