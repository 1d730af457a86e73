"""Exit codes no exit status can hold: ``sys.exit(256)``, ``sys.exit(2**31)`` and beyond.

The kernel keeps 8 bits of a status, so ``sys.exit(256)`` would end the process
with 0, and under ``fork`` ``os._exit(2**31)`` raises ``OverflowError`` in a
process that is a copy of the supervisor. A rank must exit with a status that
reads as a failure, the report must keep the code ``fn`` gave, a ``fork`` rank
must never run the supervisor's code after ``fn``, and ``aiospawn run`` must
exit non-zero.
"""

from __future__ import annotations

import multiprocessing
import re
from pathlib import Path

import psutil
import pytest

import aiospawn
from tests import hostile_ranks
from tests.cli_helpers import run
from tests.helpers import tripwire

pytestmark = pytest.mark.anyio

START_METHODS = ["spawn", "forkserver", "fork"]
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize("code", [256, 512, 2**31, 2**70])
async def test_a_code_beyond_255_fails_the_rank_and_is_reported_as_given(
    code: int, start_method: str
) -> None:
    ctx = await aiospawn.start_processes(
        hostile_ranks.exit_with_code_or_return,
        (code,),
        nprocs=2,
        join=False,
        start_method=start_method,
    )
    pids = ctx.pids()
    with (
        tripwire(60, f"join() of a group whose rank 0 called sys.exit({code})"),
        pytest.raises(aiospawn.ProcessExitedException) as info,
    ):
        await ctx.join()
    error = info.value
    assert (error.error_index, error.error_pid) == (0, pids[0])
    assert (error.exit_code, error.signal_name) == (code, None)
    assert error.msg.startswith(f"process 0 terminated with exit code {code}: sys.exit({code})")
    assert "exit status is 1" in error.msg
    assert ctx.processes[0].exitcode == 1  # a status that cannot read as success
    for pid in pids:
        assert not psutil.pid_exists(pid), f"rank pid {pid} was not reaped"


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_negative_code_fails_the_rank_with_status_1_and_says_so(
    start_method: str,
) -> None:
    with pytest.raises(aiospawn.ProcessExitedException) as info:
        await aiospawn.start_processes(
            hostile_ranks.exit_with, (-256,), nprocs=1, start_method=start_method
        )
    # A negative exit_code would read as a signal: the report gives the status.
    assert (info.value.exit_code, info.value.signal_name) == (1, None)
    assert "sys.exit(-256)" in info.value.msg


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_queue_fed_just_before_returning_is_flushed_before_the_rank_exits(
    start_method: str,
) -> None:
    # The bootstrap ends the process itself; it must still run multiprocessing's
    # exit steps, of which the Queue's feeder flush is one. (Both items fit in the
    # pipe: a rank waits at exit until its items are in the pipe, and nobody
    # reads before join() returns.)
    queue = multiprocessing.get_context(start_method).Queue()
    try:
        results = await aiospawn.start_processes(
            hostile_ranks.put_then_return, (queue, 16 << 10), nprocs=2, start_method=start_method
        )
        assert results == [0, 1]
        assert [len(queue.get(timeout=30)) for _ in range(2)] == [16 << 10, 16 << 10]
    finally:
        queue.close()
        queue.join_thread()


@pytest.mark.parametrize("code", ["256", "512", str(2**31)])
def test_the_launcher_exits_non_zero_when_a_rank_exits_with_a_code_beyond_255(
    code: str,
) -> None:
    completed = run(
        "run", "--start-method", "fork", "--fn", "tests.hostile_ranks:exit_with_int", code
    )
    assert completed.returncode == 1, completed.stderr
    assert re.search(rf"exit code {code}: sys\.exit\({code}\)", completed.stderr), completed.stderr
