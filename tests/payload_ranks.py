"""Ranks for test_payloads: numpy arrays and other pickle-5 buffers, both ways.

Each is called as ``fn(rank, *args)``; importable, so that spawn and
forkserver ranks reach them. The payloads are made by :func:`payloads` on
either side, so each side can check what the other sent it.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

import aiospawn

#: A structured dtype: fields of several types, packed (no padding).
RECORD = np.dtype([("id", "<i4"), ("score", "<f8"), ("tag", "S3")])


def payloads(rank: int) -> dict[str, Any]:
    """Objects whose pickles hold buffers below and above protocol 5's 64 KiB, rank-dependent.

    A ``pickle.PickleBuffer`` unpickles as the ``bytearray`` (or ``bytes``, if
    read-only) of its bytes: :func:`expected` says what arrives.
    """
    start = float(rank * 1000)
    records = np.zeros(8192, dtype=RECORD)  # 120 KiB: 15 bytes a record
    records["id"] = np.arange(8192) + rank
    records["score"] = np.linspace(start, start + 1, 8192)
    records["tag"] = b"abc"
    return {
        "1 KiB": np.arange(128, dtype=np.float64) + start,
        "64 KiB": np.arange(8192, dtype=np.float64) + start,
        "1 MiB": np.arange(131072, dtype=np.float64) + start,
        "8 MiB": np.arange(1048576, dtype=np.float64) + start,
        # Every other element: neither C- nor Fortran-contiguous.
        "strided view": (np.arange(65536, dtype=np.int32) + rank)[::2],
        # The transpose of a C array: Fortran-contiguous.
        "transposed": (np.arange(131072, dtype=np.float32) + rank).reshape(256, 512).T,
        "records": records,
        "bytearray": bytearray([rank % 256]) * (1 << 20),
        "PickleBuffer": pickle.PickleBuffer(bytearray([rank % 256 + 1]) * (128 << 10)),
        "read-only PickleBuffer": pickle.PickleBuffer(bytes([rank % 256 + 2]) * (256 << 10)),
        "in a list": [np.arange(16384, dtype=np.int64) + rank, "beside it"],
    }


def expected(rank: int) -> dict[str, Any]:
    """:func:`payloads` as they arrive: a PickleBuffer as the bytes it holds."""
    sent = payloads(rank)
    for name, value in sent.items():
        if isinstance(value, pickle.PickleBuffer):
            with value.raw() as raw:
                sent[name] = bytes(raw) if raw.readonly else bytearray(raw)
    return sent


def mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The names whose values differ in type, dtype, shape or contents: none if all match."""
    if set(got) != set(want):
        return [f"keys {sorted(got)} != {sorted(want)}"]
    return [name for name in want if not same(got[name], want[name])]


def same(got: Any, want: Any) -> bool:
    """Whether ``got`` is ``want`` again: its type, and an array's dtype, shape and values."""
    if type(got) is not type(want):
        return False
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and got.shape == want.shape and bool(np.all(got == want))
    if isinstance(want, list):
        return len(got) == len(want) and all(map(same, got, want))
    return bool(got == want)


class Handler:
    """Calls whose arguments and answers are payloads."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def check(self, **sent: Any) -> list[str]:
        """What the supervisor sent as arguments, checked here."""
        return mismatches(sent, expected(0))

    def make(self) -> dict[str, Any]:
        """This rank's payloads, as an answer."""
        return payloads(self.rank)


def exchange(rank: int) -> dict[str, Any]:
    """Ready with an array, trade payloads over the channel, serve calls, return payloads.

    Receives the supervisor's :func:`payloads` (rank 0's) as one message per
    payload and sends back what it found wrong, then sends its own, one per
    payload; then serves :class:`Handler` until the channel closes.
    """
    aiospawn.ready(payloads(rank)["1 MiB"])
    channel = aiospawn.channel()
    got = {name: channel.receive() for name in payloads(0)}
    channel.send(mismatches(got, expected(0)))
    for name, value in payloads(rank).items():
        channel.send((name, value))
    aiospawn.serve(Handler(rank))
    return payloads(rank)


async def exchange_async(rank: int) -> dict[str, Any]:
    aiospawn.ready(payloads(rank)["1 MiB"])
    channel = aiospawn.channel()
    got = {name: await channel.receive() for name in payloads(0)}
    await channel.send(mismatches(got, expected(0)))
    for name, value in payloads(rank).items():
        await channel.send((name, value))
    await aiospawn.serve(Handler(rank))
    return payloads(rank)
