"""The result frame (``_wire``): reassembly from any chunking, never reading past the frame."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiospawn._rank.wire import HEADER, FrameReader, Kind, header

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
