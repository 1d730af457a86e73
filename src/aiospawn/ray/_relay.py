"""A Ray rank's channel: a Unix socket to the group's board on the rank's node.

A Ray rank's actor answers one call at a time (``fn`` holds its main thread),
and Ray runs every method of an actor with concurrency groups on other
threads, ``run()`` included, where ``fn`` could not install signal handlers
(measured with Ray 2.60). So the rank cannot take the supervisor's calls
itself; the group's :class:`~._board.SignalBoard` on the rank's node takes
them, and the rank's end is the same as a local rank's:
``aiospawn._rank.channel`` over a Unix socket, here one connected to the
board's listening socket::

    supervisor ── RayLink.write_some ── board.deliver(data) ──► socket ──► rank's Frames
    supervisor ◄── RayLink.receive_frame ── board.collect() ◄── socket ◄── rank's Frames
                   (one call that polls always outstanding: a long poll)

A message's way to the rank is one actor call, and the rank's answer comes
back as the return of the call that polls: a small delivery made while none
is outstanding polls once it has written, so a round trip costs one actor
call (two replies would cost 1.35x one, measured). The board moves bytes,
not frames: the frame stream is cut into pieces of at most :data:`CHUNK`
bytes and parsed only at its ends. Ray keeps a call's argument or return
value above 100 KiB in its object store, so large pieces travel through it.
Back-pressure holds at every hop: the socket's buffers, and the deliveries a
link keeps in flight (``_link.IN_FLIGHT``, ``_link.WINDOW``); the board reads
the rank only when a call that polls asks, so what the supervisor does not
take stays in the rank's socket.

The socket ends the channel as a local rank's does: the rank closing its end
or dying (the kernel closes it) is the end of the stream the supervisor
reads, and the supervisor's release closes the board's end, so the rank's
``receive()`` ends and its ``send()`` fails.

Runs in the rank's worker process (:func:`connect`) and in the supervisor
(the constants); Ray is not imported here.
"""

from __future__ import annotations

import socket

#: The largest piece of the frame stream one call carries.
CHUNK = 4 * 1024 * 1024
#: Seconds one waiting ``collect`` lasts (every call in flight ends in bounded time).
TAKE_WAIT = 10.0
#: Seconds a rank waits to connect to its board.
CONNECT_WAIT = 30.0


def connect(address: str, token: str, key: str) -> int:
    """Connect attempt ``key``'s channel to the board at ``address``; return the socket's fd.

    Raises:
        OSError: The board cannot be reached (it is gone: the group is torn down).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_WAIT)
        sock.connect(address)
        sock.sendall(f"{token} {key}\n".encode("ascii"))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock.detach()
