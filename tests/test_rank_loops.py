"""The event loop an ``async def fn`` runs on in its rank (``rank_loop=``), and what it costs.

An async rank runs on a loop of its own, whichever loop the supervisor runs
(the ``anyio_backend`` parameter); it imports that loop and nothing of the
supervisor's (invariant 7 on the architecture page); a sync rank imports no
event loop at all.
"""

from __future__ import annotations

import sys

import pytest

import aiospawn
from tests import loop_ranks
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("rank_loop", "fn", "expected"),
    [
        ("asyncio", loop_ranks.asyncio_loop_name, "asyncio.unix_events._UnixSelectorEventLoop"),
        ("uvloop", loop_ranks.asyncio_loop_name, "uvloop.Loop"),
        ("trio", loop_ranks.trio_run_name, "trio"),
    ],
)
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
async def test_an_async_rank_runs_on_the_loop_asked_for_and_imports_nothing_of_ours(
    anyio_backend: str, rank_loop: str, fn: object, expected: str, start_method: str
) -> None:
    with tripwire(60, f"an async rank on {rank_loop}"):
        results = await aiospawn.start_processes(  # type: ignore[call-overload]
            fn, nprocs=2, start_method=start_method, rank_loop=rank_loop
        )
    for loop, supervisor_modules in results:
        assert loop == expected
        if start_method == "spawn":  # a fork rank is a copy of the supervisor
            assert supervisor_modules == []


async def test_a_sync_rank_imports_no_event_loop(anyio_backend: str) -> None:
    with tripwire(60, "a sync rank's imports"):
        results = await aiospawn.start_processes(loop_ranks.sync_imports, nprocs=1)
    assert results == [(False, [])]


#: What of the rank side every ``spawn`` rank imports before ``fn``.
PLAIN_RANK = [
    "aiospawn._rank.api",
    "aiospawn._rank.bootstrap",
    "aiospawn._rank.buffers",
    "aiospawn._rank.channel",
    "aiospawn._rank.descendants",
    "aiospawn._rank.ending",
    "aiospawn._rank.fds",
    "aiospawn._rank.frames",
    "aiospawn._rank.guard",
    "aiospawn._rank.outcome",
    "aiospawn._rank.payload",
    "aiospawn._rank.process",
    "aiospawn._rank.reader",
    "aiospawn._rank.stream",
    "aiospawn._rank.tensors",
    "aiospawn._rank.views",
    "aiospawn._rank.wire",
]


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (loop_ranks.sync_rank_side, PLAIN_RANK),
        (loop_ranks.async_rank_side, sorted([*PLAIN_RANK, "aiospawn._rank.async_main"])),
    ],
)
async def test_a_spawn_rank_imports_only_the_rank_side_it_needs(
    anyio_backend: str, fn: object, expected: list[str]
) -> None:
    # Neither a fork rank's hygiene nor, in a sync rank, the async main; the
    # awaited channel only once an async rank asks for its channel.
    with tripwire(60, "a rank's imports of the rank side"):
        results = await aiospawn.start_processes(fn, nprocs=1)  # type: ignore[call-overload]
    assert results == [expected]


@pytest.mark.parametrize("fn", [loop_ranks.sync_rank_side, loop_ranks.async_rank_side])
async def test_a_fork_rank_imports_nothing_of_ours_itself(anyio_backend: str, fn: object) -> None:
    # A fork rank drops what it holds of the supervisor, and runs an async
    # def fn, with code the supervisor imported before the fork.
    with tripwire(60, "a fork rank's imports of the rank side"):
        [imported] = await aiospawn.start_processes(  # type: ignore[call-overload]
            fn, nprocs=1, start_method="fork"
        )
    assert {"aiospawn._rank.forked", "aiospawn._rank.async_main"} <= set(imported)
    assert set(imported) <= set(sys.modules)


@pytest.mark.parametrize("rank_loop", ["tornado", "", None, "Trio"])
async def test_an_unknown_rank_loop_is_refused_before_anything_starts(
    anyio_backend: str, rank_loop: object, no_process_start: None
) -> None:
    with pytest.raises(ValueError, match="rank_loop must be one of 'asyncio', 'trio', 'uvloop'"):
        await aiospawn.start_processes(  # type: ignore[call-overload]
            loop_ranks.sync_imports, nprocs=1, rank_loop=rank_loop
        )
