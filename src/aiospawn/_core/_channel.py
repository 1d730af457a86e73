"""The supervisor's end of a rank's channel, as users hold it: :class:`RankChannel`.

Each attempt at a rank has one ``Conversation`` (``_conversation``) over one
``Link`` (the backend's frame transport, ``_backend.Link``: a socket pair for
local ranks), and users hold its thin public handle, :class:`RankChannel`,
which the conversation makes and which only forwards to it. A restarted rank
gets a new channel; the old one ends with its attempt, so nothing meant for a
dead attempt reaches its successor.

Imports anyio and the standard library only: ``_conversation`` imports this
module, and is known here by what a channel asks of it (:class:`_Conversation`).
"""

from __future__ import annotations

from typing import Any, Protocol, final

import anyio.abc


class _Conversation(Protocol):
    """What a channel asks of the conversation it fronts, ``_conversation.Conversation``."""

    @property
    def rank(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    async def send(self, item: Any) -> None: ...

    async def receive(self) -> Any: ...

    async def send_eof(self) -> None: ...

    async def aclose(self) -> None: ...

    def summary(self) -> str: ...


@final
class RankChannel(anyio.abc.ObjectStream[Any]):
    """The supervisor's end of one rank's channel, from ``ctx.channel(rank)``.

    An anyio object stream: ``await send(obj)``, ``await receive()``,
    ``async for``, ``send_eof()``, ``aclose()``, ``async with``. Objects are
    pickled. The rank's end is ``aiospawn.channel()``. One channel per attempt
    at the rank: after a restart, ``ctx.channel(rank)`` is a new one.
    """

    def __init__(self, token: object, conversation: _Conversation) -> None:
        if token is not _CONSTRUCT:
            raise TypeError("a RankChannel is made by ctx.channel(rank)")
        self._conversation = conversation

    @classmethod
    def _of(cls, conversation: _Conversation) -> RankChannel:
        return cls(_CONSTRUCT, conversation)

    @property
    def rank(self) -> int:
        """The rank at the other end."""
        return self._conversation.rank

    @property
    def ready(self) -> bool:
        """True once the supervisor has seen the rank's ``aiospawn.ready()``."""
        return self._conversation.ready

    async def send(self, item: Any) -> None:
        """Send ``item`` to the rank: its ``aiospawn.channel().receive()`` returns it.

        Waits while the rank does not read and more than 256 KiB wait to be
        written to it.

        Raises:
            TypeError: ``item`` cannot be pickled (its pickling raised, even
                ``SystemExit``: that is the cause).
            ValueError: ``item`` pickles to more than a frame carries (1 GiB).
            anyio.ClosedResourceError: :meth:`aclose` or :meth:`send_eof` was called.
            ProcessException: The rank has failed (exited badly, was killed or
                stopped, or broke its channel).
            anyio.BrokenResourceError: The rank has ended successfully, or closed its end.

        Cancellation:
            Safe: the message is queued whole or not at all. Once queued it is
            delivered, even if the task is cancelled while it is written.
        """
        await self._conversation.send(item)

    async def receive(self) -> Any:
        """Wait for the rank's next message and return it.

        Raises:
            anyio.EndOfStream: The rank closed its end (``close()``) or
                returned, and every message it sent has been received.
            ProcessException: The rank failed (raised, exited badly, was
                killed or stopped) with no message left to receive; or it
                broke its channel (a frame that is not aiospawn's).
            pickle.UnpicklingError: The next message cannot be unpickled here
                (its cause is what its unpickling raised, ``SystemExit``
                included). That message is dropped: the next ``receive()``
                gets the one after it.
            anyio.ClosedResourceError: :meth:`aclose` was called.

        Cancellation:
            Safe: a message is either returned (or its error raised) or stays
            first in line.
        """
        return await self._conversation.receive()

    async def send_eof(self) -> None:
        """Tell the rank nothing more comes: its ``receive()`` raises ``EOFError``.

        The rank's messages can still be received, and its calls answered.
        """
        await self._conversation.send_eof()

    async def aclose(self) -> None:
        """Close this end: the rank's ``receive()`` ends, its ``send()`` fails.

        Idempotent. Messages not yet received are dropped.
        """
        await self._conversation.aclose()

    def __repr__(self) -> str:
        return f"<RankChannel rank={self.rank}{self._conversation.summary()}>"


_CONSTRUCT = object()
