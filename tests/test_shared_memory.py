"""Large buffers travel through a memfd that the receiver maps, both ways (``_rank.buffers``).

What each side holds is checked in ``/proc/self/maps``: a payload with a
buffer of 1 MiB or more arrives mapped from one of aiospawn's memfds, a
smaller one does not; values, dtypes and layouts arrive as they left; the
receiver's writes and the sender's later ones stay apart; a call to several
ranks maps one memfd in all of them; a rank that sends a shared frame the
supervisor cannot trust fails its channel; and after every test the
supervisor holds no memfd, no mapping of one, and nothing in /dev/shm. Rank
functions: ``tests/shm_ranks.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aiospawn
from aiospawn import ProcessException
from aiospawn._core._outbound import UNTAKEN_BYTES
from aiospawn._core._pool import MAX_SEGMENTS
from aiospawn._rank import buffers
from tests import live_ranks, shm_ranks
from tests.helpers import tripwire

np = pytest.importorskip("numpy", reason="numpy (the test extra) makes the payloads")

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not buffers.AVAILABLE, reason="memfds and SCM_RIGHTS are Linux's"),
]

#: The repository, where ``python -m tests.shm_tensors`` runs.
ROOT = Path(__file__).resolve().parent.parent

RECORD = np.dtype([("id", "<i4"), ("score", "<f8"), ("tag", "S3")])
MiB = 1 << 20


def memfds() -> list[str]:
    """The supervisor's open descriptors of aiospawn's memfds."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:aiospawn"):
            found.append(f"{name}:{target}")
    return found


def named_shared_memory() -> list[str]:
    """What the supervisor opens or maps in /dev/shm (other programs may make entries there)."""
    with open("/proc/self/maps") as maps:
        found = [line for line in maps if "/dev/shm/" in line]
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}").startswith("/dev/shm/"):
                found.append(name)
    return found


@pytest.fixture(autouse=True)
def _nothing_shared_is_left() -> Iterator[None]:
    yield
    gc.collect()
    assert memfds() == []
    assert shm_ranks.memfd_maps(pool=True) == []
    assert named_shared_memory() == []


def payloads() -> dict[str, tuple[Any, bool, bool]]:
    """``name: (payload, held mapped by the rank, held mapped when it comes back)``.

    A non-contiguous array is copied into the pickle and arrives contiguous:
    sent back, it is mapped. A ``bytearray`` is mapped, then copied into the
    ``bytearray`` that the unpickler makes: nothing stays mapped.
    """
    records = np.zeros(100_000, dtype=RECORD)  # 1.5 MB
    records["id"] = np.arange(100_000)
    records["tag"] = b"abc"
    return {
        "float64, 8 MiB": (np.arange(MiB, dtype=np.float64), True, True),
        "just below 1 MiB": (np.arange(MiB // 8 - 1, dtype=np.float64), False, False),
        "exactly 1 MiB": (np.arange(MiB, dtype=np.uint8), True, True),
        "Fortran order": (
            np.asfortranarray(np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)),
            True,
            True,
        ),
        "strided slice": (np.arange(MiB, dtype=np.int64)[::2], False, True),
        "0-d": (np.array(3.5), False, False),
        "empty": (np.empty((0, 5)), False, False),
        "structured": (records, True, True),
        "complex128": (np.arange(200_000) * (1 + 2j), True, True),
        "bool": (np.arange(2 * MiB) % 3 == 0, True, True),
        "bytearray": (bytearray(b"\x07") * (2 * MiB), False, False),
        "PickleBuffer": (pickle.PickleBuffer(bytearray(b"\x09") * (3 * MiB)), True, True),
        "container": (
            {
                "a": np.ones(MiB, dtype=np.int32),
                "b": [np.full(300_000, 7, dtype=np.int64), "text"],
                "small": np.arange(10),
            },
            True,
            True,
        ),
    }


def same(got: Any, want: Any) -> bool:
    """Equal, of the same type, and an array with the same dtype, shape and order.

    The order is the one the standard library's round trip gives.
    """
    if isinstance(want, pickle.PickleBuffer):
        # Out of band, pickle hands over the buffer itself: a memoryview here.
        with want.raw() as raw:
            return isinstance(got, memoryview) and got.tobytes() == raw.tobytes()
    if type(got) is not type(want):
        return False
    if isinstance(want, np.ndarray):
        want = pickle.loads(pickle.dumps(want, protocol=5))
        return (
            got.dtype == want.dtype
            and got.shape == want.shape
            and got.flags.c_contiguous == want.flags.c_contiguous
            and got.flags.f_contiguous == want.flags.f_contiguous
            and got.flags.writeable
            and bool(np.array_equal(got, want))
        )
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[key], want[key]) for key in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(map(same, got, want))
    return bool(got == want)


@pytest.mark.parametrize(
    ("start_method", "rank_loop"),
    [
        pytest.param(method, loop, id=f"{method}-{loop or 'sync'}")
        for loop in (None, "asyncio", "trio")
        for method in ("spawn", "forkserver", "fork")
    ],
)
async def test_large_buffers_are_mapped_both_ways(
    anyio_backend: str, start_method: str, rank_loop: str | None
) -> None:
    fn = shm_ranks.echo if rank_loop is None else shm_ranks.echo_async
    options: dict[str, Any] = {} if rank_loop is None else {"rank_loop": rank_loop}
    with tripwire(120, f"large buffers to a {rank_loop or 'sync'} rank under {start_method}"):
        async with aiospawn.open_group(fn, nprocs=1, start_method=start_method, **options) as ctx:
            channel = ctx.channel(0)
            for name, (payload, there, back_here) in payloads().items():
                await channel.send(payload)
                maps_there, back = await channel.receive()
                assert maps_there == int(there), f"{name}: the rank mapped {maps_there}"
                assert len(shm_ranks.memfd_maps()) == int(back_here), name
                assert same(back, payload), name
                del back
            await channel.send("serve")
            for name, (payload, there, back_here) in payloads().items():
                [(maps_there, back)] = await ctx.call("echo", payload)
                assert maps_there == int(there), f"{name}: the rank mapped {maps_there}"
                assert len(shm_ranks.memfd_maps()) == int(back_here), name
                assert same(back, payload), name
                del back


@pytest.mark.both_loops
async def test_a_memoryview_travels_as_a_view_of_the_same_format_shape_and_flag(
    anyio_backend: str,
) -> None:
    # What a large PickleBuffer arrives as can be sent on: the echo sends back
    # exactly what it received, a memoryview of its mapping.
    grid = memoryview(bytearray(range(24))).cast("i", (2, 3))
    views = {
        "small": memoryview(bytearray(b"ab" * 50)),
        "small, read-only": memoryview(b"cd" * 50),
        "ints, 2-d": grid,
        "0-d": memoryview(bytes(8)).cast("d", ()),
        "strided": memoryview(bytearray(range(200)))[::3],
        "large": memoryview(bytearray(b"\x05") * (2 * MiB)),
        "large, read-only": memoryview(bytes(3 * MiB)),
        "large PickleBuffer": pickle.PickleBuffer(bytearray(b"\x06") * (2 * MiB)),
    }
    with tripwire(60, "memoryviews to a rank and back"):
        async with aiospawn.open_group(shm_ranks.echo, nprocs=1, start_method="fork") as ctx:
            channel = ctx.channel(0)
            for name, sent in views.items():
                await channel.send(sent)
                _, back = await channel.receive()
                want = sent.raw() if isinstance(sent, pickle.PickleBuffer) else sent
                assert isinstance(back, memoryview), name
                got = (back.format, back.shape, back.readonly, back.tobytes())
                assert got == (want.format, want.shape, want.readonly, want.tobytes()), name
                del back
            records = np.zeros(4, dtype=RECORD)
            with pytest.raises(TypeError, match="cannot pickle a memoryview of format"):
                await channel.send(memoryview(records))
            await channel.send(memoryview(b"still open"))
            assert (await channel.receive())[1].tobytes() == b"still open"


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
async def test_a_rank_may_return_memoryviews(anyio_backend: str, start_method: str) -> None:
    # What a rank received can be its result as it is, a memoryview of the
    # mapping; a view of a format the supervisor could not rebuild fails the
    # rank with the reason, not the supervisor.
    large = pickle.PickleBuffer(bytearray(b"\x07") * (2 * MiB))
    with tripwire(60, f"memoryviews returned by a {start_method} rank"):
        async with aiospawn.open_group(
            shm_ranks.return_views, nprocs=1, start_method=start_method
        ) as ctx:
            await ctx.channel(0).send(large)
            assert await ctx.join()
            [[received, own, grid]] = ctx.results
    assert isinstance(received, memoryview)
    assert received.tobytes() == bytes(large.raw())
    assert own.tobytes() == b"own" * 10
    assert (grid.format, grid.shape, grid.tolist()) == ("i", (2, 3), [[0, 1, 2], [3, 4, 5]])
    with (
        tripwire(60, "a record view returned"),
        pytest.raises(aiospawn.ProcessRaisedException) as failed,
    ):
        await aiospawn.start_processes(
            shm_ranks.return_record_view, nprocs=1, start_method=start_method
        )
    assert "cannot pickle a memoryview of format" in str(failed.value)


async def test_warm_ranks_map_large_buffers_both_ways(anyio_backend: str) -> None:
    from aiospawn._local import _templates

    payload = np.arange(MiB, dtype=np.float64)
    try:
        with tripwire(120, "large buffers to a warm rank"):
            async with aiospawn.open_group(shm_ranks.echo, nprocs=2, preload=["numpy"]) as ctx:
                await ctx.channel(1).send(payload)
                maps_there, back = await ctx.channel(1).receive()
                assert maps_there == 1
                assert len(shm_ranks.memfd_maps()) == 1
                assert same(back, payload)
                del back
                for rank in range(2):
                    await ctx.channel(rank).send("serve")
                answers = await ctx.call("echo", payload)
                assert [maps for maps, _ in answers] == [1, 1]
                assert len(shm_ranks.memfd_maps()) == 2  # one memfd per answer
                assert all(same(back, payload) for _, back in answers)
                del answers
    finally:
        _templates.stop_all()


@pytest.mark.both_loops
async def test_the_receivers_writes_and_the_senders_later_writes_stay_apart(
    anyio_backend: str,
) -> None:
    sent = np.arange(MiB, dtype=np.float64)
    with tripwire(60, "writes to shared buffers"):
        async with aiospawn.open_group(shm_ranks.echo, nprocs=1, start_method="fork") as ctx:
            await ctx.channel(0).send("serve")
            # The rank writes -1 into what it got and sends it back.
            [back] = await ctx.call("keep", sent)
            assert sent[0] == 0  # the rank's write is not ours
            assert back[0] == -1
            assert len(shm_ranks.memfd_maps()) == 1
            sent[1] = 42.0  # a write after the call is not the rank's either
            back[1] = 43.0  # nor is a write to what came back
            [peeked] = await ctx.call("peek")
            assert peeked.tolist() == [-1.0, 1.0]
            del back


async def test_a_call_to_several_ranks_maps_one_memfd_in_each(anyio_backend: str) -> None:
    argument = np.ones(4 * MiB, dtype=np.uint8)
    with tripwire(90, "a call's argument to four ranks"):
        async with aiospawn.open_group(shm_ranks.echo, nprocs=4, start_method="fork") as ctx:
            for rank in range(4):
                await ctx.channel(rank).send("serve")
            inodes = await ctx.call("inodes", argument)
    assert all(len(found) == 1 for found in inodes), inodes
    assert len({found[0] for found in inodes}) == 1, f"more than one memfd: {inodes}"


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("no fd", "came with 0 descriptor(s), not one"),
        ("pipe", "not a sealed memfd"),
        ("extra fd", "a MESSAGE frame that came with a descriptor"),
        ("bad layout", "names bytes 0-1048576 of a 4096-byte memfd"),
        ("pooled", "a pooled segment, which only the supervisor sends"),
    ],
)
async def test_a_shared_frame_the_supervisor_cannot_trust_fails_its_rank(
    anyio_backend: str, how: str, says: str
) -> None:
    with tripwire(60, f"a shared frame with {how}"), pytest.raises(ProcessException) as info:
        async with aiospawn.open_group(
            shm_ranks.bad_frame, (how,), nprocs=2, start_method="fork"
        ) as ctx:
            await ctx.channel(1).receive()
    assert type(info.value) is ProcessException
    assert info.value.error_index == 0
    assert "broke its channel" in str(info.value)
    assert says in str(info.value)


async def test_sends_and_calls_cancelled_while_their_buffers_are_written_leave_no_memfd(
    anyio_backend: str,
) -> None:
    big = np.zeros(16 * MiB // 8)
    with tripwire(90, "cancelled sends of large buffers"):
        async with aiospawn.open_group(shm_ranks.echo, nprocs=2, start_method="fork") as ctx:
            channel = ctx.channel(0)
            await channel.send("serve")
            await ctx.channel(1).send("serve")
            for _ in range(3):
                for start in (channel.send, functools.partial(ctx.call, "inodes")):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(start, big)
                        # Waiting for the worker thread that writes the memfd.
                        await anyio.wait_all_tasks_blocked()
                        tg.cancel_scope.cancel()
            # Calls still work, and a cancelled call's argument is dropped in
            # the rank too (rank 0 keeps the messages it has not received).
            [_, inodes] = await ctx.call("inodes", big)
            assert len(inodes) == 1
    # The fixture checks: no memfd, no mapping of one, nothing in /dev/shm.


async def test_a_rank_killed_while_it_maps_a_buffer_leaves_nothing_behind(
    anyio_backend: str,
) -> None:
    ctx = await aiospawn.start_processes(shm_ranks.echo, nprocs=1, join=False, start_method="fork")
    with tripwire(60, "a rank killed holding a mapping"):
        await ctx.channel(0).send("serve")
        [back] = await ctx.call("keep", np.arange(MiB, dtype=np.float64))
        del back
        # A frame with its memfd in flight to the rank when it dies, too.
        await ctx.channel(0).send(np.zeros(MiB))
        os.kill(ctx.pids()[0], signal.SIGKILL)
        with pytest.raises(ProcessException, match="SIGKILL"):
            await ctx.join()
    # The fixture checks: no memfd, no mapping of one, nothing in /dev/shm.


@pytest.mark.torch
async def test_cpu_tensors_are_mapped_both_ways_with_their_layout(anyio_backend: str) -> None:
    # In a supervisor process of its own: importing torch here would change
    # this test process for the tests after it (torch's loggers stop
    # propagating; aiospawn.sync's errors become torch's classes).
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch (install torch==2.13.0) makes the tensors")
    with tripwire(300, "tensors to a rank, from a supervisor of their own"):
        done = await anyio.run_process(
            [sys.executable, "-m", "tests.shm_tensors"], cwd=ROOT, check=False
        )
    report = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, report
    assert "every tensor came back as it left" in report


# ---------------------------------------------------------------- the pool of segments


class Asker:
    """Asks a :func:`shm_ranks.holder` rank through its channel or through ``ctx.call``."""

    def __init__(self, ctx: Any, rank: int, via: str) -> None:
        self.ctx = ctx
        self.rank = rank
        self.via = via

    async def __call__(self, method: str, *args: Any) -> Any:
        if self.via == "call":
            [answer] = await self.ctx.call(method, *args, ranks=[self.rank])
            return answer
        channel = self.ctx.channel(self.rank)
        await channel.send((method, *args))
        return await channel.receive()

    async def start(self) -> None:
        if self.via == "call":
            await self.ctx.channel(self.rank).send(("serve",))


def full(value: float) -> Any:
    """8 MiB of ``value``: a buffer that travels through a segment."""
    return np.full(MiB, value)


@pytest.mark.both_loops
@pytest.mark.parametrize("via", ["channel", "call"])
@pytest.mark.parametrize("rank_loop", [None, "asyncio", "trio"], ids=["sync", "asyncio", "trio"])
async def test_a_segment_is_rewritten_only_once_its_receiver_let_go_of_it(
    anyio_backend: str, via: str, rank_loop: str | None
) -> None:
    fn = shm_ranks.holder if rank_loop is None else shm_ranks.holder_async
    options: dict[str, Any] = {} if rank_loop is None else {"rank_loop": rank_loop}
    with tripwire(60, f"a reused segment through {via}"):
        async with aiospawn.open_group(fn, nprocs=1, start_method="fork", **options) as ctx:
            ask = Asker(ctx, 0, via)
            await ask.start()
            first = await ask("hold", "a", full(1.0))
            assert first != 0, "the buffer was not mapped"
            # "a" is held: the next buffer cannot go into its segment, and
            # what the rank holds stays as it came (a page of a private
            # mapping the rank never wrote would show a rewrite).
            second = await ask("hold", "b", full(2.0))
            assert second not in (0, first)
            assert await ask("check", "a") == (1.0, 1.0)
            await ask("drop", "a")
            # Let go of: the same segment carries the next buffer.
            assert await ask("hold", "c", full(3.0)) == first
            assert await ask("check", "b") == (2.0, 2.0)
            assert await ask("check", "c") == (3.0, 3.0)
            # A mapping that goes in another thread is released from there.
            await ask("drop_in_thread", "b")
            assert await ask("hold", "d", full(4.0)) == second
            assert await ask("check", "c") == (3.0, 3.0)
            assert await ask("check", "d") == (4.0, 4.0)


async def test_a_rank_killed_holding_a_segment_gives_it_back(anyio_backend: str) -> None:
    policy = aiospawn.RestartPolicy(strategy="one_for_one", backoff=aiospawn.Backoff(initial=0.0))
    with tripwire(60, "a rank killed while it maps a segment"):
        async with (
            aiospawn.open_group(
                shm_ranks.holder, nprocs=2, start_method="fork", restart=policy, wait_ready=True
            ) as ctx,
            contextlib.aclosing(ctx.events()) as events,
        ):
            held = await Asker(ctx, 1, "channel")("hold", "a", full(1.0))
            other = await Asker(ctx, 0, "channel")("hold", "x", full(5.0))
            assert other not in (0, held)
            os.kill(ctx.pids()[1], signal.SIGKILL)
            async for event in events:
                if isinstance(event, aiospawn.Exited) and event.rank == 1:
                    break
            # Its claim went with it: the segment it mapped is rewritten.
            assert await Asker(ctx, 0, "channel")("hold", "y", full(6.0)) == held
            assert await Asker(ctx, 0, "channel")("check", "x") == (5.0, 5.0)
            # Its successor, forked from the supervisor, kept no descriptor
            # of the pool's segments.
            assert await Asker(ctx, 1, "channel")("memfds") == 0


async def test_the_pool_holds_no_more_than_its_cap(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for two 8 MiB segments, not three.
    monkeypatch.setenv("AIOSPAWN_SHARED_POOL_BYTES", str(17 * MiB))
    with tripwire(60, "a capped pool"):
        async with aiospawn.open_group(shm_ranks.holder, nprocs=1, start_method="fork") as ctx:
            ask = Asker(ctx, 0, "channel")
            pooled = {await ask("hold", "a", full(1.0)), await ask("hold", "b", full(2.0))}
            # No segment free and no room: a memfd of its own, as without a pool.
            beyond = await ask("hold", "c", full(3.0))
            assert beyond not in pooled
            for key in "abc":
                await ask("drop", key)
            assert {await ask("hold", "d", full(4.0)), await ask("hold", "e", full(5.0))} == pooled
            last = await ask("hold", "f", full(6.0))
            assert last not in (*pooled, beyond)
            for key, value in zip("def", (4.0, 5.0, 6.0), strict=True):
                assert await ask("check", key) == (value, value)


async def test_what_a_rank_keeps_holds_no_more_descriptors_than_the_pool_has_segments(
    anyio_backend: str,
) -> None:
    # A pooled segment keeps two descriptors open in the supervisor while a
    # rank maps it. A rank that keeps every array it receives: past
    # MAX_SEGMENTS, each goes in a memfd of its own, closed once written.
    kept = MAX_SEGMENTS + 28
    with tripwire(120, "a rank that keeps what it receives"):
        async with aiospawn.open_group(
            shm_ranks.holder, nprocs=1, start_method="fork", wait_ready=True
        ) as ctx:
            ask = Asker(ctx, 0, "channel")
            before = len(os.listdir("/proc/self/fd"))
            for index in range(kept):
                await ask("hold", str(index), np.full(MiB // 8 + 512, float(index)))
            grown = len(os.listdir("/proc/self/fd")) - before
            assert grown <= 2 * MAX_SEGMENTS, grown
            for index in (0, MAX_SEGMENTS, kept - 1):
                assert await ask("check", str(index)) == (index, index)


@pytest.mark.both_loops
async def test_large_buffers_count_in_the_back_pressure_on_a_rank_that_does_not_read(
    anyio_backend: str,
) -> None:
    # Each message's array (8 MiB) travels in a memfd, its frame a few hundred
    # bytes: without counting the buffers, hundreds would go out unread.
    go_reader, go_writer = multiprocessing.Pipe(duplex=False)
    count = 40
    sent = 0
    with go_reader, go_writer, tripwire(120, "large buffers to a rank that does not read"):
        async with aiospawn.open_group(
            live_ranks.read_when_told, (go_reader,), nprocs=1, start_method="fork"
        ) as ctx:
            channel = ctx.channel(0)

            async def send_all() -> None:
                nonlocal sent
                for seq in range(count):
                    await channel.send((seq, full(float(seq))))
                    sent += 1
                await channel.send_eof()

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all)
                # Settled once it has not moved for a while (a send also
                # waits, unblocked, while its buffer is written on a thread).
                settled, last = 0, -1
                while settled < 5:
                    await anyio.wait_all_tasks_blocked()
                    await anyio.sleep(0.2)
                    settled, last = (settled + 1, last) if sent == last else (0, sent)
                held = sent * full(0.0).nbytes
                assert sent < count
                assert held <= UNTAKEN_BYTES + full(0.0).nbytes, f"{sent} messages went out unread"
                go_writer.send("read now")
            assert sent == count
    assert ctx.results == [(1, list(range(count)))]


async def test_a_pool_of_zero_bytes_sends_every_buffer_in_a_memfd_of_its_own(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOSPAWN_SHARED_POOL_BYTES", "0")
    with tripwire(60, "no pool"):
        async with aiospawn.open_group(shm_ranks.holder, nprocs=1, start_method="fork") as ctx:
            ask = Asker(ctx, 0, "channel")
            seen = set()
            for value in (1.0, 2.0, 3.0):
                seen.add(await ask("hold", "a", full(value)))
                await ask("drop", "a")
            assert len(seen) == 3
            assert 0 not in seen
