"""A group's reusable memfds for the large buffers it sends to its ranks.

Writing a large buffer into a fresh memfd costs more than copying it through
a socket: the kernel allocates and clears a shmem page for every 4 KiB
written (about 56 ms for 100 MB on the project's test machine, against
16 ms to rewrite pages already allocated). So the supervisor keeps, per
group, a :class:`SegmentPool` of memfds ("segments") it rewrites. A segment
is rewritten only while nobody maps it: each frame sent with it is a claim
of that rank's attempt, which the rank gives back with a RELEASED frame once
the mapping made for that frame is gone (``_rank.buffers``), or which ends
with the attempt's exit::

        take(size) ──► packing (a worker thread writes the buffers)
                          │ queued on a rank's channel: a claim per frame
                          ▼
        free ◄── every claim released (RELEASED frame, or the rank exited),
         │       and the packer done (``Packed.close()``)
         └─► least recently used ones closed when a new segment needs room

The pool holds at most :func:`pool_bytes` bytes of segments, and at most
:data:`MAX_SEGMENTS` of them (each holds two of the supervisor's
descriptors); a buffer that finds no free segment and no room is written into
a fresh sealed memfd, as without a pool (``buffers.pack``), whose descriptor
the supervisor closes once the frame is written, and so is every buffer a
rank sends to the supervisor. Its bookkeeping runs on the event loop; only the writes and the
closing of evicted segments happen on worker threads.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
from collections.abc import Callable
from typing import final

from aiospawn._rank import buffers
from aiospawn._rank.buffers import Packed

logger = logging.getLogger("aiospawn")

#: The environment variable that sets a group's pool size in bytes (0: no pool).
POOL_BYTES_VAR = "AIOSPAWN_SHARED_POOL_BYTES"
#: The pool size when the variable is not set: 1 GiB, or an eighth of the
#: machine's memory if that is less.
DEFAULT_POOL_BYTES = 1 << 30


#: The most segments a group's pool holds, free and in use. Each keeps two
#: descriptors open in the supervisor (the segment and its read-only twin)
#: for as long as a rank maps it: a rank that keeps every array it receives
#: would otherwise take the supervisor's descriptors one segment at a time.
MAX_SEGMENTS = 32


def pool_bytes() -> int:
    """The bytes of segments a group's pool may hold: :data:`POOL_BYTES_VAR`, else the default."""
    text = os.environ.get(POOL_BYTES_VAR)
    if text is not None:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value >= 0:
            return value
        logger.warning(
            "%s=%r is not a byte count (a non-negative int): the default applies",
            POOL_BYTES_VAR,
            text,
        )
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return DEFAULT_POOL_BYTES
    return min(DEFAULT_POOL_BYTES, memory // 8)


#: The bytes copied into a segment's mapping at a time (see :meth:`Segment.write`).
_COPY_SLICE = 2 * 1024 * 1024


def _rounded(nbytes: int) -> int:
    """A segment size for ``nbytes``: rounded up by at most an eighth, to a whole page.

    Payloads that differ a little reuse each other's segments. A page never
    written is never allocated, so the rounding costs address space only.
    """
    step = max(4096, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


@final
class Segment:
    """One memfd of the pool, and who holds it."""

    __slots__ = (
        "claims",
        "fd",
        "packing",
        "read_only",
        "size",
        "token",
        "unmap",
        "view",
        "written",
    )

    def __init__(self, token: int, size: int, fd: int, read_only: int) -> None:
        self.token = token
        self.size = size
        #: Writable: the supervisor's.
        self.fd = fd
        #: Read-only: what frames carry to the ranks.
        self.read_only = read_only
        #: Frames sent with it and not released, per holder (a rank's channel).
        self.claims: collections.Counter[object] = collections.Counter()
        #: Messages being packed into it, or queued and not yet closed.
        self.packing = 0
        #: The supervisor's shared mapping of it, made the first time it is
        #: rewritten, and what unmaps it.
        self.view: memoryview | None = None
        self.unmap: Callable[[], object] | None = None
        #: True once written: its pages are allocated.
        self.written = False

    def write(self, spans: list[tuple[int, int]], large: list[memoryview]) -> None:
        """Write ``large`` at ``spans``; on a worker thread, by the one packer that holds it.

        The first time through ``pwrite``, which allocates the pages as it
        goes; then through a mapping whose page tables are filled once
        (``MAP_POPULATE``): a copy into it costs less than ``pwrite``'s
        lookup of every page.

        Raises:
            OSError: No memory for the pages or the mapping.
        """
        if not self.written:
            buffers.write_buffers(self.fd, spans, large)
            self.written = True
            return
        if self.view is None:
            self.view, self.unmap = buffers.map_writable(self.fd, self.size)
        for (offset, size), view in zip(spans, large, strict=True):
            # In slices: a slice assignment copies holding the GIL, and the
            # loop's thread waits for it (a 100 MB copy in one piece held up
            # the loop 12-19 ms here); between slices the GIL changes hands.
            for start in range(0, size, _COPY_SLICE):
                end = min(start + _COPY_SLICE, size)
                self.view[offset + start : offset + end] = view[start:end]


@final
class SegmentPool:
    """A group's segments: taken to send a large buffer, free again once nobody maps them.

    Args:
        limit: The most bytes of segments held (free and in use); 0 turns pooling off.
        keep: Called with each descriptor the pool opens (the backend records
            it, so that a ``fork`` rank closes its copy); returns it.
        drop: Called with each descriptor before the pool closes it.
    """

    def __init__(
        self,
        limit: int,
        keep: Callable[[int], int] | None = None,
        drop: Callable[[int], None] | None = None,
    ) -> None:
        self.limit = limit
        self._keep = keep
        self._drop = drop
        self._segments: dict[int, Segment] = {}
        #: The free ones, least recently used first.
        self._free: collections.OrderedDict[int, Segment] = collections.OrderedDict()
        self._tokens = itertools.count(1)
        #: Descriptors (and unmappers) of evicted segments, for a worker thread to close.
        self._evicted: list[int | Callable[[], object]] = []
        self._closed = False
        #: Bytes of the segments held.
        self.held = 0
        #: Segments made, and times one was taken again.
        self.made = 0
        self.reused = 0

    def take(self, nbytes: int) -> Segment | None:
        """A segment of at least ``nbytes`` to write, or None (no room: make a fresh memfd).

        A free segment of the size (up to twice it) is reused, the smallest,
        then the most recently used; else a new one is made, after the least
        recently used free ones are given up for it if the pool would outgrow
        :attr:`limit` or :data:`MAX_SEGMENTS`. None if even giving up every
        free one leaves too little room (they are kept).

        Raises:
            OSError: A new segment could not be made.
        """
        if self._closed or nbytes <= 0 or nbytes > self.limit:
            return None
        # The most recently used first: its pages and the supervisor's
        # mapping of them are warm, and the others age towards eviction.
        fitting = [
            segment
            for segment in reversed(self._free.values())
            if nbytes <= segment.size <= 2 * nbytes
        ]
        if fitting:
            segment = min(fitting, key=lambda segment: segment.size)
            del self._free[segment.token]
            segment.packing += 1
            self.reused += 1
            return segment
        size = _rounded(nbytes)
        in_use = self.held - sum(segment.size for segment in self._free.values())
        if in_use + size > self.limit or len(self._segments) - len(self._free) >= MAX_SEGMENTS:
            return None  # no room even without the free ones: keep them
        while self.held + size > self.limit or len(self._segments) >= MAX_SEGMENTS:
            _, oldest = self._free.popitem(last=False)
            self._forget(oldest)
        fd, read_only = buffers.new_segment(size)
        if self._keep is not None:
            fd, read_only = self._keep(fd), self._keep(read_only)
        segment = Segment(next(self._tokens), size, fd, read_only)
        self._segments[segment.token] = segment
        self.held += size
        self.made += 1
        segment.packing = 1
        return segment

    def evicted(self) -> list[int | Callable[[], object]]:
        """What segments given up since the last call left: :func:`close_all` them."""
        fds, self._evicted = self._evicted, []
        return fds

    def packed(self, segment: Segment, body: bytes) -> PooledPacked:
        """The message written into ``segment``: ``body`` is its layout and pickle."""
        return PooledPacked(self, segment, body)

    def claim(self, segment: Segment, holder: object) -> None:
        """A frame with ``segment`` was queued on ``holder``'s channel."""
        segment.claims[holder] += 1

    def released(self, token: int, holder: object) -> None:
        """``holder``'s rank unmapped one frame's segment ``token`` (a RELEASED frame).

        A token the pool no longer holds, or one ``holder`` never got, is ignored.
        """
        segment = self._segments.get(token)
        if segment is None or segment.claims[holder] <= 0:
            return
        segment.claims[holder] -= 1
        if segment.claims[holder] == 0:
            del segment.claims[holder]
        self._settle(segment)

    def unpacked(self, segment: Segment) -> None:
        """A message packed into ``segment`` was closed (every frame of it queued, or dropped)."""
        segment.packing -= 1
        self._settle(segment)

    def forget_holder(self, holder: object) -> None:
        """``holder``'s rank has exited: nothing it mapped is mapped any more."""
        for segment in list(self._segments.values()):
            if holder in segment.claims:
                del segment.claims[holder]
                self._settle(segment)

    def close(self) -> None:
        """Give up every segment (the group's ranks have all ended); idempotent.

        What the free ones leave is in :meth:`evicted`, for the caller to
        close off the loop. A segment still being written is closed (on the
        loop) once its writer is done with it.
        """
        self._closed = True
        for segment in list(self._segments.values()):
            segment.claims.clear()
            if not segment.packing:
                self._forget(segment)

    def _settle(self, segment: Segment) -> None:
        if segment.packing or segment.claims or segment.token not in self._segments:
            return
        if self._closed:
            self._forget(segment)
            self._close_evicted()
        else:
            self._free[segment.token] = segment
            self._free.move_to_end(segment.token)

    def _forget(self, segment: Segment) -> None:
        del self._segments[segment.token]
        self._free.pop(segment.token, None)
        self.held -= segment.size
        if segment.unmap is not None:
            segment.view = None
            self._evicted.append(segment.unmap)
        for fd in (segment.fd, segment.read_only):
            if self._drop is not None:
                self._drop(fd)
            self._evicted.append(fd)

    def _close_evicted(self) -> None:
        close_all(self.evicted())

    def __repr__(self) -> str:
        return (
            f"<SegmentPool held={self.held} limit={self.limit} segments={len(self._segments)}"
            f" free={len(self._free)} made={self.made} reused={self.reused}>"
        )


def close_all(evicted: list[int | Callable[[], object]]) -> None:
    """Unmap and close what :meth:`SegmentPool.evicted` returned."""
    for item in evicted:
        if isinstance(item, int):
            os.close(item)
        else:
            item()


class PooledPacked(Packed):
    """A message whose large buffers are in one of the pool's segments.

    Its :attr:`fd` is the segment's read-only descriptor, which the pool
    keeps: :meth:`close` hands the segment back instead of closing it.
    """

    __slots__ = ("_pool", "_segment")

    def __init__(self, pool: SegmentPool, segment: Segment, body: bytes) -> None:
        super().__init__(body, segment.read_only)
        self._pool = pool
        self._segment: Segment | None = segment

    def claim(self, holder: object) -> None:
        """Its frame was queued on ``holder``'s channel: that rank holds the segment."""
        if self._segment is not None:
            self._pool.claim(self._segment, holder)

    def close(self) -> None:
        """Hand the segment back (free once every claim is released); idempotent."""
        segment, self._segment = self._segment, None
        self.fd = -1
        if segment is not None:
            self._pool.unpacked(segment)
