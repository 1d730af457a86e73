"""One frame reassembled from what was read, its header checked before its payload.

:class:`FrameReader` takes a frame's bytes in chunks of any size, refuses a
header the receiving end does not take (``wire.FROM_RANK``,
``wire.TO_RANK``) before any of its payload, and maps a shared frame's memfd
(``buffers``) as the frame completes. A channel's ``stream.FrameStream``
reads each frame through one; the supervisor reads a local rank's outcome
pipe (``aiospawn._local._rank``) and a Ray rank's frames
(``aiospawn.ray._link``) with it too.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import os

from .buffers import LAYOUT, SHARED, map_shared
from .wire import HEADER, MAX_FRAME_BYTES, SHARED_KINDS, FrameError, Link

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .wire import Payload

#: Each kind's name, for the error of a frame that breaks the format.
_LINK_NAMES = {
    Link.MESSAGE: "MESSAGE",
    Link.READY: "READY",
    Link.CALL: "CALL",
    Link.REPLY: "REPLY",
    Link.CLOSE: "CLOSE",
    Link.CANCEL: "CANCEL",
    Link.RELEASED: "RELEASED",
    Link.TAKEN: "TAKEN",
}


class FrameReader:
    """Reassembles one frame from the chunks read off the pipe.

    The payload grows in one buffer as chunks come, so that a large frame is
    never copied whole in one step (a join at its end, or zero-filling a
    buffer of its full size up front): the reader runs on the event loop.

    Args:
        sizes: The kinds this reader accepts, each with its payload's bounds
            (``wire.FROM_RANK``, ``wire.TO_RANK``); ``None`` accepts any frame
            (the outcome frame, whose size only the rank's result bounds).
        shared: Frames may carry a memfd (``buffers.SHARED``), mapped as they complete.
        release: Called with a pooled segment's token once its mapping is
            gone (a rank's reader: see ``buffers.map_shared``); None refuses
            pooled segments (the supervisor's reader).
    """

    def __init__(
        self,
        sizes: dict[int, tuple[int, int | None]] | None = None,
        shared: bool = False,
        release: Any = None,
    ) -> None:
        self._sizes = sizes
        self._shared = shared
        #: Called with a pooled segment's token once its mapping is gone
        #: (``buffers.map_shared``); None refuses pooled segments.
        self._release = release
        self._header = bytearray()
        self._kind: int | None = None
        self._size = 0
        self._payload = bytearray()
        #: Descriptors received with this frame's bytes (-1: some were refused).
        self._fds: list[int] = []

    @property
    def complete(self) -> bool:
        """True once the whole frame has been fed."""
        return self._kind is not None and len(self._payload) >= self._size

    @property
    def started(self) -> bool:
        """True once any of the frame's bytes have been fed."""
        return self._kind is not None or bool(self._header)

    @property
    def at_header(self) -> bool:
        """True while the header is incomplete: the frame's descriptor comes with it."""
        return self._kind is None

    @property
    def wanted(self) -> int:
        """How many more bytes the frame needs (an upper bound before the header)."""
        if self._kind is None:
            return HEADER.size - len(self._header)
        return self._size - len(self._payload)

    def feed(self, data: bytes | memoryview) -> None:
        """Add bytes read from the pipe (at most :attr:`wanted` at a time).

        Raises:
            FrameError: The header completed by ``data`` is not one this reader
                accepts; the reader takes nothing more.
        """
        view = memoryview(data)
        if self._kind is None:
            taken = HEADER.size - len(self._header)
            self._header += view[:taken]
            view = view[taken:]
            if len(self._header) < HEADER.size:
                return
            kind, size = HEADER.unpack(self._header)
            if self._sizes is not None:
                self._check(kind, size)
            self._kind, self._size = kind, size
        self._payload += view

    def add_fds(self, fds: list[int]) -> None:
        """Descriptors that came with this frame's bytes; the reader closes them."""
        self._fds.extend(fds)

    def discard(self) -> None:
        """Close the descriptors of a frame that will never complete (the stream ended)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def check(self, kind: int, size: int) -> None:
        """Refuse a header this reader would refuse (see :meth:`feed`).

        Raises:
            FrameError: It breaks the format.
        """
        if self._sizes is not None:
            self._check(kind, size)

    def _check(self, kind: int, size: int) -> None:
        assert self._sizes is not None
        base = kind & ~SHARED
        if kind & SHARED and self._shared and base in SHARED_KINDS and base in self._sizes:
            start = SHARED_KINDS[base]
            if size < start + LAYOUT.size:
                raise FrameError(f"a shared frame of {size} bytes, too short for its layout")
            kind = base
        bounds = self._sizes.get(kind)
        if bounds is None:
            raise FrameError(
                f"a frame of unknown kind {kind} (its header: {HEADER.pack(kind, size).hex(' ')})"
            )
        low, high = bounds
        name = _LINK_NAMES[kind]
        if high == 0 and size != 0:
            raise FrameError(f"a {name} frame of {size} bytes (a {name} frame is empty)")
        if high == low and size != low:
            what = {Link.RELEASED: "token", Link.TAKEN: "kind"}.get(kind, "call id")
            raise FrameError(
                f"a {name} frame of {size} bytes (a {name} frame is its {low}-byte {what})"
            )
        if size < low:
            raise FrameError(f"a {name} frame of {size} bytes, shorter than its {low}-byte call id")
        if size > (MAX_FRAME_BYTES if high is None else high):
            raise FrameError(
                f"a {name} frame of {size} bytes, more than a channel frame carries"
                f" ({MAX_FRAME_BYTES} bytes)"
            )

    def frame(self) -> tuple[int, bytes | bytearray] | None:
        """Return ``(kind, payload)`` once complete, else ``None``.

        The payload is the reader's own buffer, not a copy.
        """
        if not self.complete:
            return None
        assert self._kind is not None
        return self._kind, self._payload

    def shared_frame(self) -> tuple[int, Payload] | None:
        """:meth:`frame`, for a reader that takes descriptors (``shared``).

        A shared frame's payload is a ``buffers.Mapped`` (its memfd mapped,
        its descriptor closed), and its kind loses the ``SHARED`` flag.

        Raises:
            FrameError: A shared frame without a descriptor (or with a layout
                or memfd a sender does not make), or a frame with one it
                should not have. Every descriptor that came is closed.
        """
        if not self.complete:
            return None
        kind = self._kind
        assert kind is not None
        fds, self._fds = self._fds, []
        if not kind & SHARED:
            if fds:
                self._fds = fds
                self.discard()
                raise FrameError(f"a {_name(kind)} frame that came with a descriptor")
            return kind, self._payload
        try:
            if len(fds) != 1 or fds[0] < 0:
                count = "too many" if -1 in fds else len(fds)
                raise FrameError(
                    f"a shared {_name(kind & ~SHARED)} frame that came with {count}"
                    " descriptor(s), not one"
                )
            try:
                mapped = map_shared(
                    self._payload, SHARED_KINDS[kind & ~SHARED], fds[0], self._release
                )
            except (ValueError, OSError) as exc:
                raise FrameError(f"a broken shared {_name(kind & ~SHARED)} frame: {exc}") from None
        finally:
            self._fds = fds
            self.discard()
        return kind & ~SHARED, mapped


def _name(kind: int) -> str:
    return _LINK_NAMES.get(kind, f"kind {kind}")
