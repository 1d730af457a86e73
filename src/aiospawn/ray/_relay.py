"""A Ray rank's end of its channel: a local socket pair, relayed to the group's board.

A Ray rank's actor answers one call at a time (``fn`` holds its main thread),
and Ray runs the methods of an actor with concurrency groups on other threads,
where ``fn`` could not install signal handlers. So the frames of a Ray rank's
channel travel through the group's :class:`~._actor.SignalBoard`, which holds
a bounded pipe per attempt and direction, and the rank's end is the same as a
local rank's: ``aiospawn._rank.channel`` over one end of a socket pair in the
rank's process. Two threads relay the other end::

    supervisor ── RayLink.write_some ── board.put("down") ─┐
                                                            board (head node)
    rank's _Frames ◄── socket pair ◄── down thread: take("down") ◄┘
    rank's _Frames ──► socket pair ──► up thread: put("up") ──► board
    supervisor ◄── RayLink.receive_frame ── board.take("up") ◄────┘

The relay moves bytes, not frames: the frame stream is cut into chunks of at
most :data:`CHUNK` bytes and parsed only at its ends. Back-pressure holds at
every hop: the socket pair's buffers, the board's :data:`~._actor.PIPE_BYTES`
per direction, one call in flight per direction and side.

Runs in the rank's worker process; Ray is imported there already.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

#: The largest piece of the frame stream one call carries.
CHUNK = 256 * 1024
#: Seconds one waiting ``take`` lasts (every call in flight ends in bounded time).
TAKE_WAIT = 10.0


class RankRelay:
    """Relays one rank attempt's socket end to the board, on two daemon threads.

    Args:
        board: The group's board.
        token: The group's token.
        key: The attempt, ``"rank.restart"``.

    Attributes:
        rank_fd: The rank's end of the socket pair, for ``open_channel``.
    """

    def __init__(self, board: Any, token: str, key: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        self.rank_fd = theirs.detach()
        self._board, self._token, self._key = board, token, key
        self._up = threading.Thread(target=self._relay_up, name="aiospawn-channel-up", daemon=True)
        self._down = threading.Thread(
            target=self._relay_down, name="aiospawn-channel-down", daemon=True
        )
        self._up.start()
        self._down.start()

    def finish(self, patience: float) -> None:
        """Wait (up to ``patience`` s) until what the rank wrote before closing its end is relayed.

        Call once the rank's end is closed (``aiospawn._rank.channel.finish``).
        """
        self._up.join(patience)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self._board, method).remote(self._token, self._key, *args))

    def _relay_up(self) -> None:
        try:
            while True:
                data = self._sock.recv(CHUNK)
                if not data:  # the rank closed its end: the stream is whole
                    self._call("end", "up")
                    return
                if not self._call("put", "up", data):
                    # The supervisor released the channel: the rank's send()
                    # gets BrokenPipeError, as a local rank's does.
                    with contextlib.suppress(OSError):
                        self._sock.shutdown(socket.SHUT_RDWR)
                    return
        except Exception:  # the board is gone (the group is torn down), or the socket
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _relay_down(self) -> None:
        try:
            while True:
                chunks, ended = self._call("take", "down", TAKE_WAIT)
                for chunk in chunks:
                    self._sock.sendall(chunk)  # blocks while the rank does not read
                if ended:
                    # The supervisor released the channel (only a release ends
                    # this direction): the rank reads the end, and its send()
                    # gets BrokenPipeError, as when a local supervisor closes.
                    with contextlib.suppress(OSError):
                        self._sock.shutdown(socket.SHUT_RDWR)
                    return
        except Exception:  # the rank closed its end, or the board is gone
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)
