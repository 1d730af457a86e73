"""The group's board on each node of a Ray group: its ranks' signals, and its end of their channels.

A rank's actor takes no call while ``fn`` runs (``_actor``), so the
supervisor's calls about a rank go to the group's :class:`SignalBoard` on the
rank's node (a small threaded actor, no CPU), which the launcher starts
(``_launcher``). A signal waits there until the rank's own thread takes it;
the rank's channel is a Unix socket the rank connects to the board's
listening socket (a ``_connection.Connection`` per attempt), which the
supervisor writes with ``deliver`` and reads with ``collect`` (``_relay``
has the picture; ``_link`` is the supervisor's end).

Ray has no authentication (any client of the cluster can run code on every
node), so the board guards against mistakes and casual reach, not a hostile
cluster: neither it nor the rank actors are named, so other jobs cannot list
or look them up; every call, and every connection to its socket, carries the
group's random token; and only the signals the supervisor sends
(:data:`BOARD_SIGNALS`) are accepted, by the board and again by the rank.

Imports only the standard library: Ray's workers import this module by name
to run the board (``ray.remote`` is applied by ``_launcher``).
"""

from __future__ import annotations

import collections
import hmac
import os
import signal
import socket
import threading

from ._connection import Connection

#: The signals the board carries: the supervisor's SIGTERM (SIGKILL is ray.kill).
BOARD_SIGNALS = frozenset({signal.SIGTERM})


#: Seconds a rank's signal thread waits on the board in one call.
SIGNAL_WAIT = 10.0

#: The flag byte before what :meth:`SignalBoard.collect` returns (and
#: :meth:`SignalBoard.deliver` when it polls).
ENDED, GOING = b"\x01", b"\x00"
#: The flag byte :meth:`SignalBoard.deliver` returns first.
WRITTEN, NOT_WRITTEN = b"\x01", b"\x00"

#: The longest head of a delivery (token, key and number).
_HEAD_LIMIT = 256

#: Seconds a connection to the board has to present the group's token.
HANDSHAKE_WAIT = 10.0

#: Calls a board runs at once per rank it serves, and for the rest: each rank
#: has a signal wait, a collect, and up to ``_link.IN_FLIGHT`` delivers waiting
#: at a time; a stop request or a release must never queue behind them.
CALLS_PER_RANK = 12
SPARE_CALLS = 16


class SignalBoard:
    """The group's board on one node: the signals sent to its ranks, and their channels.

    A threaded actor (``max_concurrency``): every call runs on a thread of its
    own and may wait. Signals wait here until each rank's thread takes them
    (:meth:`next_signal`). A channel is the rank's Unix socket, connected to
    the board's listening socket (:meth:`address`) with the group's token and
    the attempt's key; the supervisor writes to it with :meth:`deliver` and
    reads it with :meth:`collect` (see ``_relay`` for the picture).

    Args:
        token: The group's secret; a call or connection with another one is refused.
    """

    def __init__(self, token: str) -> None:
        self._token = token
        self._lock = threading.Lock()
        self._signalled = threading.Condition(self._lock)
        self._signals: dict[str, collections.deque[int]] = {}
        self._waiting: dict[str, int] = {}
        #: The channels of the attempts, by key ("rank.restart").
        self._connections: dict[str, Connection] = {}
        self._released: set[str] = set()  # keys whose channel is gone: never made again
        self._listener: socket.socket | None = None
        self._address = ""

    def address(self, token: str) -> str:
        """The Unix socket the node's ranks connect their channels to (listening from now on).

        An abstract name (Linux): no file to leave behind, reachable from this
        node only. Anyone on the node could connect, so a connection that
        does not open with the group's token is closed.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        with self._lock:
            if self._listener is None:
                name = f"\0aiospawn-board-{os.getpid()}-{os.urandom(8).hex()}"
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(name)
                listener.listen(64)
                self._listener, self._address = listener, name
                threading.Thread(
                    target=self._accept, args=(listener,), name="aiospawn-board", daemon=True
                ).start()
        return self._address

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(
                target=self._handshake, args=(sock,), name="aiospawn-board-hello", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_WAIT)
            line = b""
            while not line.endswith(b"\n") and len(line) < 256:
                piece = sock.recv(1)
                if not piece:
                    break
                line += piece
            sock.settimeout(None)
            token, _, key = line.decode("ascii").strip().partition(" ")
            self._check(token)
        except (OSError, ValueError, PermissionError):
            # Not one of our ranks, or one that died mid-handshake.
            sock.close()
            return
        connection = self._connection(key)
        if connection is None:
            sock.close()  # released already: the rank's channel ends at once
            return
        connection.attach(sock)

    def next_signal(self, token: str, key: str) -> int:
        """The next signal sent to the attempt ``key`` (``"rank.restart"``), or 0.

        0 after :data:`SIGNAL_WAIT` seconds without one: every waiting call
        ends in bounded time, also one whose rank was killed meanwhile, so the
        calls in flight stay about one per running rank.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        with self._signalled:
            self._waiting[key] = self._waiting.get(key, 0) + 1
            try:
                self._signalled.wait_for(lambda: bool(self._signals.get(key)), SIGNAL_WAIT)
                queue = self._signals.get(key)
                return queue.popleft() if queue else 0
            finally:
                self._waiting[key] -= 1
                self._prune(key)

    def send(self, token: str, key: str, signum: int) -> None:
        """Send ``signum`` to the attempt ``key``.

        Raises:
            PermissionError: ``token`` is not the group's.
            ValueError: ``signum`` is not one of :data:`BOARD_SIGNALS`.
        """
        self._check(token)
        if signum not in BOARD_SIGNALS:
            carried = ", ".join(signal.Signals(each).name for each in sorted(BOARD_SIGNALS))
            raise ValueError(f"the signal board carries {carried} only, got {signum!r}")
        with self._signalled:
            self._signals.setdefault(key, collections.deque()).append(signum)
            self._signalled.notify_all()

    def forget(self, token: str, key: str) -> None:
        """The attempt ``key`` is over: drop what was held for it, its channel too.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        with self._signalled:
            queue = self._signals.get(key)
            if queue is not None:
                queue.clear()
                self._prune(key)
        self.release(token, key)

    def deliver(self, request: bytes) -> bytes:
        """Write a piece of attempt ``key``'s frame stream to its socket; maybe collect after.

        ``request`` is ``b"<token> <key> <seq> <wait>\\n"`` and the piece:
        one argument, which Ray sends faster than several (measured: 0.14 ms
        less per round trip). ``seq`` numbers the pieces; each waits until the
        ones before it are written (Ray may start a threaded actor's calls out
        of order), until the rank has connected, and while the rank's socket is
        full (back-pressure). With ``wait`` above 0 the call then does what
        :meth:`collect` does: the rank's answer to a message comes back as the
        return of the call that carried it, one actor call for a round trip.

        Returns:
            :data:`WRITTEN` if the piece was written, or is being written by a
            thread of the board (a delivery that polls); else the channel was
            released, or the rank's end is closed. With ``wait``, what
            :meth:`collect` returns follows.

        Raises:
            PermissionError: The request does not carry the group's token.
        """
        end = request.index(b"\n", 0, _HEAD_LIMIT)
        token, key, seq, wait = request[:end].decode("ascii").split(" ")
        self._check(token)
        connection = self._connection(key)
        if connection is None:
            return NOT_WRITTEN + ENDED if float(wait) else NOT_WRITTEN
        polls = float(wait) > 0
        # A delivery that polls never waits to write (for its turn, or on a
        # full socket): the rank may be blocked sending what only it would read.
        written = connection.deliver(int(seq), memoryview(request)[end + 1 :], block=not polls)
        flag = NOT_WRITTEN if written is False else WRITTEN
        if not polls:
            return flag
        data, ended = connection.collect(float(wait))
        return flag + (ENDED if ended else GOING) + data

    def collect(self, request: str) -> bytes:
        """What the rank sent since the last call, waiting up to ``wait`` s for some.

        ``request`` is ``"<token> <key> <wait>"``. Returns the bytes after a
        flag byte, ``b"\\x01"`` once the stream has ended (all of it read),
        else ``b"\\x00"``: one value, which Ray returns faster than a tuple.

        Raises:
            PermissionError: The request does not carry the group's token.
        """
        token, key, wait = request.split(" ")
        self._check(token)
        connection = self._connection(key)
        if connection is None:
            return ENDED
        data, ended = connection.collect(float(wait))
        return (ENDED if ended else GOING) + data

    def finished(self, token: str, key: str) -> None:
        """The rank ``key``'s ``run()`` has finished: if it never connected, its stream ends.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        connection = self._connection(key)
        if connection is not None:
            connection.finished()

    def release(self, token: str, key: str) -> None:
        """Drop attempt ``key``'s channel and shut its socket down; waiting calls return at once.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        with self._lock:
            self._released.add(key)
            connection = self._connections.pop(key, None)
        if connection is not None:
            connection.release()

    def keys(self, token: str) -> list[str]:
        """The attempts something is held or awaited for.

        Raises:
            PermissionError: ``token`` is not the group's.
        """
        self._check(token)
        with self._lock:
            return sorted({*self._signals, *self._connections})

    def _check(self, token: str) -> None:
        if not (isinstance(token, str) and hmac.compare_digest(token, self._token)):
            raise PermissionError("this call does not carry the group's token")

    def _connection(self, key: str) -> Connection | None:
        with self._lock:
            if key in self._released:
                return None
            return self._connections.setdefault(key, Connection())

    def _prune(self, key: str) -> None:
        # Under the lock. A queue nobody waits on and that holds nothing is
        # recreated on demand.
        queue = self._signals.get(key)
        if queue is not None and not queue and not self._waiting.get(key):
            del self._signals[key]
            self._waiting.pop(key, None)
