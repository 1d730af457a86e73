"""The supervisor's pool of reusable memfds (``_core._pool``), without processes.

Each test drives a :class:`SegmentPool` as the channels do: a message takes a
segment, each frame queued claims it for a holder (a rank's channel), the
message's close and every holder's release (or exit) make it free again.
What ranks see of it is in ``test_shared_memory``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import pytest

from aiospawn._core._pool import (
    MAX_SEGMENTS,
    POOL_BYTES_VAR,
    SegmentPool,
    close_all,
    pool_bytes,
)
from aiospawn._rank import buffers

pytestmark = pytest.mark.skipif(not buffers.AVAILABLE, reason="memfds are Linux's")

MiB = 1 << 20


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def opened(cap: int = 64 * MiB) -> Iterator[SegmentPool]:
    """A pool, closed at the end, with the segments it gave up."""
    pool = SegmentPool(cap)
    try:
        yield pool
    finally:
        pool.close()
        close_all(pool.evicted())


def send(pool: SegmentPool, nbytes: int, *holders: object) -> int:
    """Take a segment for ``nbytes``, queue it to ``holders``, close the message; its token."""
    segment = pool.take(nbytes)
    assert segment is not None
    packed = pool.packed(segment, b"")
    for holder in holders:
        packed.claim(holder)
    packed.close()
    return segment.token


def test_a_segment_is_free_again_once_every_holder_released_it() -> None:
    with opened() as pool:
        first = send(pool, 4 * MiB, "rank 0", "rank 1")
        second = send(pool, 4 * MiB, "rank 0")
        assert second != first  # the first is claimed
        pool.released(first, "rank 0")
        assert send(pool, 4 * MiB) not in (first, second)  # rank 1 still maps it
        pool.released(first, "rank 1")
        assert send(pool, 4 * MiB) == first
        assert pool.made == 3
        assert pool.reused == 1


def test_each_frame_is_a_claim_and_releases_that_are_not_claims_are_ignored() -> None:
    with opened() as pool:
        token = send(pool, MiB, "rank 0", "rank 0")
        pool.released(token, "rank 1")  # never sent there
        pool.released(token + 100, "rank 0")  # no such segment
        pool.released(token, "rank 0")
        assert send(pool, MiB) != token  # one frame is still mapped
        pool.released(token, "rank 0")
        pool.released(token, "rank 0")  # one too many: ignored
        assert send(pool, MiB) == token


def test_a_holder_that_exited_holds_nothing() -> None:
    with opened() as pool:
        token = send(pool, MiB, "rank 0", "rank 0", "rank 1")
        pool.forget_holder("rank 0")
        pool.released(token, "rank 1")
        assert send(pool, MiB) == token


def test_a_message_still_being_packed_keeps_its_segment() -> None:
    with opened() as pool:
        segment = pool.take(MiB)
        assert segment is not None
        other = pool.take(MiB)
        assert other is not None
        assert other.token != segment.token
        pool.unpacked(segment)
        pool.unpacked(other)


def test_sizes_reuse_a_segment_up_to_twice_as_large() -> None:
    with opened() as pool:
        big = send(pool, 8 * MiB)
        assert send(pool, 5 * MiB) == big
        assert send(pool, 3 * MiB) != big  # more than twice its size: kept for large ones


def test_least_recently_used_free_segments_make_room_and_the_cap_holds() -> None:
    with opened(16 * MiB) as pool:
        older, newer = pool.take(4 * MiB), pool.take(4 * MiB)
        assert older is not None
        assert newer is not None
        pool.unpacked(older)
        pool.unpacked(newer)
        # 12 MiB more than the 8 held: the least recently used free one goes.
        big = pool.take(12 * MiB)
        assert big is not None
        assert pool.evicted() == [older.fd, older.read_only]
        close_all([older.fd, older.read_only])
        assert pool.held == 16 * MiB
        # Nothing free fits, and giving up the free one would leave too
        # little room: it is kept.
        assert pool.take(13 * MiB) is None
        assert pool.evicted() == []
        assert pool.held == 16 * MiB
        assert pool.take(4 * MiB) is newer
        assert pool.take(17 * MiB) is None  # more than the cap, whatever is free
        pool.unpacked(big)
        pool.unpacked(newer)


def test_the_descriptor_budget_keeps_room_for_a_full_pool() -> None:
    from aiospawn._local._limits import POOL_FDS

    assert POOL_FDS == 2 * MAX_SEGMENTS


def test_the_pool_holds_at_most_max_segments_whatever_their_bytes() -> None:
    with opened(1 << 40) as pool:
        held = [send(pool, MiB, f"rank {index}") for index in range(MAX_SEGMENTS)]
        # Every segment is held by a rank: the next message gets none (a
        # fresh memfd, closed once written), however much room the bytes leave.
        assert pool.take(MiB) is None
        open_before = len(os.listdir("/proc/self/fd"))
        # One is released: free, it is reused or given up for a new size.
        pool.released(held[0], "rank 0")
        segment = pool.take(3 * MiB)
        assert segment is not None
        close_all(pool.evicted())
        assert len(os.listdir("/proc/self/fd")) == open_before  # two closed, two opened
        pool.unpacked(segment)


def test_closing_frees_every_segment_once_its_packer_is_done() -> None:
    pool = SegmentPool(64 * MiB)
    free = pool.take(MiB)
    claimed = pool.take(MiB)
    packing = pool.take(MiB)
    assert free is not None
    assert claimed is not None
    assert packing is not None
    pool.unpacked(free)
    pool.claim(claimed, "rank 0")
    pool.unpacked(claimed)
    pool.close()
    close_all(pool.evicted())  # off the loop, in a group
    assert not is_open(free.fd)
    assert not is_open(claimed.fd)  # the ranks have all ended
    assert is_open(packing.fd)  # a worker thread writes into it
    pool.unpacked(packing)
    assert not is_open(packing.fd)
    assert not is_open(packing.read_only)
    assert pool.take(MiB) is None  # closed: fresh memfds from now on


def test_a_pooled_segment_is_sealed_against_resizing_and_its_sent_descriptor_is_read_only() -> None:
    import fcntl

    with opened() as pool:
        segment = pool.take(MiB)
        assert segment is not None
        seals = fcntl.fcntl(segment.read_only, fcntl.F_GET_SEALS)
        wanted = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals & wanted == wanted
        assert not seals & fcntl.F_SEAL_WRITE
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.write(segment.read_only, b"x")
        pool.unpacked(segment)


def test_the_pool_size_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(POOL_BYTES_VAR, "12345")
    assert pool_bytes() == 12345
    monkeypatch.setenv(POOL_BYTES_VAR, "0")
    assert pool_bytes() == 0
    monkeypatch.delenv(POOL_BYTES_VAR)
    default = pool_bytes()
    assert 0 < default <= 1 << 30
    monkeypatch.setenv(POOL_BYTES_VAR, "lots")
    with caplog.at_level(logging.WARNING, logger="aiospawn"):
        assert pool_bytes() == default
    assert "AIOSPAWN_SHARED_POOL_BYTES='lots' is not a byte count" in caplog.text
