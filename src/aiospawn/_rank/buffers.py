"""Large buffers through shared memory: written once into a memfd, mapped by the receiver.

A message is pickled once, with protocol 5. Its out-of-band buffers (a numpy
array's data, a ``bytearray``, a ``pickle.PickleBuffer``, a CPU tensor's
bytes) of :data:`SHARED_BYTES` or more are not copied into the pickle: they
are written, one after another, into an anonymous memfd, and the frame that
carries the pickle carries the memfd's descriptor too (``SCM_RIGHTS`` over
the rank's Unix socket). The receiver maps the memfd privately
(copy-on-write) and unpickles with slices of the mapping as the buffers::

    sender:   pickle ─┬─► frame: kind|SHARED, [call id], layout, pickle ──┐
                      └─► memfd (buffers) ── fd ─► SCM_RIGHTS ─────────────┤
    receiver: recvmsg ─► frame + fd ─► mmap(MAP_PRIVATE) ─► pickle.loads(buffers=slices)
              ... last user gone ─► munmap ─► RELEASED(token) ─► sender   (pooled only)

The layout (:data:`LAYOUT`, then one :data:`SPAN` per buffer) says where each
buffer lies in the memfd. Smaller buffers, and every buffer where memfds or
descriptor passing are missing (not Linux, the Ray backend), stay in the
pickle as before.

Two kinds of memfd. A fresh one (:func:`pack`) is sealed against writes,
shrinking and growth once written: nobody can change it afterwards. A
*pooled* one, a segment the supervisor rewrites (``aiospawn._core._pool``,
:func:`new_segment`), is sealed against resizing only; its layout sets
:data:`POOLED` and names the segment's :data:`TOKEN`, and the receiver, once
its mapping is gone, hands the token to the ``release`` callback its reader
was given (a rank's channel sends a RELEASED frame). The sender rewrites a
segment only once every receiver has released it.

Value semantics: the receiver's mapping is private, so its writes are its
own. A page it has not written shows later writes to the file (Linux): a
fresh memfd has none, and a pooled segment is not rewritten while mapped. So
neither side ever sees the other's later writes. The memory is the kernel's
until the last descriptor and the last mapping go: the sender closes the
descriptors of a fresh memfd once the frame is written (the pool keeps its
segments' until the group ends), the receiver as soon as it has mapped the
memfd, and the mapping goes with the last object that uses it. Nothing has a
name, so nothing outlives both processes.

Torch CPU tensors (only if the program imported torch: pickling never
imports it) are pickled as their bytes, an out-of-band buffer (``tensors``),
and rebuilt with ``torch.frombuffer``; anything else keeps torch's own
pickling.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys

from .tensors import TensorPickler

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: An out-of-band buffer this large or larger travels through shared memory;
#: smaller ones are copied into the pickle, which costs less than a memfd's
#: set-up and its page faults.
SHARED_BYTES = 1 << 20

#: The flag in a frame's kind byte that says its payload holds a layout and
#: its descriptor carries the memfd.
SHARED = 0x80

#: A shared frame's layout: the number of buffers (with :data:`POOLED` set
#: if a :data:`TOKEN` follows) ...
LAYOUT = struct.Struct("!I")
#: The bit of the layout's first word that says the memfd is one of the
#: supervisor's reused segments, named by the :data:`TOKEN` after the word.
POOLED = 1 << 31
#: What the receiver of a pooled segment sends back (a RELEASED frame) once
#: it has unmapped it: the segment's token.
TOKEN = struct.Struct("!Q")
#: ... then, for each, its offset in the memfd and its size in bytes.
SPAN = struct.Struct("!QQ")
#: The most buffers one message may name: it bounds what a layout makes a receiver build.
MAX_BUFFERS = 1 << 16

#: Each buffer starts at a multiple of this, so that any dtype is aligned.
_ALIGN = 64


def _available() -> bool:
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False
    import socket

    return hasattr(socket, "SCM_RIGHTS") and hasattr(socket, "MSG_CMSG_CLOEXEC")


#: True where memfds and descriptor passing exist (Linux).
AVAILABLE = _available()


class Packed:
    """A message ready for a frame: its body, and the memfd its buffers are in, if any.

    The holder closes :attr:`fd` (:meth:`close`) once the frame is queued: a
    queue keeps a copy of its own.
    """

    __slots__ = ("body", "fd", "prefix")

    def __init__(self, body: bytes, fd: int = -1, prefix: bytes = b"") -> None:
        #: The layout and the pickle, or the pickle alone when ``fd`` is -1.
        self.body = body
        #: The memfd, or -1.
        self.fd = fd
        #: What goes before the body in the frame (a reply's call id), kept
        #: apart so that a large body is never copied to be framed.
        self.prefix = prefix

    @property
    def flag(self) -> int:
        """:data:`SHARED` if the body holds a layout, else 0."""
        return SHARED if self.fd >= 0 else 0

    def prefixed(self, prefix: bytes) -> Packed:
        """The same message behind ``prefix`` (a call id); this one gives up its memfd."""
        packed = Packed(self.body, self.fd, prefix + self.prefix)
        self.fd = -1
        return packed

    def close(self) -> None:
        """Close the memfd; idempotent."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Mapped:
    """A received pickle and the buffers it names: slices of a private mapping of the memfd.

    What a reader makes of a shared frame (``reader.FrameReader``): its
    ``len()`` counts the mapped bytes too, for the bounds on what waits.
    """

    __slots__ = ("buffers", "nbytes", "pickle")

    def __init__(self, pickle: bytes, buffers: list[memoryview]) -> None:
        #: The frame's payload without its layout (a call id first, if it had one).
        self.pickle = pickle
        self.buffers = buffers
        self.nbytes = len(pickle) + sum(buffer.nbytes for buffer in buffers)

    def __len__(self) -> int:
        return self.nbytes

    def after(self, size: int) -> Mapped:
        """The same buffers behind the pickle less its first ``size`` bytes (its call id)."""
        return Mapped(self.pickle[size:], self.buffers)


class _Collect:
    """A pickler's ``buffer_callback``: keeps the large buffers out of band, in ``large``."""

    __slots__ = ("large",)

    def __init__(self, large: list[memoryview]) -> None:
        self.large = large

    def __call__(self, buffer: pickle.PickleBuffer) -> bool:
        # True keeps the buffer in the pickle. raw() refuses a non-contiguous
        # buffer: pickle then raises its own error for it.
        try:
            view = buffer.raw()
        except BufferError:
            return True
        if view.nbytes < SHARED_BYTES:
            return True
        self.large.append(view)
        return False


def pickler(file: Any, large: list[memoryview] | None, *, views: bool = False) -> pickle.Pickler:
    """A protocol-5 pickler into ``file``; ``large`` collects the buffers to share.

    With ``large`` None every buffer stays in the pickle. Tensors are reduced
    by ``tensors.TensorPickler`` if torch is imported. With ``views``, a
    ``memoryview`` too, as ``views`` (the module) says: the callers ask for it
    once a plain pickler has refused an object, since building its reducer
    table would cost every message a microsecond or two.
    """
    callback = None if large is None else _Collect(large)
    kind = TensorPickler if "torch" in sys.modules else pickle.Pickler
    made = kind(file, protocol=5, buffer_callback=callback)
    if views:
        from .views import dispatch_table  # imported by the few that need it

        made.dispatch_table = dispatch_table()
    return made


def dumps(obj: Any, shared: bool) -> Packed:
    """Pickle ``obj`` once; with ``shared``, its large buffers go into a memfd.

    Raises:
        BaseException: Whatever pickling ``obj`` raised.
        OSError: The memfd could not be made (out of memory).
    """
    large: list[memoryview] | None = [] if shared else None
    body = pickle_body(obj, large)
    if not large:
        return Packed(body)
    return pack(body, large)


def pickle_body(obj: Any, large: list[memoryview] | None) -> bytes:
    """Pickle ``obj`` as :func:`pickler` does, its large buffers into ``large``.

    Raises:
        BaseException: Whatever pickling ``obj`` raised.
    """
    try:
        if "torch" in sys.modules:
            out = io.BytesIO()
            pickler(out, large).dump(obj)
            return out.getvalue()
        # The C function: no file object to call (a small message's cost halves).
        callback = None if large is None else _Collect(large)
        return pickle.dumps(obj, protocol=5, buffer_callback=callback)
    except TypeError:
        # Perhaps a memoryview, which plain pickle refuses: again, with views
        # (an object that is not picklable fails again, with the same error).
        if large is not None:
            large.clear()
        return pickle_with_views(obj, large)


def dumps_whole(obj: Any) -> bytes:
    """``obj`` pickled whole (protocol 5, every buffer in band), a ``memoryview`` in it too.

    Plain pickle first; the view-aware pickler (:func:`pickler`) once it refused.

    Raises:
        BaseException: Whatever pickling ``obj`` raised (an object that cannot
            be pickled fails twice, with the same error).
    """
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except TypeError:
        pass  # perhaps a memoryview; retried outside, so that a second error stands alone
    return pickle_with_views(obj, None)


def pickle_with_views(obj: Any, large: list[memoryview] | None) -> bytes:
    """Pickle ``obj`` with :func:`pickler`'s ``views``: a memoryview pickles too.

    Raises:
        BaseException: Whatever pickling ``obj`` raised.
    """
    out = io.BytesIO()
    pickler(out, large, views=True).dump(obj)
    return out.getvalue()


def pack(body: bytes, large: list[memoryview]) -> Packed:
    """Write ``large`` into a new sealed memfd; return the layout and ``body`` with it.

    Raises:
        OSError: The memfd could not be made or filled (out of memory).
    """
    import fcntl

    spans, end = place(large)
    fd = os.memfd_create("aiospawn", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, end)
        write_buffers(fd, spans, large)
        # Sealed: no writes (value semantics), and no shrinking, which would
        # turn the receiver's reads past the new end into SIGBUS.
        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL,
        )
    except BaseException:
        os.close(fd)
        raise
    return Packed(layout(spans) + body, fd)


def place(large: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    """``(spans, end)``: where each buffer goes in a memfd (aligned), and the bytes they need."""
    spans = []
    end = 0
    for view in large:
        spans.append((end, view.nbytes))
        end += -(-view.nbytes // _ALIGN) * _ALIGN
    return spans, end


def write_buffers(fd: int, spans: list[tuple[int, int]], large: list[memoryview]) -> None:
    """Write each of ``large`` at its span's offset in the memfd ``fd``.

    Raises:
        OSError: The memfd could not be filled (out of memory).
    """
    for (offset, size), view in zip(spans, large, strict=True):
        written = 0
        while written < size:  # a write is capped (at 2 GiB on Linux)
            written += os.pwrite(fd, view[written:], offset + written)


def layout(spans: list[tuple[int, int]], token: int | None = None) -> bytes:
    """The layout of a shared frame: its buffers' spans, and a pooled segment's token."""
    if token is None:
        parts = [LAYOUT.pack(len(spans))]
    else:
        parts = [LAYOUT.pack(len(spans) | POOLED), TOKEN.pack(token)]
    parts.extend(SPAN.pack(offset, size) for offset, size in spans)
    return b"".join(parts)


def new_segment(size: int) -> tuple[int, int]:
    """A memfd of ``size`` bytes to be rewritten: ``(its writable fd, a read-only one to send)``.

    Sealed against shrinking and growing (a receiver's reads past a new end
    would be SIGBUS) and against further seals (a receiver could otherwise
    seal it against the sender's next write), not against writes: the sender
    rewrites it once every receiver has unmapped it. Receivers get the
    read-only descriptor: they cannot write through it, nor add seals.

    Raises:
        OSError: The memfd could not be made.
    """
    import fcntl

    fd = os.memfd_create("aiospawn", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(
            fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        )
        # A new open file description, read-only, of the same memfd.
        read_only = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        os.close(fd)
        raise
    return fd, read_only


def layout_size(payload: bytes | bytearray, start: int) -> int:
    """The size of the layout at ``payload[start:]``; 0 if it does not fit (a broken frame)."""
    if len(payload) < start + LAYOUT.size:
        return 0
    (word,) = LAYOUT.unpack_from(payload, start)
    count = word & ~POOLED
    size = LAYOUT.size + (TOKEN.size if word & POOLED else 0) + count * SPAN.size
    return size if count <= MAX_BUFFERS and len(payload) >= start + size else 0


def map_shared(payload: bytes | bytearray, start: int, fd: int, release: Any = None) -> Mapped:
    """Map the memfd ``fd`` of a shared frame's ``payload``, whose layout is at ``start``.

    Closes nothing: the caller closes ``fd`` (the mapping does not need it).
    A pooled segment (the supervisor's, see :data:`POOLED`) is accepted only
    with ``release``, called with its token once the mapping is gone (from
    whichever thread drops the last object that uses it).

    Raises:
        ValueError: The layout or the memfd is not what a sender makes (not
            sealed, smaller than the layout says, pooled where ``release`` is
            None): the frame breaks the format.
    """
    import fcntl

    size = layout_size(payload, start)
    if not size:
        raise ValueError("a shared frame whose layout is cut short or names too many buffers")
    (word,) = LAYOUT.unpack_from(payload, start)
    pooled = bool(word & POOLED)
    count = word & ~POOLED
    token = 0
    if pooled:
        if release is None:
            raise ValueError("a shared frame in a pooled segment, which only the supervisor sends")
        (token,) = TOKEN.unpack_from(payload, start + LAYOUT.size)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    # A pooled segment is rewritten once every receiver has released it: not
    # write-sealed, but never resized.
    wanted = fcntl.F_SEAL_SHRINK | (0 if pooled else fcntl.F_SEAL_WRITE)
    if seals & wanted != wanted:
        raise ValueError("a shared frame whose descriptor is not a sealed memfd")
    length = os.fstat(fd).st_size
    first = start + size - count * SPAN.size
    spans = [SPAN.unpack_from(payload, first + i * SPAN.size) for i in range(count)]
    for offset, span in spans:
        if offset + span > length:
            raise ValueError(
                f"a shared frame names bytes {offset}-{offset + span} of a {length}-byte memfd"
            )
    rest = bytes(payload[:start]) + bytes(payload[start + size :])
    if length == 0:
        if pooled:
            release(token)  # nothing is mapped: nothing to wait for
        return Mapped(rest, [memoryview(bytearray()) for _ in spans])
    whole = _map_private(fd, length, release if pooled else None, token)
    return Mapped(rest, [whole[offset : offset + span] for offset, span in spans])


def _map_private(fd: int, length: int, release: Any = None, token: int = 0) -> memoryview:
    """A private, writable mapping of ``length`` bytes of ``fd``, unmapped when its last view goes.

    Private: the receiver may write to what it got, and its pages are copied
    as it does. A page it has not written still shows the file's later
    writes (Linux): a sealed memfd has none, and a pooled segment is
    rewritten only after ``release(token)``, which is called once the
    mapping is gone. Not through ``mmap.mmap``, which keeps a duplicate of
    the descriptor for as long as the mapping lives (before Python 3.13's
    ``trackfd``): a process holding many received arrays would run out of
    descriptors.
    """
    import ctypes
    import mmap
    import weakref

    libc = _libc()
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot map the memfd: {os.strerror(error)}")
    memory = (ctypes.c_char * length).from_address(address)
    weakref.finalize(memory, _unmap, address, length, release, token)
    return memoryview(memory).cast("B")


def map_writable(fd: int, length: int) -> tuple[memoryview, Any]:
    """A shared, writable mapping of the memfd ``fd``, its page tables filled at once.

    For a sender that rewrites a segment again and again: copying into the
    mapping costs less than ``pwrite``, which looks up each page. Returns the
    mapping and what unmaps it (callable once; the view is unusable after).

    Raises:
        OSError: It cannot be mapped.
    """
    import ctypes
    import mmap
    import weakref

    libc = _libc()
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    address = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        error = ctypes.get_errno()
        raise OSError(error, f"cannot map the memfd: {os.strerror(error)}")
    memory = (ctypes.c_char * length).from_address(address)
    unmap = weakref.finalize(memory, _unmap, address, length, None, 0)
    return memoryview(memory).cast("B"), unmap


def _unmap(address: int, length: int, release: Any, token: int) -> None:
    """Unmap a mapping; then, for a pooled segment, tell the sender it may rewrite it."""
    import ctypes

    _libc().munmap(ctypes.c_void_p(address), ctypes.c_size_t(length))
    if release is not None:
        release(token)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = libc
    return _LIBC


def loads(payload: bytes | bytearray | memoryview | Mapped) -> Any:
    """Unpickle a frame's pickle, with its mapped buffers if it has any."""
    if isinstance(payload, Mapped):
        return pickle.loads(payload.pickle, buffers=payload.buffers)
    return pickle.loads(payload)
