"""The supervisor's end of a Ray rank's channel (see ``_core._backend.Link``), through its board.

The frames of a Ray rank's channel pass through the board on the rank's node
(see ``_relay`` for the picture). Here, on the event loop:
:meth:`RayLink.write_some` submits each piece of the frame stream as one
``board.deliver`` and counts it as written once submitted, as bytes are once a
socket takes them; at most :data:`IN_FLIGHT` deliveries (:data:`WINDOW` bytes)
are on their way, so a rank that does not read holds the supervisor's
``send()`` as a full socket would. :meth:`RayLink.receive_frame` keeps one
call in flight that returns what the rank sends (a long poll): a
``board.collect``, or a small delivery that polls once it has written (one
actor call for a request and its answer). Calls are only submitted on the loop
(each carries at most ``_relay.CHUNK`` bytes, in one argument: Ray sends one
faster than several); their results are waited on through their futures
(``_bridge``).

When the rank's ``run()`` has finished, the link tells the board (a rank that
never connected ends its stream at once; one that did ends it when its
socket closes, which the kernel does for a killed rank) and pulls the stream
to its end on its own, so that what the rank sent before it exited stays
receivable: the rank's exit waits for :attr:`RayLink.drained`.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from typing import Any

import anyio
from anyio.lowlevel import checkpoint

from aiospawn._rank.reader import FrameReader
from aiospawn._rank.wire import FROM_RANK, HEADER

from ._board import ENDED, WRITTEN
from ._bridge import threadsafe
from ._connection import COLLECT_BYTES
from ._relay import CHUNK, TAKE_WAIT

#: Deliveries a link keeps in flight at most, and the bytes they carry.
IN_FLIGHT = 8
WINDOW = 2 * CHUNK
#: The largest piece that carries the next poll, and the seconds a link waits
#: for a send to carry it before it submits a collect of its own.
POLL_PIECE = 64 * 1024
POLL_GRACE = 0.002


class RayLink:
    """One Ray rank attempt's frames (``_core._backend.Link``), carried by the group's board.

    Made with the attempt, on the event loop; live once :meth:`attach` is given
    the rank's ``run()`` future.
    """

    #: Frames carry no memfds: the board moves bytes (large buffers stay in the pickle,
    #: and Ray's object store carries the large pieces).
    shares_memory = False

    def __init__(self, key: str) -> None:
        self._board: Any = None
        self._token = ""
        self._key = key
        self._poke_soon = threadsafe(self._poke)
        self._changed = anyio.Event()
        self._run: Future[Any] | None = None
        self._closed = False
        # Incoming: chunks pulled and not yet parsed, the frame being parsed.
        self._pulled: collections.deque[memoryview] = collections.deque()
        self._reader = FrameReader(FROM_RANK)
        self._pull: Future[Any] | None = None  # the call that brings what the rank sends
        self._pull_skip = 0  # bytes before a collect's answer in the pull's result
        self._more_waiting = False  # the last pull came back full
        self._send_came = anyio.Event()  # a delivery that polls was submitted
        self._ended = False  # the board said the upward stream is over
        self._end_asked = False
        self.drained = anyio.Event()  #: set once nothing more can come from the rank
        # Outgoing: pieces not yet submitted; deliveries in flight, with their sizes.
        self._out: collections.deque[bytes | memoryview] = collections.deque()
        self._queued = 0
        self._flights: collections.deque[tuple[Future[Any], int]] = collections.deque()
        self._in_flight = 0
        self._seq = 0  # the number of the next delivery: the board writes them in order
        self._refused = False  # a delivery was refused: the rank's end is closed

    def attach(self, run: Future[Any], board: Any, token: str) -> None:
        """The rank's ``run()`` was submitted: its end ends the channel. On the loop.

        Args:
            run: The future of the rank's ``run()``.
            board: The board on the rank's node, which holds the board's end.
            token: The group's token, which the board asks of every call.
        """
        self._board, self._token = board, token
        self._run = run
        run.add_done_callback(lambda _: self._poke_soon())
        self._poke()

    # ------------------------------------------------------------- incoming

    async def receive_frame(self) -> tuple[int, bytes | bytearray] | None:
        """The next frame, or None at the end of the stream; cancellation-safe.

        Raises:
            FrameError: The rank sent a header that breaks the format.
        """
        deferred = False
        while True:
            changed = self._changed
            frame = self.frame_now()
            if frame is not False:
                assert frame is not True
                return frame
            if self._pull is None and not deferred:
                # The answer to what the rank just sent often comes with the
                # next send: that delivery carries the next poll (one actor
                # call for a round trip, where a collect of our own would add
                # one), unless none comes within POLL_GRACE. Not when the
                # last poll came back full: more is waiting.
                deferred = True
                if not self._more_waiting:
                    self._send_came = anyio.Event()
                    with anyio.move_on_after(POLL_GRACE):
                        await self._send_came.wait()
                else:
                    await checkpoint()
                continue
            self._pull_more()
            await changed.wait()

    def frame_now(self) -> tuple[int, bytes | bytearray] | bool | None:
        """The next frame if it can be read without waiting; None at the end, else False.

        Raises:
            FrameError: The rank sent a header that breaks the format.
        """
        while True:
            if self._closed:
                return None
            frame = self._parse()
            if frame is not None:
                return frame
            if self._pull is not None and self._pull.done():
                self._take_pull()
                continue
            if self._ended:
                return None
            return False

    def _parse(self) -> tuple[int, bytes | bytearray] | None:
        reader = self._reader
        while self._pulled:
            head = self._pulled[0]
            taken = min(reader.wanted, len(head))
            reader.feed(head[:taken])
            if taken == len(head):
                self._pulled.popleft()
            else:
                self._pulled[0] = head[taken:]
            frame = reader.frame()
            if frame is not None:
                self._reader = FrameReader(FROM_RANK)
                return frame
        return None

    def _pull_more(self) -> None:
        if self._pull is None and not (self._ended or self._closed) and self._run is not None:
            self._pull = self._call("collect", f"{self._token} {self._key} {TAKE_WAIT}")
            self._pull_skip = 0

    def _take_pull(self) -> None:
        pull, self._pull = self._pull, None
        assert pull is not None
        try:
            answer = memoryview(pull.result())[self._pull_skip :]
        except Exception:  # the board is gone: its node, or the group, is gone
            answer = memoryview(ENDED)
        ended = answer[:1] == ENDED
        if len(answer) > 1:
            self._pulled.append(answer[1:])
        self._more_waiting = len(answer) > COLLECT_BYTES
        if ended:
            self._ended = True

    # ------------------------------------------------------------- outgoing

    def queue_frame(self, kind: int, payload: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        """Add a frame, whole, to the outgoing queue (in chunks of at most ``CHUNK`` bytes).

        The frame's payload is ``prefix`` then ``payload``; past the first
        chunk, ``payload`` is queued as views of itself, never copied.
        """
        assert fd < 0, "a Ray rank's frames carry no descriptors"
        view = memoryview(payload)
        head = HEADER.pack(kind, len(prefix) + len(payload)) + prefix
        first = CHUNK - len(head)
        self._out.append(head + bytes(view[:first]))
        for start in range(first, len(view), CHUNK):
            self._out.append(view[start : start + CHUNK])
        self._queued += len(head) + len(payload)

    @property
    def queued(self) -> int:
        """Bytes queued and not yet handed to Ray (a full window holds them here)."""
        return self._queued

    def write_some(self) -> bool:
        """Submit what the window takes now; True once everything queued is submitted.

        A piece counts as written once submitted, as bytes do once a socket
        takes them: up to :data:`IN_FLIGHT` deliveries (and :data:`WINDOW`
        bytes) may wait in Ray and in the board, which writes them in order.

        Raises:
            BrokenPipeError: The channel was released, a delivery was refused
                (the rank's end is closed), or the rank has ended with frames
                still to go.
        """
        if self._closed:
            raise BrokenPipeError("the channel was released")
        flights = self._flights
        for flight in [flight for flight in flights if flight[0].done()]:
            # Any order: a delivery that polls stays in flight until the rank sends.
            flights.remove(flight)
            push, size = flight
            self._in_flight -= size
            try:
                taken = push.result()[:1] == WRITTEN
            except Exception:  # the board is gone: its node, or the group, is gone
                taken = False
            if not taken:
                self._refused = True
        if self._refused:
            raise BrokenPipeError(f"the channel of rank attempt {self._key} is closed")
        if flights and self._over():
            # Nobody takes them: the rank's end is closed.
            raise BrokenPipeError(f"rank attempt {self._key} has ended")
        if self._run is None:
            return not self._out  # not started yet: attach() wakes the writer
        while self._out and len(flights) < IN_FLIGHT and self._in_flight < WINDOW:
            if self._run.done():
                raise BrokenPipeError(f"rank attempt {self._key} has ended")
            chunk = self._out.popleft()
            # A small piece carries the next poll if none is out (see receive_frame).
            poll = self._pull is None and len(chunk) <= POLL_PIECE and not self._ended
            wait = TAKE_WAIT if poll else 0
            head = f"{self._token} {self._key} {self._seq} {wait}\n".encode("ascii")
            submitted = self._call("deliver", head + chunk)
            if submitted is None:
                raise BrokenPipeError("Ray is shut down")
            self._seq += 1
            flights.append((submitted, len(chunk)))
            if poll:
                self._pull, self._pull_skip = submitted, len(WRITTEN)
                self._send_came.set()
            self._in_flight += len(chunk)
            self._queued -= len(chunk)
        return not self._out

    async def wait_writable(self) -> None:
        """Wait until a delivery in flight is answered (or the rank has ended)."""
        changed = self._changed
        if (
            not self._flights
            or self._flights[0][0].done()
            or self._closed
            or self._over()
            or (
                self._run is not None
                and len(self._flights) < IN_FLIGHT
                and self._in_flight < WINDOW
            )
        ):
            await checkpoint()
            return
        await changed.wait()

    def _over(self) -> bool:
        # The rank's run() has finished and its stream has been read to the
        # end since: a delivery still unanswered was not taken before the end.
        return self._run is not None and self._run.done() and self.drained.is_set()

    # ------------------------------------------------------------- both

    def stop_draining(self) -> None:
        """Give up on what the board still holds from the ended rank (Ray does not answer)."""
        if self.drained.is_set():
            return
        self._ended = True
        self.drained.set()
        self._poke()

    def close(self) -> None:
        """Release the channel here and on the board, waking a task that waits on it."""
        if self._closed:
            return
        self._closed = True
        self._out.clear()
        self._pulled.clear()
        self._queued = 0
        if self._run is not None:
            self._submit("release")
        self._poke()

    def _submit(self, method: str) -> Future[Any] | None:
        """Submit a board call about this attempt (does not wait); its end wakes the link."""
        return self._call(method, self._token, self._key)

    def _call(self, method: str, *args: Any) -> Future[Any] | None:
        """Submit a board call (does not wait); its end wakes the link."""
        try:
            ref = getattr(self._board, method).remote(*args)
        except Exception:  # Ray is shut down: nothing will answer
            self._ended = True
            return None
        future: Future[Any] = ref.future()
        future.add_done_callback(lambda _: self._poke_soon())
        return future

    def _poke(self) -> None:
        """Something changed (a call ended, the rank ended): wake the waiters. On the loop."""
        changed, self._changed = self._changed, anyio.Event()
        changed.set()
        run = self._run
        if run is None or not run.done() or self.drained.is_set():
            return
        # The rank has ended: pull what it relayed to the end, on our own.
        if not self._end_asked and not self._closed:
            self._end_asked = True
            self._submit("finished")
        if self._pull is not None and self._pull.done():
            self._take_pull()
        if self._ended or self._closed:
            self.drained.set()
        else:
            self._pull_more()
