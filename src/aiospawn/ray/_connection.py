"""One rank attempt's connection to its board: the rank's end of the socket, on the board.

The group's board (``_board.SignalBoard``) holds a :class:`Connection` per
attempt whose channel it carries: the Unix socket the rank connected, the
deliveries the supervisor writes to it in order (waiting while the rank
does not read: back-pressure), and the one read in progress, which returns
what the rank sent. Its calls run on the board's threads.

Imports only the standard library: it runs in the board's Ray worker.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

#: Bytes one ``collect`` returns at most.
COLLECT_BYTES = 4 * 1024 * 1024


class Connection:
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
