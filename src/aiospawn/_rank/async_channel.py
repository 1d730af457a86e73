"""A rank's end of its channel in an ``async def fn``: awaited, on the rank's own event loop.

:class:`AsyncChannel` is what ``aiospawn.channel()`` returns in an async rank:
the blocking ``channel.Channel``'s calls, awaited, over the same
``frames.Frames``, which waits on the socket through the loop the rank runs
(asyncio's readers and writers, or trio's ``wait_readable``). Imported only by
a rank whose ``fn`` is an ``async def`` (see ``api.channel``).

Cancellation: a frame is queued whole before its first byte is written. A
task cancelled while the socket is full leaves the rest of its frame queued;
it goes out before anything sent after it, and at the latest when the rank
ends. A cancelled ``receive()`` loses nothing: a frame read in part stays in
the reader until the next one.

Part of the rank-side package: standard library only. The event loop is the
one the rank runs (``async_main``), imported by it.
"""

from __future__ import annotations

from .async_serve import Calls, serve_asyncio, serve_trio
from .channel import check_limit, decode, pack
from .wire import Link

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import collections
    from collections.abc import AsyncIterator
    from typing import Any

    from .frames import Frames
    from .wire import Payload


class AsyncChannel:
    """The rank's end of its channel, in an ``async def fn``: awaitable calls.

    Get it with ``aiospawn.channel()``. One task at a time may send, and one
    may receive (or serve); a second gets RuntimeError.
    """

    def __init__(self, frames: Frames, loop: str) -> None:
        self._frames = frames
        self._loop = loop
        self._sender: object | None = None
        self._receiver: object | None = None
        self._writing: Any = None  # the loop's Lock, made on first use

    async def send(self, obj: Any) -> None:
        """Send ``obj`` to the supervisor; waits while the channel is full.

        Raises:
            TypeError: ``obj`` cannot be pickled.
            ValueError: ``obj`` pickles to more than a frame carries (1 GiB).
            OSError: The channel was closed by this rank.

        Cancellation:
            The message is queued whole before it is written: if the task is
            cancelled meanwhile, what is left of it still goes out, first.
        """
        packed = pack(obj, self._frames.shares_memory)
        try:
            self._claim("_sender", "send")
        except BaseException:
            packed.close()
            raise
        try:
            self._frames.queue_packed(Link.MESSAGE, packed)
            await self._flush()
        finally:
            self._sender = None

    async def receive(self) -> Any:
        """Wait for the next message from the supervisor and return it.

        Raises:
            EOFError: The supervisor closed its end and every message was received.
            pickle.UnpicklingError: The next message cannot be unpickled here
                (its cause says why); it is dropped, and the next call gets the
                one after it.
            OSError: The channel was closed by this rank.
        """
        self._claim("_receiver", "receive")
        try:
            payload = await self._next(self._frames.messages)
        finally:
            self._receiver = None
        return decode(payload, "a message from the supervisor")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Any]:
        while True:
            try:
                message = await self.receive()
            except EOFError:
                return
            yield message

    async def serve(self, handler: Any, *, limit: int | None = None) -> None:
        """Answer the supervisor's calls with ``handler``'s methods (sync or async) until closed.

        Each call runs in a task of its own, at most ``limit`` at once (None:
        no limit); a call the supervisor cancels is cancelled here. See
        ``async_serve`` and ``aiospawn.serve``.
        """
        check_limit(limit)
        self._claim("_receiver", "serve")
        try:
            calls = Calls(self._frames, self._next_request, self._flush, handler, limit)
            await (serve_trio(calls) if self._loop == "trio" else serve_asyncio(calls))
        finally:
            self._receiver = None

    async def aclose(self) -> None:
        """Tell the supervisor nothing more comes (its ``receive()`` ends), and close."""
        if not self._frames.closed:
            self._frames.queue(Link.CLOSE, b"")
            await self._flush()
            self._frames.close()

    def _claim(self, role: str, what: str) -> None:
        if getattr(self, role) is not None:
            raise RuntimeError(f"another task is already waiting in {what}() on this channel")
        setattr(self, role, object())

    async def _flush(self) -> None:
        if self._frames.write_some():
            return
        # One task at a time waits for the socket: a sender and serve()'s
        # replies can both be flushing, and two waiters on one fd are refused
        # by trio (BusyResourceError) and, in asyncio, the second add_writer()
        # replaces the first one's callback, which is then never woken. The
        # task that waits writes every queued frame, the others' too.
        if self._writing is None:
            if self._loop == "trio":
                import trio

                self._writing = trio.Lock()
            else:
                import asyncio

                self._writing = asyncio.Lock()
        async with self._writing:
            while not self._frames.write_some():
                await self._wait(write=True)

    async def _next(self, kept: collections.deque[Payload]) -> Payload:
        frames = self._frames
        while True:
            frames._check_open()
            if frames.unsent and self._sender is None:
                await self._flush()  # what a cancelled send left, first
            frame = frames.take(kept)
            if frame is not None:
                return frame
            await self._wait(write=False)

    async def _next_request(self, busy: bool) -> tuple[int, int | Payload]:
        """``(CANCEL, call id)`` or ``(CALL, frame)``: what ``serve()`` takes next.

        Cancellations first, those read with a call too: each names a call
        taken before. ``busy``: calls are running, and their answers will
        write what a cancelled send left.

        Raises:
            EOFError: The supervisor closed its end, and nothing is left to take.
            ConnectionError: A frame broke the channel's format, and nothing is left.
        """
        frames = self._frames
        while True:
            frames._check_open()
            if frames.unsent and self._sender is None and not busy:
                await self._flush()  # what a cancelled send left, first
            if not (frames.cancels or frames.calls):
                frames.read_some()
            if frames.cancels:
                return Link.CANCEL, frames.cancels.popleft()
            if frames.calls:
                return Link.CALL, frames.pop(frames.calls)
            if frames.peer_closed:
                raise frames.end()
            await self._wait(write=False)

    async def _wait(self, write: bool) -> None:
        fd = self._frames.fd
        if self._loop == "trio":
            import trio

            await (trio.lowlevel.wait_writable if write else trio.lowlevel.wait_readable)(fd)
            return
        import asyncio

        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        if write:
            loop.add_writer(fd, wake)
        else:
            loop.add_reader(fd, wake)
        try:
            await woken
        finally:
            if write:
                loop.remove_writer(fd)
            else:
                loop.remove_reader(fd)
