"""What ranks send back: decoded off the event loop, whatever the decoding runs.

A rank's value and exception are unpickled in the supervisor, and unpickling
runs code the rank chose (``result_ranks``). Whatever it raises, even
``SystemExit`` or ``KeyboardInterrupt``, is that rank's failure, raised by
``join()``; it never ends the supervisor's task or ``aiospawn.sync``'s loop
thread, and a slow unpickle never stalls the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import psutil
import pytest

import aiospawn
import aiospawn.sync as sync
from aiospawn import ProcessExitedException, ProcessRaisedException, RemoteTraceback
from tests import result_ranks
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _fresh_events() -> Iterator[None]:
    result_ranks.unpickling.clear()
    result_ranks.release.clear()
    yield
    result_ranks.release.set()  # never leave a decoding thread waiting


@pytest.mark.parametrize(
    ("fn", "raised"),
    [
        (result_ranks.return_exiting_value, SystemExit),
        (result_ranks.return_interrupting_value, KeyboardInterrupt),
    ],
)
async def test_a_value_whose_unpickling_raises_a_base_exception_is_the_ranks_failure(
    anyio_backend: str, fn: object, raised: type[BaseException]
) -> None:
    with (
        tripwire(60, "join() of a group whose value cannot be unpickled"),
        pytest.raises(ProcessRaisedException) as info,
    ):
        await aiospawn.start_processes(fn, nprocs=2, start_method="fork")  # type: ignore[call-overload]
    assert info.value.error_index == 0
    assert "the value rank 0 returned cannot be unpickled here" in str(info.value)
    assert isinstance(info.value.__cause__, raised)


def test_a_value_whose_unpickling_exits_does_not_strand_a_sync_caller() -> None:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            sync.start_processes(result_ranks.return_exiting_value, nprocs=2, start_method="fork")
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=run)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "deadlock: aiospawn.sync waited for a loop thread that died"
    (error,) = raised
    assert isinstance(error, ProcessRaisedException)
    assert isinstance(error.__cause__, SystemExit)
    assert error.__cause__.code == 3
    assert not [t for t in threading.enumerate() if t.name == "aiospawn-sync-loop"]


async def test_a_slow_unpickle_does_not_stall_the_event_loop(anyio_backend: str) -> None:
    ctx = await aiospawn.start_processes(
        result_ranks.return_waiting_value, nprocs=1, join=False, start_method="fork"
    )
    joined: list[bool] = []

    async def join() -> None:
        joined.append(await ctx.join())

    with tripwire(60, "join() while the test released a slow unpickle"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(join)
            # Runs only if the loop is free while the value is being unpickled.
            assert await anyio.to_thread.run_sync(result_ranks.unpickling.wait, 30)
            result_ranks.release.set()
    assert joined == [True]
    assert ctx.results == ["decoded"]


async def test_an_exception_whose_pickling_exits_keeps_the_original_error(
    anyio_backend: str,
) -> None:
    with pytest.raises(ProcessRaisedException) as info:
        await aiospawn.start_processes(
            result_ranks.raise_unpicklable_by_exit, nprocs=1, start_method="fork"
        )
    assert "ExitsWhenPickled: the original error" in str(info.value)
    assert isinstance(info.value.__cause__, RemoteTraceback)


async def test_a_value_whose_pickling_exits_is_reported_as_unpicklable(anyio_backend: str) -> None:
    with pytest.raises(ProcessRaisedException) as info:
        await aiospawn.start_processes(
            result_ranks.return_unpicklable_by_exit, nprocs=1, start_method="fork"
        )
    assert not isinstance(info.value, ProcessExitedException)
    assert "the value returned by the rank cannot be pickled" in str(info.value)


async def test_a_large_result_is_held_once_after_join(anyio_backend: str) -> None:
    size = 32 << 20
    process = psutil.Process()
    before = process.memory_info().rss
    results = await aiospawn.start_processes(
        result_ranks.return_bytes, (size,), nprocs=2, start_method="fork"
    )
    grown = process.memory_info().rss - before
    assert [len(value) for value in results] == [size, size]
    # The values take 2 x 32 MB; their pickled frames, if still held, as much again.
    assert grown < 3 * size, f"the supervisor grew by {grown >> 20} MB for 64 MB of results"
