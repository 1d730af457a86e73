"""Starting a group's local ranks: side by side on starter threads, or one at a time on the loop.

``Process.start()`` can block: under ``spawn`` and ``forkserver`` it writes the
pickled ``fn`` and ``args`` into a 64 KiB pipe and waits until the child has
read them, which happens only after the child has imported ``fn``'s module
(torch issue 133010). So those starts, and a warm template's forks, run on
threads, side by side: up to :data:`START_CONCURRENCY` ranks take about one
rank's start time. A ``fork`` start never waits for the child; those run on
the event-loop thread, one at a time, with a checkpoint between them (forking
from several threads can corrupt ``multiprocessing``'s bookkeeping). Each
process object exists before its start, and starts are never abandoned on
cancellation, so no rank can start behind our back.

Each start method's strategy (``_strategy``) says which of the two its ranks
take. Light, as that module is: the standard library's threading and anyio.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from ._rank import LocalRank

#: How many ranks start at the same time, in all the groups of a process. More
#: threads would fight the event loop for the GIL while they pickle and fork:
#: with 32, a 64-rank spawn start stalled the loop for about 200 ms, with 8
#: about 30 ms.
START_CONCURRENCY = 8


async def start_ranks(ranks: Sequence[LocalRank], *, on_threads: bool) -> None:
    """Start ``ranks``; return once every start has finished.

    With ``on_threads``, side by side on the starter threads (see
    :func:`_start_on_threads`); else on this thread, one at a time, letting
    other tasks run in between. Ranks whose start did not happen (an error,
    or a cancellation before their turn) have their pipes released. On
    cancellation, starts already under way finish first (threads are never
    abandoned), then the cancellation is raised.

    Raises:
        Exception: The start error of the lowest failing rank, with a note naming it.
    """
    from anyio.lowlevel import checkpoint

    from aiospawn._core._backend import raise_start_error

    errors: dict[int, Exception] = {}
    try:
        if on_threads:
            await _start_on_threads(ranks, errors)
        else:
            # A fork never waits for the child, so a worker thread would only
            # add a round trip per rank.
            for rank in ranks:
                await checkpoint()
                try:
                    rank.start()
                except Exception as exc:
                    errors[rank.rank] = exc
    finally:
        for rank in ranks:
            if not rank.started:
                rank.discard()
    raise_start_error(errors, len(ranks))


async def _start_on_threads(ranks: Sequence[LocalRank], errors: dict[int, Exception]) -> None:
    """Start ``ranks`` on the starter threads; record each start error in ``errors``.

    One worker thread hands the starts to the process's starter threads and
    waits for them: the loop pays one thread round trip per group, not one
    per rank, and never creates a thread itself (``Thread.start()`` waits
    until the new thread runs, which on a busy machine held a first call's
    loop for milliseconds per thread).

    Cancellation:
        No further rank starts; the starts under way finish, then the
        cancellation is raised.
    """
    stop = threading.Event()

    def start_one(rank: LocalRank) -> None:
        if stop.is_set():
            return
        try:
            rank.start()
        except Exception as exc:
            errors[rank.rank] = exc

    def start_all() -> None:
        pool = _starters()
        for future in [pool.submit(start_one, rank) for rank in ranks]:
            future.result()

    async def stop_when_cancelled() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_when_cancelled)
        # Not abandoned on cancellation: the starts under way finish first.
        await anyio.to_thread.run_sync(start_all)
        tg.cancel_scope.cancel()


#: The threads that start ranks, shared by every group of this process and
#: made lazily (off the loop, by :func:`_start_on_threads`'s worker).
_starter_pool: ThreadPoolExecutor | None = None
_starter_lock = threading.Lock()


def _starters() -> ThreadPoolExecutor:
    # Imported here, on a worker thread: under trio nothing has imported it
    # yet, and it brings the logging package (about 25 ms).
    from concurrent.futures import ThreadPoolExecutor

    global _starter_pool
    with _starter_lock:
        if _starter_pool is None:
            _starter_pool = ThreadPoolExecutor(START_CONCURRENCY, "aiospawn-start")
        return _starter_pool


def _forget_starters() -> None:
    # A forked child has none of the parent's threads: a pool inherited from
    # it would queue starts that never run.
    global _starter_pool
    _starter_pool = None


os.register_at_fork(after_in_child=_forget_starters)
