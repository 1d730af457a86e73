"""Rank functions for the benchmarks: importable, top level, standard library only.

Every peer (aiospawn, torch.multiprocessing, plain multiprocessing) runs the
same functions, so a rank costs the same work whoever supervises it. A rank
proves it is running by recording ``time.monotonic()`` at the entry of ``fn``
in ``outdir/<rank>`` (CLOCK_MONOTONIC is system-wide on Linux, so the parent
can compare it with its own clock). The file appears atomically (rename), so a
parent that counts the files never reads a half-written one.
"""

from __future__ import annotations

import os
import signal
import time

#: Written by :func:`fail_after` just before the failing rank exits.
FAIL_STAMP = "fail"

#: Written by :func:`exit_when_told` just before the exiting rank exits.
EXIT_STAMP = "exit"


def record_entry(rank: int, outdir: str) -> float:
    """Record the entry time of rank ``rank`` and return it: the trivial rank."""
    now = time.monotonic()
    write_stamp(outdir, str(rank), now)
    return now


def sleep_forever(rank: int, outdir: str, ignore_term_rank: int = -1) -> None:
    """Record the entry, then sleep until a signal ends the process.

    The rank ``ignore_term_rank`` ignores SIGTERM, so only SIGKILL stops it.
    """
    if rank == ignore_term_rank:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record_entry(rank, outdir)
    while True:
        time.sleep(3600)


def sleep_then_return(rank: int, outdir: str, seconds: float) -> int:
    """Record the entry, sleep ``seconds``, and return the rank."""
    record_entry(rank, outdir)
    time.sleep(seconds)
    return rank


def fail_after(rank: int, outdir: str, delay: float, failing_rank: int = 1) -> None:
    """Rank ``failing_rank`` exits with code 1 after ``delay`` s; the others sleep.

    Just before ``os._exit(1)``, the failing rank writes the ``time.monotonic()``
    of its exit to ``outdir/fail`` through an already open descriptor, so that
    nothing but one ``write`` separates the stamp from the exit.
    """
    record_entry(rank, outdir)
    if rank != failing_rank:
        while True:
            time.sleep(3600)
    time.sleep(delay)
    fd = os.open(os.path.join(outdir, FAIL_STAMP), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, repr(time.monotonic()).encode())
    os._exit(1)


def exit_when_told(rank: int, outdir: str, go: object, exiting_rank: int = 1) -> None:
    """Record the entry; rank ``exiting_rank`` exits with code 0 once told, the others sleep.

    ``go`` is the reading end of a ``multiprocessing.Pipe``: the exiting rank
    blocks on it, so the parent is watching before the rank exits. Just before
    ``os._exit(0)`` the rank writes the ``time.monotonic()`` of its exit to
    ``outdir/exit`` through an already open descriptor, as :func:`fail_after` does.
    """
    if rank != exiting_rank:
        record_entry(rank, outdir)
        while True:
            time.sleep(3600)
    fd = os.open(os.path.join(outdir, EXIT_STAMP), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    record_entry(rank, outdir)
    go.recv()  # type: ignore[attr-defined]
    os.write(fd, repr(time.monotonic()).encode())
    os._exit(0)


def write_stamp(outdir: str, name: str, value: float) -> None:
    """Write ``value`` to ``outdir/name`` atomically."""
    path = os.path.join(outdir, name)
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        file.write(repr(value))
    os.rename(partial, path)


def torch_entry(rank: int, outdir: str) -> float:
    """A rank whose first line is ``import torch``; then it records its entry."""
    import torch  # noqa: F401  (the point: what a real rank pays first)

    return record_entry(rank, outdir)


def torch_entry_then_sleep(rank: int, outdir: str) -> None:
    """:func:`torch_entry`, then sleep until a signal ends the process (memory is measured)."""
    torch_entry(rank, outdir)
    while True:
        time.sleep(3600)


def torch_fail_then_restart(rank: int, outdir: str) -> float:
    """``import torch``; on its first run rank 1 stamps ``fail`` and exits 1.

    The restarted run records ``restarted`` at the entry, after its ``import torch``.
    """
    import torch  # noqa: F401

    restart = int(os.environ.get("AIOSPAWN_RESTART_COUNT", "0"))
    if rank == 1 and restart == 0:
        fd = os.open(os.path.join(outdir, FAIL_STAMP), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, repr(time.monotonic()).encode())
        os._exit(1)
    if rank == 1:
        write_stamp(outdir, "restarted", time.monotonic())
    return time.monotonic()


def return_rank(rank: int) -> int:
    """Return the rank: the trivial rank of a group whose values are collected."""
    return rank


def send_rank(rank: int, connection: object) -> None:
    """Send the rank on ``connection`` (a ``multiprocessing.Pipe`` end): the same, by hand.

    Typed ``object``: importing ``multiprocessing.connection`` (or ``typing``)
    here would cost every rank that imports this module, whoever supervises it.
    """
    connection.send(rank)  # type: ignore[attr-defined]
    connection.close()  # type: ignore[attr-defined]


class _Lengths:
    """What :func:`serve_lengths` answers: the length of what it is sent."""

    def length(self, data: bytes) -> int:
        return len(data)


def serve_lengths(rank: int) -> None:
    """Say ready, then answer ``ctx.call("length", data)`` until the supervisor closes."""
    import aiospawn

    aiospawn.ready()
    aiospawn.serve(_Lengths())


def aiospawn_origin(rank: int) -> str:
    """The file of the ``aiospawn`` package this rank runs with (which checkout it imported)."""
    import sys

    return str(sys.modules["aiospawn"].__file__)


def plain_group(method: str, nprocs: int) -> list[int]:
    """Start ``nprocs`` plain ``multiprocessing`` ranks that send their rank; their values.

    The peer of aiospawn's start-up benchmarks: a ``Pipe`` per rank, the
    processes started one after the other, the values received, all joined.
    """
    import multiprocessing

    context = multiprocessing.get_context(method)
    pipes = [context.Pipe(duplex=False) for _ in range(nprocs)]
    processes = [
        context.Process(target=send_rank, args=(rank, writer))
        for rank, (_, writer) in enumerate(pipes)
    ]
    for process in processes:
        process.start()
    for _, writer in pipes:
        writer.close()
    values = [reader.recv() for reader, _ in pipes]
    for process in processes:
        process.join()
    for reader, _ in pipes:
        reader.close()
    return values
