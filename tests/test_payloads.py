"""Payloads whose pickles carry buffers: numpy arrays, bytearray, pickle.PickleBuffer.

Pickle protocol 5 hands a pickler's file an out-of-band-capable buffer of
64 KiB or more as the object itself (a ``pickle.PickleBuffer`` for a numpy
array), not as bytes. Each group here sends a set of such payloads, from
1 KiB to 8 MiB, every way a payload travels: through the channel both ways,
as a call's arguments and answer, as a ``ready()`` payload and as the rank's
result. One group per start method and rank kind. Rank functions:
``tests/payload_ranks.py``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import aiospawn
from aiospawn._core._pickles import encode
from tests.helpers import tripwire

np = pytest.importorskip("numpy", reason="numpy (the test extra) makes the payloads")
from tests import payload_ranks  # noqa: E402  # it imports numpy

pytestmark = pytest.mark.anyio


async def test_encode_writes_a_buffer_as_pickle_dumps_does() -> None:
    # The supervisor's encoder against the standard library's, on buffers below
    # and above 64 KiB, one of them Fortran-ordered (128 KiB, under THREAD_BYTES: the
    # sink writes it): its bytes go in memory order.
    fortran = np.asfortranarray(np.arange(16384, dtype=np.float64).reshape(128, 128))
    objects = [
        *payload_ranks.payloads(3).values(),
        pickle.PickleBuffer(fortran),
        [pickle.PickleBuffer(bytearray(b"x" * 70000)), np.ones(10000)],
    ]
    for obj in objects:
        packed = await encode(obj)
        assert packed.fd == -1
        assert packed.body == pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


@pytest.mark.parametrize(
    ("start_method", "rank_loop"),
    [
        pytest.param(method, loop, id=f"{method}-{loop or 'sync'}")
        for loop in (None, "asyncio")
        for method in ("spawn", "forkserver", "fork")
    ],
)
async def test_buffers_travel_every_way_a_payload_does(
    anyio_backend: str, start_method: str, rank_loop: str | None
) -> None:
    fn = payload_ranks.exchange if rank_loop is None else payload_ranks.exchange_async
    options: dict[str, Any] = {} if rank_loop is None else {"rank_loop": rank_loop}
    mine = payload_ranks.payloads(0)
    with tripwire(90, f"payloads to and from a {rank_loop or 'sync'} rank under {start_method}"):
        async with aiospawn.open_group(fn, nprocs=2, start_method=start_method, **options) as ctx:
            ready = await ctx.wait_ready()
            for rank, payload in enumerate(ready):
                assert payload_ranks.same(payload, payload_ranks.payloads(rank)["1 MiB"])

            for rank in range(2):
                # Supervisor to rank through the channel; the rank says what differed.
                channel = ctx.channel(rank)
                for value in mine.values():
                    await channel.send(value)
                assert await channel.receive() == []
                # Rank to supervisor through the channel, a payload a message.
                theirs = payload_ranks.expected(rank)
                got = dict([await channel.receive() for _ in theirs])
                assert payload_ranks.mismatches(got, theirs) == []

            # A call's arguments, to both ranks at once, and its answers.
            assert await ctx.call("check", **mine) == [[], []]
            answers = await ctx.call("make")
            for rank, answer in enumerate(answers):
                assert payload_ranks.mismatches(answer, payload_ranks.expected(rank)) == []
    for rank, result in enumerate(ctx.results):
        assert payload_ranks.mismatches(result, payload_ranks.expected(rank)) == []
