"""What runs on the Ray cluster: one actor per rank, and a board per node of a group.

A rank is a plain (synchronous) Ray actor, so ``fn`` runs on the main thread
of the actor's worker process, as it does in a local rank: it may install
signal handlers, and ``SIGTERM`` gets its default action back before ``fn``
runs (Ray's worker replaces it with one that raises ``SystemExit``).

A plain actor answers one call at a time, so while ``fn`` runs it cannot take
a "please stop" call. The group's :class:`SignalBoard` on the rank's node (a
small asyncio actor, no CPU) carries signals instead: a thread in each rank waits on the board and
delivers what arrives to its own process with ``os.kill``, and Python's (or
the user's) handler runs as it would locally. ``SIGKILL`` never goes through
the board: the supervisor uses ``ray.kill``. Ray kills an actor whose owner
(the supervising process) dies, which is the cluster's parent-death guard.

Ray has no authentication (any client of the cluster can run code on every
node), so the board guards against mistakes and casual reach, not a hostile
cluster: neither it nor the rank actors are named, so other jobs cannot list
or look them up; every call carries the group's random token; and only the
signals the supervisor sends (:data:`BOARD_SIGNALS`) are accepted, by the
board and again by the rank.

The board also holds the board's end of each rank's channel
(``aiospawn.channel()``, ``ctx.channel(rank)``), a Unix socket the rank
connects on its node: the rank actor cannot take calls of its own while
``fn`` runs, and ``_relay`` has the picture. (A connection must open with
the group's token too.) ``fn`` runs under the same rule as a local rank's
(``aiospawn._rank.outcome``): an ``async def fn`` runs on its own event loop,
SIGTERM cancels it the same way, and its outcome is the same
``(kind, payload)`` frame a local rank sends, so the supervisor builds the
same exceptions from it.

Nothing here is imported by ``import aiospawn``; Ray is imported by the caller.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import pickle
import select
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from aiospawn._core._env import free_port
from aiospawn._rank.outcome import die_of_sigterm, run_fn
from aiospawn._rank.wire import Kind, Outcome, encode_exception


class RankActor:
    """The Ray actor that runs one attempt at one rank (decorated with ``ray.remote`` later).

    Args:
        rank: The rank it runs, which names it in Ray's output prefix.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._done = threading.Event()

    def __repr__(self) -> str:
        # Ray prefixes each line a worker prints with its actor's repr:
        # "(rank3 pid=1234, ip=10.0.0.2) loss 0.5", as local ranks get "[rank3]: ".
        return f"rank{self._rank}"

    def describe(self) -> tuple[str, str, int]:
        """``(node_id, node_address, pid)`` of the process that will run the rank."""
        import ray

        context = ray.get_runtime_context()
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return context.get_node_id(), address, os.getpid()

    def free_port(self) -> int:
        """A TCP port nothing listens on, on this node (for ``MASTER_PORT``)."""
        return free_port(host="")

    def run(
        self,
        work: bytes,
        rank: int,
        env: Mapping[str, str],
        restart: int,
        board: Any,
        token: str,
        loop: str = "asyncio",
        address: str = "",
    ) -> Outcome:
        """Run the rank's ``fn`` on this (main) thread and return its outcome.

        Args:
            work: ``(fn, args)``, pickled by the supervisor (with cloudpickle,
                so ``fn`` may come from the driver's ``__main__``). Unpickled
                only here, once ``env`` is set, so that ``fn``'s module sees
                the rank's variables when it is imported, as under ``spawn``.
            rank: The rank's index.
            env: Variables to set first.
            restart: The attempt's restart count.
            board: The group's :class:`SignalBoard` on this node.
            token: The group's token, which the board asks of every call.
            loop: The event loop an ``async def fn`` runs on.
            address: The board's socket, which the rank's channel connects to.
        """
        from aiospawn._rank import api
        from aiospawn._rank.frames import open_channel

        from ._relay import connect

        key = f"{rank}.{restart}"
        os.environ.update(env)
        # The rank's channel: the same rank-side end as a local rank's, over a
        # socket to the board on this node.
        api.begin(restart=restart, frames=open_channel(connect(address, token, key)))
        # Python's default action, as in a local rank: SIGTERM ends the process
        # unless fn installs a handler of its own.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(
            target=self._take_signals,
            args=(board, token, key),
            name="aiospawn-signals",
            daemon=True,
        ).start()
        terminated = False
        try:
            try:
                fn, args = pickle.loads(work)
            except BaseException as exc:
                error = RuntimeError(f"rank {rank} could not unpickle fn and args: {exc!r}")
                error.__cause__ = exc
                return Kind.RAISED, encode_exception(error), 1
            ending = run_fn(fn, rank, args, loop)
            terminated = ending.terminated
            return ending.frame
        finally:
            # What the rank sent and a cancellation left queued goes out to the
            # board before the supervisor learns of the end.
            api.end(CHANNEL_PATIENCE)
            self._done.set()
            if terminated:
                # SIGTERM cancelled an async fn, which ran its cleanup: the
                # process now dies of SIGTERM, as a local rank does.
                die_of_sigterm()

    def _take_signals(self, board: Any, token: str, key: str) -> None:
        import ray

        while not self._done.is_set():
            try:
                signum = ray.get(board.next_signal.remote(token, key))
            except Exception:  # the board is gone: the group is being torn down
                return
            # Checked here too: whatever reached the board, a rank only ever
            # takes the signals the supervisor sends.
            if signum in BOARD_SIGNALS and not self._done.is_set():
                with contextlib.suppress(OSError):
                    os.kill(os.getpid(), signum)


#: Seconds a rank's end waits for what it sent to reach its socket.
CHANNEL_PATIENCE = 5.0


#: The signals the board carries: the supervisor's SIGTERM (SIGKILL is ray.kill).
BOARD_SIGNALS = frozenset({signal.SIGTERM})


#: Seconds a rank's signal thread waits on the board in one call.
SIGNAL_WAIT = 10.0

#: Bytes one ``collect`` returns at most.
COLLECT_BYTES = 4 * 1024 * 1024

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


class _Connection:
    """One attempt's channel on the board: the rank's socket, and the calls that use it.

    Its calls run on the board's threads, so each wait is on :attr:`changed`;
    the socket itself is read by the one :meth:`collect` in progress, on its
    own thread, so that a reply the rank sends wakes that call at once. What
    nobody reads stays in the socket, also after the rank's exit.
    """

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.eof = False  # the rank's end is closed (or it never connected): nothing more comes
        self.released = False  # the supervisor let go: nothing is kept any more
        self.next_seq = 0  # the delivery to write next: Ray may start them out of order
        self.changed = threading.Condition()
        self._using = 0  # calls that use the socket now: the last one out closes it
        self._reading = threading.Lock()

    def attach(self, sock: socket.socket) -> None:
        with self.changed:
            if self.released or self.eof or self.sock is not None:
                sock.close()
                return
            self.sock = sock
            self.changed.notify_all()

    def _use(self) -> socket.socket | None:
        """The socket, counted as in use, once connected; None if it never will be. Locked."""
        self.changed.wait_for(lambda: self.sock is not None or self.eof or self.released)
        if self.released or self.sock is None:
            return None
        self._using += 1
        return self.sock

    def _done_with(self) -> None:
        """Locked. Closed by the last call out, once released: never under a blocked call."""
        self._using -= 1
        if self._using == 0 and self.released and self.sock is not None:
            self.sock.close()

    def deliver(self, seq: int, data: memoryview, block: bool = True) -> bool | None:
        """Write the ``seq``-th piece: True if written, False if refused.

        Without ``block``, None if it could not be written at once (its turn
        has not come, or the socket is full): a thread of its own writes it,
        or the rest of it, and the next piece waits for that.
        """
        with self.changed:
            if not block and self.next_seq != seq and not self.released:
                threading.Thread(
                    target=self.deliver,
                    args=(seq, data),
                    name="aiospawn-board-write",
                    daemon=True,
                ).start()
                return None
            self.changed.wait_for(lambda: self.next_seq == seq or self.released)
            sock = self._use()
        written = False
        if sock is not None:
            try:
                if block:
                    sock.sendall(data)  # blocks while the rank does not read: back-pressure
                else:
                    sent = _send_now(sock, data)
                    if sent < len(data):
                        threading.Thread(
                            target=self._write_rest,
                            args=(sock, data[sent:], seq),
                            name="aiospawn-board-write",
                            daemon=True,
                        ).start()
                        return None
                written = True
            except OSError:  # the rank's end is closed
                pass
        self._written(sock, seq)
        return written and not self.released

    def _write_rest(self, sock: socket.socket, data: memoryview, seq: int) -> None:
        with contextlib.suppress(OSError):  # the rank's end is closed: the next piece learns it
            sock.sendall(data)
        self._written(sock, seq)

    def _written(self, sock: socket.socket | None, seq: int) -> None:
        with self.changed:
            if sock is not None:
                self._done_with()
            self.next_seq = max(self.next_seq, seq + 1)
            self.changed.notify_all()

    def collect(self, wait: float) -> tuple[bytes, bool]:
        deadline = time.monotonic() + wait
        with self.changed:
            self.changed.wait_for(lambda: self.sock is not None or self.eof or self.released, wait)
            if self.eof or self.released or self.sock is None:
                return b"", self.eof or self.released
            sock = self._use()
        data = b""
        ended = False
        try:
            # One reader at a time, so that bytes come out in order (the link
            # keeps one call that polls in flight; this holds if it did not).
            if sock is not None and self._reading.acquire(timeout=max(0.0, wait)):
                try:
                    data = _read_some(sock, deadline)
                    ended = not data and _closed(sock)
                finally:
                    self._reading.release()
        finally:
            with self.changed:
                if sock is not None:
                    self._done_with()
                self.eof = self.eof or ended
                ended = self.eof or self.released
        return data if not self.released else b"", ended

    def finished(self) -> None:
        with self.changed:
            if self.sock is None:
                self.eof = True  # the rank ended before it connected: it never will
                self.changed.notify_all()

    def release(self) -> None:
        with self.changed:
            self.released = True
            self.changed.notify_all()
            sock = self.sock
            if sock is not None:
                # The rank's receive() ends and its send() fails, as when a local
                # supervisor closes its end; a call blocked on the socket returns.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                if self._using == 0:
                    sock.close()


def _send_now(sock: socket.socket, data: memoryview) -> int:
    """Send what the socket takes without waiting; return how much that was.

    Raises:
        OSError: The rank's end is closed.
    """
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
    return sent


def _read_some(sock: socket.socket, deadline: float) -> bytes:
    """What the socket holds once something comes (until ``deadline``), up to COLLECT_BYTES.

    b"" when nothing came, or at the end of the stream (see :func:`_closed`).
    """
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        return b""
    pieces = []
    size = 0
    while size < COLLECT_BYTES:
        try:
            piece = sock.recv(COLLECT_BYTES - size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def _closed(sock: socket.socket) -> bool:
    """True if the stream has ended: the peer closed, or the socket was shut down."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


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
        self._connections: dict[str, _Connection] = {}
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

    def _connection(self, key: str) -> _Connection | None:
        with self._lock:
            if key in self._released:
                return None
            return self._connections.setdefault(key, _Connection())

    def _prune(self, key: str) -> None:
        # Under the lock. A queue nobody waits on and that holds nothing is
        # recreated on demand.
        queue = self._signals.get(key)
        if queue is not None and not queue and not self._waiting.get(key):
            del self._signals[key]
            self._waiting.pop(key, None)
