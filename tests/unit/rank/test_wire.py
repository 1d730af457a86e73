"""The frame format (``_rank.wire``): reassembly from any chunking, never reading past the frame.

Also the channel's frame checks: a kind the receiver does not take, or a size
out of its kind's range, is refused at the header, before any of its payload.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiospawn._rank.wire import (
    CALL_ID,
    FROM_RANK,
    HEADER,
    MAX_FRAME_BYTES,
    TO_RANK,
    FrameError,
    FrameReader,
    Kind,
    Link,
    check_size,
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


def test_a_sender_refuses_a_payload_beyond_the_limit() -> None:
    check_size(MAX_FRAME_BYTES)
    with pytest.raises(ValueError, match=f"more than a channel frame carries \\({MAX_FRAME_BYTES}"):
        check_size(MAX_FRAME_BYTES + 1)
