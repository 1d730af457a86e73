"""A channel's socket as frames (``_rank.stream``): a read takes every frame the socket holds.

Frames queued whole (``FrameQueue``) come out of one read (``FrameStream``),
each shared frame with the descriptor it came with; a broken header ends the
stream after the frames before it.
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

import pytest

from aiospawn._rank import buffers
from aiospawn._rank.stream import READ_BYTES, FrameQueue, FrameStream
from aiospawn._rank.wire import FROM_RANK, FrameError, Link, header


def frame_bytes(kind: int, payload: bytes) -> bytes:
    return header(kind, len(payload)) + payload


def _stream_pair(shared: bool) -> tuple[socket.socket, FrameStream, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    return ours, FrameStream(FROM_RANK, shared, theirs.fileno()), theirs


def _all_frames(stream: FrameStream) -> list[tuple[int, Any]]:
    frames = []
    while True:
        try:
            stream.read()
        except BlockingIOError:
            break
        while (frame := stream.next_frame()) is not None:
            frames.append(frame)
    return frames


@pytest.mark.skipif(not buffers.AVAILABLE, reason="no memfds or descriptor passing here")
def test_one_read_sorts_every_frame_and_gives_a_descriptor_to_the_frame_it_came_with() -> None:
    ours, stream, theirs = _stream_pair(shared=True)
    big = bytearray(b"\x07" * buffers.SHARED_BYTES)
    packed = buffers.dumps(("array", pickle.PickleBuffer(big)), shared=True)
    queue = FrameQueue()
    queue.add(Link.MESSAGE, b"first")
    queue.add(Link.MESSAGE | packed.flag, packed.body, packed.fd)
    queue.add(Link.MESSAGE, b"last")
    packed.close()
    try:
        assert queue.write_some(ours.fileno())
        first = stream.read()  # stops with the descriptor: the frame it came with starts here
        frames = _all_frames(stream)
        assert first < READ_BYTES
        assert [kind for kind, _ in frames] == [Link.MESSAGE] * 3
        assert bytes(frames[0][1]) == b"first"
        assert bytes(frames[2][1]) == b"last"
        shared = frames[1][1]
        assert isinstance(shared, buffers.Mapped)
        name, array = buffers.loads(shared)
        assert name == "array"
        assert bytes(array) == bytes(big)
    finally:
        stream.forget()
        ours.close()
        theirs.close()


def test_many_small_frames_are_read_in_one_call_and_a_broken_header_ends_after_them() -> None:
    ours, stream, theirs = _stream_pair(shared=False)
    try:
        payloads = [bytes([n]) * n for n in range(1, 40)]
        ours.sendall(b"".join(frame_bytes(Link.MESSAGE, p) for p in payloads) + header(99, 0))
        assert stream.read() > 0  # one call takes them all
        got = [bytes(stream.next_frame()[1]) for _ in payloads]  # type: ignore[index]
        assert got == payloads
        with pytest.raises(FrameError, match="unknown kind 99"):
            stream.next_frame()
        assert stream.stopped
    finally:
        stream.forget()
        ours.close()
        theirs.close()
