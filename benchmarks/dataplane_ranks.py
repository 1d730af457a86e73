"""The rank side of the ``dataplane`` scenario: one request handler, and each peer's loop around it.

Every peer's worker runs :func:`handle` on what its transport delivered, so the
peers differ only in how a request and its answer travel. A request is
``(op, payload)``:

* ``echo``: answer the payload (a round trip);
* ``take``: answer the payload's size in bytes (a one-way transfer: the
  receiver holds the object, ready to use);
* ``keep``: hold the payload and describe the memory it lives in (see
  :func:`describe`); ``peek``: answer the held array's first element, then drop
  it. The scenario writes to its own array between the two, to learn whether
  the receiver sees the sender's later writes.

Standard library only at the top: numpy, torch, pyzmq and vLLM are imported
by the loops that need them, so a peer's worker imports what that peer needs.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any, BinaryIO

#: What a ``keep`` request left for the next ``peek`` (one per process).
_kept: Any = None


def handle(op: str, payload: Any) -> Any:
    """Serve one request (see the module docstring)."""
    global _kept
    if op == "echo":
        return payload
    if op == "take":
        return nbytes(payload)
    if op == "keep":
        _kept = payload
        return describe(payload)
    if op == "peek":
        value, _kept = first_element(_kept), None
        return value
    raise ValueError(f"unknown op {op!r}")


def nbytes(payload: Any) -> int:
    """The payload's size: numpy arrays and torch tensors have ``nbytes``, bytes a length."""
    size = getattr(payload, "nbytes", None)
    return int(size) if size is not None else len(payload)


def data_address(payload: Any) -> int:
    """Where an array's or a tensor's first byte lives in this process."""
    if hasattr(payload, "data_ptr"):
        return int(payload.data_ptr())
    return int(payload.__array_interface__["data"][0])


def first_element(payload: Any) -> float:
    """An array's or a tensor's first element, as a float."""
    return float(payload.reshape(-1)[0])


def describe(payload: Any) -> dict[str, Any]:
    """The mapping an array's data lives in, read from ``/proc/self/maps``.

    A shared mapping of a file (``/dev/shm/...``, a memfd, Ray's object store)
    means the receiver maps memory that another process can map too; a private
    anonymous one (the heap, ``malloc``'s own mappings) means it got a copy.
    """
    address = data_address(payload)
    perms, path = "?", "?"
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, _, end = fields[0].partition("-")
            if int(start, 16) <= address < int(end, 16):
                perms = fields[1]
                path = fields[5].strip() if len(fields) > 5 else ""
                break
    writeable = getattr(getattr(payload, "flags", None), "writeable", None)
    return {"perms": perms, "path": path, "writeable": writeable}


# --- raw sockets: the floors ---------------------------------------------------------------
#
# A frame is a header (op, payload kind, metadata length, data length), the
# metadata, then the payload's raw bytes: no pickle for bytes, arrays and
# tensors, and the receiver reads the data straight into the object it returns.

_HEADER = struct.Struct("!BBIQ")
OPS = ("echo", "take", "keep", "peek", "quit", "reply")
_NONE, _BYTES, _NUMPY, _TORCH, _PICKLE = range(5)

#: Below this many bytes a frame goes out in one write.
_JOIN_BELOW = 64 * 1024


def encode(op: str, payload: Any) -> list[Any]:
    """The frame of ``(op, payload)``, as buffers to write in order."""
    meta: bytes = b""
    data: Any = b""
    module = type(payload).__module__
    if payload is None:
        kind = _NONE
    elif isinstance(payload, bytes | bytearray):
        kind, data = _BYTES, payload
    elif module.startswith("numpy"):
        kind = _NUMPY
        meta = pickle.dumps((payload.dtype.str, payload.shape))
        data = memoryview(payload).cast("B")
    elif module.startswith("torch"):
        kind = _TORCH
        meta = pickle.dumps((str(payload.dtype).removeprefix("torch."), tuple(payload.shape)))
        data = memoryview(payload.numpy()).cast("B")
    else:
        kind, meta = _PICKLE, pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(OPS.index(op), kind, len(meta), len(data))
    if len(data) < _JOIN_BELOW:
        return [b"".join((header, meta, data))]
    return [header + meta, data]


def write_frame(sock: socket.socket, op: str, payload: Any) -> None:
    """Write one frame to a blocking socket."""
    for buffer in encode(op, payload):
        sock.sendall(buffer)


def _read_into(stream: BinaryIO, target: Any) -> None:
    view = memoryview(target).cast("B")
    while view:
        count = stream.readinto(view)
        if not count:
            raise EOFError("the peer closed the socket mid-frame")
        view = view[count:]


def read_frame(stream: BinaryIO) -> tuple[str, Any]:
    """Read one frame from a buffered binary stream over a blocking socket."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the peer closed the socket")
    op, kind, meta_size, data_size = _HEADER.unpack(header)
    meta = stream.read(meta_size)
    payload: Any
    if kind == _NONE:
        payload = None
    elif kind == _BYTES:
        payload = bytearray(data_size)
        _read_into(stream, payload)
    elif kind == _NUMPY:
        import numpy

        dtype, shape = pickle.loads(meta)
        payload = numpy.empty(shape, dtype=dtype)
        _read_into(stream, payload)
    elif kind == _TORCH:
        import torch

        dtype, shape = pickle.loads(meta)
        payload = torch.empty(shape, dtype=getattr(torch, dtype))
        _read_into(stream, payload.numpy())
    else:
        payload = pickle.loads(meta)
    return OPS[op], payload


def decode_header(header: bytes) -> tuple[str, int, int, int]:
    """An asyncio reader's half of :func:`read_frame`: op, kind, metadata and data sizes."""
    op, kind, meta_size, data_size = _HEADER.unpack(header)
    return OPS[op], kind, meta_size, data_size


HEADER_SIZE = _HEADER.size


def decode_small(kind: int, meta: bytes, data: bytes) -> Any:
    """The payload of a frame read whole (the asyncio floor carries bytes and small replies)."""
    if kind == _NONE:
        return None
    if kind == _BYTES:
        return data
    if kind == _PICKLE:
        return pickle.loads(meta)
    raise ValueError("the asyncio floor carries bytes only")


def socket_rank(sock: socket.socket) -> None:
    """Serve frames on a socket until a ``quit`` frame."""
    with sock, sock.makefile("rb", buffering=_JOIN_BELOW) as stream:
        while True:
            op, payload = read_frame(stream)  # type: ignore[arg-type]
            if op == "quit":
                return
            write_frame(sock, "reply", handle(op, payload))


# --- multiprocessing and torch.multiprocessing -----------------------------------------------


def pipe_rank(conn: Any) -> None:
    """Serve ``(op, payload)`` on a ``multiprocessing.Pipe`` until ``None``."""
    while (request := conn.recv()) is not None:
        conn.send(handle(*request))


def queue_rank(requests: Any, replies: Any) -> None:
    """Serve on a pair of ``torch.multiprocessing`` queues until ``None``.

    Importing ``torch.multiprocessing`` registers its reductions, as in any
    process that uses its queues: a tensor's storage goes to shared memory.
    """
    import torch.multiprocessing  # noqa: F401  (the reductions)

    while (request := requests.get()) is not None:
        replies.put(handle(*request))


# --- pyzmq -----------------------------------------------------------------------------------


def zmq_frames(obj: Any) -> list[Any]:
    """``obj`` pickled with protocol 5: the pickle, then each out-of-band buffer as a frame."""
    buffers: list[pickle.PickleBuffer] = []
    main = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [main, *(buffer.raw() for buffer in buffers)]


def zmq_object(frames: list[Any]) -> Any:
    """The inverse of :func:`zmq_frames`, over frames received with ``copy=False``."""
    return pickle.loads(frames[0].buffer, buffers=[frame.buffer for frame in frames[1:]])


def zmq_copy(frames: list[Any]) -> bool:
    """pyzmq's advice: copy small messages, hand large buffers over without a copy."""
    return sum(memoryview(frame).nbytes for frame in frames) < _JOIN_BELOW


def zmq_rank(rank: int, address: str) -> None:
    """A DEALER serving the scenario's ROUTER until it sends ``None``."""
    import zmq

    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, str(rank).encode())
    dealer.connect(address)
    dealer.send(b"hello")
    try:
        while (request := zmq_object(dealer.recv_multipart(copy=False))) is not None:
            frames = zmq_frames(handle(*request))
            dealer.send_multipart(frames, copy=zmq_copy(frames))
    finally:
        dealer.close(linger=0)
        context.term()


# --- vLLM's shared-memory MessageQueue ---------------------------------------------------------


def vllm_rank(rank: int, broadcast_handle: Any, conn: Any) -> None:
    """A worker as vLLM's MultiprocExecutor runs it: one broadcast queue in, a reply queue out.

    As in ``WorkerProc``: the rank reads the executor's broadcast queue from
    its handle, makes its own single-reader reply queue and sends that handle
    back, then both sides wait until every queue is connected. Requests are
    ``(op, payload, output_rank)``; only ``output_rank`` answers, every rank if
    it is None.
    """
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    requests = MessageQueue.create_from_handle(broadcast_handle, rank)
    replies = MessageQueue(1, 1)
    conn.send(replies.export_handle())
    conn.close()
    requests.wait_until_ready()
    replies.wait_until_ready()
    while True:
        op, payload, output_rank = requests.dequeue(indefinite=True)
        if op == "quit":
            return
        answer = handle(op, payload)
        if output_rank is None or output_rank == rank:
            replies.enqueue(answer)


# --- Ray, aiospawn -------------------------------------------------------------------------


class RayRank:
    """A Ray actor (wrapped with ``ray.remote`` by the scenario)."""

    def handle(self, op: str, payload: Any) -> Any:
        return handle(op, payload)


def channel_rank(rank: int) -> None:
    """An aiospawn rank answering on its channel until the supervisor closes it."""
    import aiospawn

    channel = aiospawn.channel()
    aiospawn.ready()
    for request in channel:
        channel.send(handle(*request))


class CallHandler:
    """The handler of the aiospawn ranks serving ``ctx.call()``."""

    def handle(self, op: str, payload: Any) -> Any:
        return handle(op, payload)


def call_rank(rank: int) -> None:
    """An aiospawn rank serving ``ctx.call("handle", op, payload)``."""
    import aiospawn

    aiospawn.ready()
    aiospawn.serve(CallHandler())
