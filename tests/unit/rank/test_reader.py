"""A frame's reader (``_rank.reader``): reassembly from any chunking, never reading past the frame.

Also the channel's frame checks: a kind the receiver does not take, or a size
out of its kind's range, is refused at the header, before any of its payload;
and a shared frame's memfd, mapped as the frame completes.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiospawn._rank import buffers
from aiospawn._rank.reader import FrameReader
from aiospawn._rank.wire import (
    CALL_ID,
    FROM_RANK,
    HEADER,
    MAX_FRAME_BYTES,
    TO_RANK,
    FrameError,
    Kind,
    Link,
    header,
)

PAYLOAD = b"the rank's pickled result \x00\xff" * 10


KINDS = [Kind.RETURNED, Kind.RAISED, Kind.EXITED]


def frame_bytes(kind: int, payload: bytes) -> bytes:
    return header(kind, len(payload)) + payload


def read_like_the_watcher(stream: bytes, chunk: int) -> tuple[FrameReader, bytes]:
    """Read ``stream`` as ``LocalRank`` reads its pipe: at most ``min(wanted, chunk)``
    bytes at a time, until the frame is complete or the stream ends.

    Returns the reader and what is left unread.
    """
    reader = FrameReader()
    while not reader.complete and stream:
        wanted = reader.wanted
        assert wanted > 0
        data, stream = stream[: min(wanted, chunk)], stream[min(wanted, chunk) :]
        reader.feed(data)
    return reader, stream


def test_a_frame_fed_in_one_chunk() -> None:
    reader = FrameReader()
    reader.feed(frame_bytes(Kind.RETURNED, PAYLOAD))
    assert reader.complete
    assert reader.wanted == 0
    assert reader.frame() == (Kind.RETURNED, PAYLOAD)
    assert reader.frame() == (Kind.RETURNED, PAYLOAD)  # asking again changes nothing


def test_a_frame_fed_byte_by_byte() -> None:
    data = frame_bytes(Kind.RAISED, PAYLOAD)
    reader = FrameReader()
    for index in range(len(data)):
        assert not reader.complete
        assert reader.frame() is None
        assert reader.wanted == (HEADER.size - index if index < HEADER.size else len(data) - index)
        reader.feed(data[index : index + 1])
    assert reader.complete
    assert reader.frame() == (Kind.RAISED, PAYLOAD)


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_payload_is_complete_with_its_header(kind: int) -> None:
    reader = FrameReader()
    reader.feed(header(kind, 0)[:-1])
    assert reader.frame() is None
    reader.feed(header(kind, 0)[-1:])
    assert reader.frame() == (kind, b"")


@pytest.mark.parametrize(
    "cut",
    [0, 1, HEADER.size - 1, HEADER.size, HEADER.size + 1, HEADER.size + len(PAYLOAD) - 1],
)
def test_an_incomplete_frame_gives_none(cut: int) -> None:
    reader = FrameReader()
    reader.feed(frame_bytes(Kind.EXITED, PAYLOAD)[:cut])
    reader.feed(b"")  # end of file: the rank died mid-frame
    assert not reader.complete
    assert reader.frame() is None
    assert reader.wanted > 0


@given(
    payload=st.binary(max_size=2000),
    trailing=st.binary(min_size=1, max_size=50),
    chunk=st.integers(min_value=1, max_value=3000),
    kind=st.sampled_from(KINDS),
)
def test_wanted_never_asks_past_the_frame(
    payload: bytes, trailing: bytes, chunk: int, kind: int
) -> None:
    """Whatever follows the frame on the pipe (here ``trailing``) is never read."""
    reader, unread = read_like_the_watcher(frame_bytes(kind, payload) + trailing, chunk)
    assert reader.frame() == (kind, payload)
    assert unread == trailing


@given(payload=st.binary(min_size=1, max_size=500), chunk=st.integers(min_value=1, max_value=600))
def test_a_stream_that_ends_early_leaves_the_frame_incomplete(payload: bytes, chunk: int) -> None:
    data = frame_bytes(Kind.RETURNED, payload)
    reader, unread = read_like_the_watcher(data[:-1], chunk)
    assert unread == b""
    assert reader.frame() is None


# ------------------------------------------------------------ channel frames


@pytest.mark.parametrize(
    ("sizes", "kind", "size", "match"),
    [
        (FROM_RANK, 255, 2**64 - 1, "unknown kind 255"),
        (FROM_RANK, 0, 0, "unknown kind 0"),
        (FROM_RANK, Link.CALL, 100, "unknown kind 3"),  # only the supervisor calls
        (TO_RANK, Link.REPLY, 100, "unknown kind 4"),  # only a rank replies
        (TO_RANK, Link.READY, 100, "unknown kind 2"),
        (FROM_RANK, Link.MESSAGE, MAX_FRAME_BYTES + 1, "more than a channel frame carries"),
        (FROM_RANK, Link.MESSAGE, 2**62, "more than a channel frame carries"),
        (TO_RANK, Link.CALL, 2**64 - 1, "more than a channel frame carries"),
        (FROM_RANK, Link.REPLY, CALL_ID.size - 1, "shorter than its 8-byte call id"),
        (FROM_RANK, Link.REPLY, 0, "shorter than its 8-byte call id"),
        (TO_RANK, Link.CALL, 2, "shorter than its 8-byte call id"),
        (FROM_RANK, Link.CLOSE, 1, "a CLOSE frame is empty"),
        (FROM_RANK, Link.CANCEL, CALL_ID.size, "unknown kind 6"),  # only the supervisor cancels
        (TO_RANK, Link.CANCEL, CALL_ID.size + 1, "a CANCEL frame is its 8-byte call id"),
        (TO_RANK, Link.CANCEL, CALL_ID.size - 1, "a CANCEL frame is its 8-byte call id"),
        (TO_RANK, Link.CANCEL, 2**64 - 1, "a CANCEL frame is its 8-byte call id"),
    ],
)
def test_a_header_the_receiver_does_not_take_is_refused_before_its_payload(
    sizes: dict[int, tuple[int, int | None]], kind: int, size: int, match: str
) -> None:
    reader = FrameReader(sizes)
    reader.feed(header(kind, size)[:-1])  # a header in part is not judged yet
    with pytest.raises(FrameError, match=match):
        reader.feed(header(kind, size)[-1:] + b"junk")
    assert reader.frame() is None


def test_garbage_is_refused_at_its_first_header() -> None:
    reader = FrameReader(FROM_RANK)
    with pytest.raises(FrameError, match="unknown kind 255 \\(its header: ff ff ff"):
        reader.feed(b"\xff" * HEADER.size)


@pytest.mark.parametrize(
    ("sizes", "kind", "size"),
    [
        (FROM_RANK, Link.MESSAGE, 0),
        (FROM_RANK, Link.MESSAGE, MAX_FRAME_BYTES),
        (FROM_RANK, Link.READY, 5),
        (FROM_RANK, Link.REPLY, CALL_ID.size),
        (FROM_RANK, Link.CLOSE, 0),
        (TO_RANK, Link.CALL, CALL_ID.size + 1),
        (TO_RANK, Link.MESSAGE, 1),
        (TO_RANK, Link.CANCEL, CALL_ID.size),
        (None, 255, 2**64 - 1),  # an outcome frame's reader takes any header
    ],
)
def test_a_header_in_range_is_taken(
    sizes: dict[int, tuple[int, int | None]] | None, kind: int, size: int
) -> None:
    reader = FrameReader(sizes)
    reader.feed(header(kind, size))
    assert reader.wanted == size
    assert reader.complete == (size == 0)


# --- frames whose buffers are in a memfd (``_rank.buffers``) -------------------------------


def _open_fds() -> set[int]:
    import os

    return {int(name) for name in os.listdir("/proc/self/fd")}


def _read_shared(kind: int, payload: bytes, fds: list[int]) -> object:
    reader = FrameReader(FROM_RANK, shared=True)
    reader.add_fds(fds)
    reader.feed(header(kind, len(payload)) + payload)
    return reader.shared_frame()


@pytest.mark.skipif(not buffers.AVAILABLE, reason="memfds and SCM_RIGHTS are Linux's")
def test_a_shared_frame_maps_its_memfd_and_closes_its_descriptor() -> None:
    data = bytearray(range(256)) * 8192  # 2 MiB: out of band
    packed = buffers.dumps(pickle.PickleBuffer(data), shared=True)
    before = _open_fds()
    frame = _read_shared(Link.MESSAGE | packed.flag, packed.body, [packed.fd])
    assert isinstance(frame, tuple)
    kind, mapped = frame
    assert kind == Link.MESSAGE
    assert isinstance(mapped, buffers.Mapped)
    assert bytes(buffers.loads(mapped)) == bytes(data)
    assert _open_fds() <= before  # no descriptor kept for the mapping
    import os

    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(packed.fd)  # the reader closed the one it was given
    packed.fd = -1


@pytest.mark.skipif(not buffers.AVAILABLE, reason="memfds and SCM_RIGHTS are Linux's")
@pytest.mark.parametrize(
    ("fds", "says"),
    [
        ("none", "came with 0 descriptor(s), not one"),
        ("two", "came with 2 descriptor(s), not one"),
        ("cut short", "came with too many descriptor(s)"),
        ("pipe", "not a sealed memfd"),
    ],
)
def test_a_shared_frame_with_the_wrong_descriptors_is_refused_and_they_are_closed(
    fds: str, says: str
) -> None:
    import os

    packed = buffers.dumps(pickle.PickleBuffer(bytearray(2 << 20)), shared=True)
    if fds == "pipe":
        read, write = os.pipe()
        os.close(write)
    given = {
        "none": list,
        "two": lambda: [packed.fd, os.dup(packed.fd)],
        "cut short": lambda: [packed.fd, -1],
        "pipe": lambda: [read],
    }[fds]()
    with pytest.raises(FrameError, match=says.replace("(", r"\(").replace(")", r"\)")):
        _read_shared(Link.MESSAGE | buffers.SHARED, packed.body, given)
    for fd in given:
        if fd >= 0:
            with pytest.raises(OSError, match="Bad file descriptor"):
                os.fstat(fd)
    if fds in ("none", "pipe"):
        packed.close()
    else:
        packed.fd = -1


@pytest.mark.skipif(not buffers.AVAILABLE, reason="memfds and SCM_RIGHTS are Linux's")
def test_a_plain_frame_with_a_descriptor_is_refused() -> None:
    import os

    read, write = os.pipe()
    os.close(write)
    with pytest.raises(FrameError, match="a MESSAGE frame that came with a descriptor"):
        _read_shared(Link.MESSAGE, pickle.dumps("x"), [read])
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(read)


def test_a_shared_flag_is_an_unknown_kind_to_a_reader_that_takes_no_descriptors() -> None:
    reader = FrameReader(FROM_RANK)
    with pytest.raises(FrameError, match="unknown kind 129"):
        reader.feed(header(Link.MESSAGE | buffers.SHARED, 100))
