"""What a rank's own code calls: heartbeats, its restart count, readiness, its channel.

Each rank attempt fills in this module's state with :func:`begin` before
``fn`` runs (a local rank in ``process.prepare``, a Ray rank in its actor),
says which event loop an ``async def fn`` runs on with :func:`use_loop`, and
ends the channel with :func:`end`: nothing else sets it. Outside a rank,
:func:`heartbeat`, :func:`ready` and :func:`restart_count` are harmless
no-ops; :func:`channel` and :func:`serve` raise, since there is nobody to
talk to.
Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import contextlib
import time

from .channel import Channel, encode
from .frames import Frames, finish
from .wire import Link

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .async_channel import AsyncChannel

_restart = 0
_beat: memoryview | None = None
#: The rank's end of its channel, and the event loop an ``async def fn`` runs on.
_frames: Frames | None = None
_loop: str | None = None
_channel: Channel | AsyncChannel | None = None
_ready = False


def begin(*, restart: int, frames: Frames | None, beat: memoryview | None = None) -> None:
    """Start a rank attempt's state afresh: nothing of a parent rank's survives a fork.

    Args:
        restart: The attempt's restart count.
        frames: The rank's end of its channel, or None without one.
        beat: The rank's heartbeat slot, or None when the group watches no heartbeats.
    """
    global _restart, _beat, _frames, _loop, _channel, _ready
    _restart, _beat, _frames = restart, beat, frames
    _loop, _channel, _ready = None, None, False


def use_loop(loop: str) -> None:
    """``fn`` is an ``async def`` on ``loop`` (``"asyncio"`` or ``"trio"``): awaited channel."""
    global _loop
    _loop = loop


def end(patience: float) -> None:
    """At the attempt's end: send what cancelled sends left (for ``patience`` s), and close."""
    finish(_frames, patience)


def restart_count() -> int:
    """How many times this rank has been restarted: 0 in its first run.

    Called in a rank of an aiospawn group. A rank resuming from a checkpoint
    can use it to tell its first run from a restart; the same number is in
    the ``AIOSPAWN_RESTART_COUNT`` environment variable. Outside a rank: 0.
    """
    return _restart


def heartbeat() -> None:
    """Tell the supervisor this rank is making progress.

    Cheap enough for a tight loop (one clock read and one store into memory
    shared with the supervisor, about 0.1 microseconds) and safe from any
    thread. Outside a rank, or when the group has neither
    ``heartbeat_timeout`` nor ``startup_timeout``, it does nothing.
    """
    beat = _beat
    if beat is not None:
        beat[0] = time.monotonic_ns()


def ready(payload: Any = None) -> None:
    """Tell the supervisor this rank is ready to serve, with an optional small payload.

    Call it once the rank can do its work (a model loaded, a port bound). The
    supervisor's ``await ctx.wait_ready()`` returns every rank's ``payload``
    (a port number, a shared-memory name: anything picklable) in rank order.
    Only the first call of an attempt counts; later ones do nothing. Works
    in sync and async ranks; it waits only while the channel is full (in an
    async rank, blocking its loop meanwhile). It counts as a heartbeat: a
    ready rank has started, whatever the group's ``startup_timeout``.
    Outside a rank it does nothing.

    Raises:
        TypeError: ``payload`` cannot be pickled.
        ValueError: ``payload`` pickles to more than a channel frame carries (1 GiB).
    """
    global _ready
    frames = _frames
    if frames is None or _ready:
        return
    data = encode(payload)
    # Startup is over: without this beat, a rank that is ready and serving
    # (and never beats) would be found hung once startup_timeout passed.
    heartbeat()
    _ready = True
    with frames.sending, contextlib.suppress(BrokenPipeError):  # (the supervisor closed it)
        frames.queue(Link.READY, data)
        frames.flush()


def channel() -> Any:
    """This rank's channel to its supervisor.

    In a sync rank, a :class:`~aiospawn._rank.channel.Channel` with blocking
    ``send(obj)``, ``receive()``, iteration and ``close()``; in an
    ``async def fn``, an :class:`~aiospawn._rank.async_channel.AsyncChannel` whose
    methods are awaited (``async for`` iterates). ``receive()`` raises
    ``EOFError`` once the supervisor has closed its end and every message
    was received. The supervisor's end is ``ctx.channel(rank)``.

    Raises:
        RuntimeError: Not called in a rank of an aiospawn group (or on a
            backend without channels).
    """
    global _channel
    if _channel is None:
        if _frames is None:
            raise RuntimeError("aiospawn.channel() is called in a rank of an aiospawn group")
        if _loop is None:
            _channel = Channel(_frames)
        else:  # an async def fn: only its rank imports the awaited channel
            from .async_channel import AsyncChannel

            _channel = AsyncChannel(_frames, _loop)
    return _channel


def serve(handler: Any, *, limit: int | None = None) -> Any:
    """Answer the supervisor's ``ctx.call(method, ...)`` with ``handler.method(...)``.

    Serves until the supervisor closes the channel (an ``async with
    open_group(...)`` block closes it when it ends); then returns, once the
    calls under way have answered. Public methods only (a name starting with
    ``_`` is refused). A method that raises an ``Exception`` sends it back to
    the caller, and the rank goes on serving; one that raises anything else
    (``SystemExit``, ``KeyboardInterrupt``) ends ``serve()`` with it.
    Messages sent with ``ctx.channel(rank).send()`` meanwhile wait for the
    rank's ``receive()``.

    In a sync rank ``serve(handler)`` blocks and answers one call at a time,
    in order. A call the supervisor gives up on (cancelled, or past its
    ``timeout=``) before the rank starts it is dropped unrun; a handler that
    runs cannot be interrupted: it runs to its end, its answer is dropped,
    and the next call waits behind it.

    In an async rank, ``await aiospawn.serve(handler)``: the methods may be
    sync or ``async def``, and each call runs in a task of its own, so calls
    overlap. When the supervisor gives up on a call, its task is cancelled
    (its ``finally`` blocks run) and it answers nothing. A sync method runs on
    the rank's loop and holds it until it returns. If the task that awaits
    ``serve()`` is cancelled (SIGTERM does), every call under way is
    cancelled first.

    Args:
        handler: The object whose public methods answer calls.
        limit: In an async rank, the most calls that run at once; later ones
            wait in the order they came (``limit=1``: one at a time, as in a
            sync rank, for handlers that must not overlap, such as ones that
            run collectives in the same order on every rank). None: no limit.
            A sync rank serves one call at a time whatever it says.

    Raises:
        RuntimeError: Not called in a rank of an aiospawn group.
        TypeError: ``limit`` is not an int.
        ValueError: ``limit`` is below 1.
    """
    return channel().serve(handler, limit=limit)
