"""Per-rank output streams: prefix, directory, tee, capture, devnull, and what they guarantee.

Every test runs real ranks under asyncio and trio. The supervisor's own
streams are read with ``capfd`` (the prefixed lines are written to file
descriptors 1 and 2 through ``sys.stdout`` and ``sys.stderr``).
"""

from __future__ import annotations

import contextvars
import io
import json
import os
import stat
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import anyio
import psutil
import pytest

import aiospawn
from aiospawn import OutputLine
from aiospawn._local._output import MAX_LINE
from tests import ranks

pytestmark = pytest.mark.anyio

#: A deadlock tripwire for groups that should finish within moments.
TRIPWIRE = 60


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # pytest makes its base temp dir on first use, inside our temp dir; made
    # before the leak check's baseline, it is not a leak of the first test.
    tmp_path_factory.getbasetemp()


async def collect(ctx: aiospawn.AsyncProcessContext[object]) -> list[OutputLine]:
    """Supervise the group (join) while reading every captured line, as the README shows.

    The lines end once every rank has exited and its last lines were
    delivered; then ``join()``'s exception, if any, is raised.
    """
    lines: list[OutputLine] = []
    failure: list[aiospawn.ProcessException] = []

    async def join() -> None:
        try:
            await ctx.join()
        except aiospawn.ProcessException as exc:
            failure.append(exc)

    with anyio.fail_after(TRIPWIRE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(join)
            async for line in ctx.output():
                lines.append(line)
    if failure:
        raise failure[0]
    return lines


async def leftover(ctx: aiospawn.AsyncProcessContext[object]) -> list[str]:
    """After ``join()``: the captured lines it left for ``ctx.output()``, which then ends."""
    with anyio.fail_after(TRIPWIRE):
        return [item.line async for item in ctx.output()]


async def test_prefix_puts_each_line_behind_its_rank(capfd: pytest.CaptureFixture[str]) -> None:
    await aiospawn.start_processes(
        ranks.out_hello, (3,), nprocs=2, stdout="prefix", stderr="prefix"
    )
    out, err = capfd.readouterr()
    for rank in range(2):
        for index in range(3):
            assert f"[rank{rank}]: out {rank} {index}" in out.splitlines()
            assert f"[rank{rank}]: err {rank} {index}" in err.splitlines()
    assert "err " not in out
    assert "out " not in err


async def test_prefix_template_names_the_pid(capfd: pytest.CaptureFixture[str]) -> None:
    ctx = await aiospawn.start_processes(
        ranks.out_hello, (1,), nprocs=2, join=False, stdout="prefix", prefix="<{rank}|{pid}> "
    )
    pids = ctx.pids()
    await ctx.join()
    out = capfd.readouterr().out.splitlines()
    for rank, pid in enumerate(pids):
        assert f"<{rank}|{pid}> out {rank} 0" in out


class TextOnly(io.TextIOBase):
    """A text stream without a binary ``buffer``, as a notebook kernel's ``sys.stdout`` is.

    It keeps each write with the value that ``WRITER`` had in the writer's context.
    """

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.writes.append((WRITER.get("nobody"), text))
        return len(text)


#: Who owns a write: ipykernel keeps the cell a write belongs to in a context variable.
WRITER: contextvars.ContextVar[str] = contextvars.ContextVar("WRITER")


async def test_prefix_writes_text_to_a_text_only_stream_in_the_context_that_started_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = TextOnly()
    monkeypatch.setattr(sys, "stdout", stream)
    token = WRITER.set("the starter")
    try:
        ctx = await aiospawn.start_processes(
            ranks.out_hello, (2,), nprocs=2, join=False, stdout="prefix"
        )
    finally:
        WRITER.reset(token)
    WRITER.set("a later task")  # a later cell, say; the group's lines stay the starter's
    await ctx.join()
    lines = sorted(text.rstrip("\n") for _, text in stream.writes)
    assert lines == [f"[rank{rank}]: out {rank} {index}" for rank in range(2) for index in range(2)]
    assert {writer for writer, _ in stream.writes} == {"the starter"}


class AsciiOnly(io.StringIO):
    """A text-only stream (no ``buffer``) that holds ASCII alone, as a misconfigured console."""

    def write(self, text: str) -> int:
        text.encode("ascii")  # UnicodeEncodeError, a ValueError
        return super().write(text)


@pytest.mark.parametrize("broken", ["closed", "cannot-encode"])
async def test_a_supervisor_stream_that_breaks_stops_the_copy_not_the_group(
    broken: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Both raise ValueError, not OSError: a stream the program closed, and a
    # text stream whose encoding cannot hold what a rank wrote.
    stream = io.StringIO() if broken == "closed" else AsciiOnly()
    if broken == "closed":
        stream.close()
    monkeypatch.setattr(sys, "stdout", stream)
    # spawn: a fork rank would inherit the broken stream as its own sys.stdout.
    results = await aiospawn.start_processes(
        ranks.out_unicode, nprocs=1, stdout="prefix", start_method="spawn"
    )
    assert results == [7]
    assert "Stopped copying a rank's stdout" in caplog.text


async def test_directory_mode_writes_owner_only_files(tmp_path: Path) -> None:
    logs = tmp_path / "logs" / "run"  # made by the group, parents too
    await aiospawn.start_processes(ranks.out_hello, (2,), nprocs=2, stdout=logs, stderr=logs)
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert sorted(path.name for path in logs.iterdir()) == [
        "rank0.stderr",
        "rank0.stdout",
        "rank1.stderr",
        "rank1.stdout",
    ]
    for rank in range(2):
        for stream, word in (("stdout", "out"), ("stderr", "err")):
            path = logs / f"rank{rank}.{stream}"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert path.read_text() == f"{word} {rank} 0\n{word} {rank} 1\n"


async def test_tee_writes_the_file_and_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    await aiospawn.start_processes(
        ranks.out_hello, (2,), nprocs=2, stdout=tmp_path, stderr=tmp_path, tee=True
    )
    out, err = capfd.readouterr()
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.stdout").read_text() == f"out {rank} 0\nout {rank} 1\n"
        assert (tmp_path / f"rank{rank}.stderr").read_text() == f"err {rank} 0\nerr {rank} 1\n"
        assert stat.S_IMODE((tmp_path / f"rank{rank}.stdout").stat().st_mode) == 0o600
        assert f"[rank{rank}]: out {rank} 1" in out.splitlines()
        assert f"[rank{rank}]: err {rank} 1" in err.splitlines()


async def test_devnull_discards(capfd: pytest.CaptureFixture[str]) -> None:
    await aiospawn.start_processes(ranks.out_hello, (2,), nprocs=2, stdout="devnull")
    out, err = capfd.readouterr()
    assert "out " not in out
    assert "err 1 1" in err  # stderr was inherited


async def test_capture_yields_every_line_in_order_and_ends() -> None:
    lines = 200
    ctx = await aiospawn.start_processes(
        ranks.out_hello, (lines,), nprocs=2, join=False, stdout="capture", stderr="capture"
    )
    captured = await collect(ctx)  # ends once both ranks have exited
    by_stream: dict[tuple[int, str], list[str]] = defaultdict(list)
    for item in captured:
        assert isinstance(item, OutputLine)
        by_stream[item.rank, item.stream].append(item.line)
    for rank in range(2):
        assert by_stream[rank, "stdout"] == [f"out {rank} {i}" for i in range(lines)]
        assert by_stream[rank, "stderr"] == [f"err {rank} {i}" for i in range(lines)]


async def test_output_without_capture_is_an_error() -> None:
    ctx = await aiospawn.start_processes(ranks.out_hello, nprocs=1, join=False, stdout="devnull")
    with pytest.raises(RuntimeError, match="capture"):
        async for _ in ctx.output():
            pass  # pragma: no cover
    await ctx.join()


@pytest.mark.slow
async def test_capture_holds_a_fast_rank_back_instead_of_growing_memory() -> None:
    count = 1_600_000  # 64 bytes each: 100 MB, more than the bound below
    bound = 150 * 1024 * 1024
    me = psutil.Process()
    baseline = me.memory_info().rss
    peak = baseline
    received = 0
    ctx = await aiospawn.start_processes(
        ranks.out_flood, (count,), nprocs=1, join=False, stdout="capture"
    )
    with anyio.fail_after(110):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctx.join)
            async for item in ctx.output():
                # A slow consumer: the rank writes far faster than this loop reads.
                assert item.line.startswith(f"{received:010d}")
                received += 1
                if received % 20_000 == 0:
                    peak = max(peak, me.memory_info().rss)
                    await anyio.sleep(0.002)
    assert received == count
    assert peak - baseline < bound, f"RSS grew by {(peak - baseline) >> 20} MiB"


async def test_line_without_newline_before_os_exit_is_delivered() -> None:
    ctx = await aiospawn.start_processes(
        ranks.out_last_words, ("no-newline",), nprocs=1, join=False, stdout="capture"
    )
    await ctx.join()  # returns after the rank's last bytes were read
    assert await leftover(ctx) == ["first 0", "unfinished 0"]


@pytest.mark.parametrize(
    ("how", "line", "exit_code"),
    [("os-exit", "last line 0", 3), ("sigkill", "before sigkill 0", -9)],
)
async def test_last_line_is_delivered_before_join_raises(
    how: str, line: str, exit_code: int, capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = await aiospawn.start_processes(
        ranks.out_last_words, (how,), nprocs=1, join=False, stdout="prefix"
    )
    with pytest.raises(aiospawn.ProcessExitedException) as caught:
        await ctx.join()
    assert caught.value.exit_code == exit_code
    assert f"[rank0]: {line}" in capfd.readouterr().out.splitlines()


async def test_last_line_is_captured_before_join_raises() -> None:
    ctx = await aiospawn.start_processes(
        ranks.out_last_words, ("sigkill",), nprocs=1, join=False, stdout="capture"
    )
    with pytest.raises(aiospawn.ProcessExitedException):
        await ctx.join()
    assert await leftover(ctx) == ["before sigkill 0"]


async def test_c_stdio_and_grandchild_output_are_captured() -> None:
    ctx = await aiospawn.start_processes(
        ranks.out_c_level, nprocs=2, join=False, stdout="capture", stderr="capture"
    )
    captured = await collect(ctx)
    for rank in range(2):
        assert OutputLine(rank, "stdout", f"from C {rank}") in captured
        assert OutputLine(rank, "stdout", f"from grandchild {rank}") in captured
        assert OutputLine(rank, "stderr", f"grandchild stderr {rank}") in captured


async def test_a_line_longer_than_the_limit_is_split_not_dropped() -> None:
    length = 3 * MAX_LINE + 1000
    ctx = await aiospawn.start_processes(
        ranks.out_long_line, (length,), nprocs=1, join=False, stdout="capture"
    )
    pieces = [item.line for item in await collect(ctx)]
    assert [len(piece) for piece in pieces] == [MAX_LINE, MAX_LINE, MAX_LINE, 1000]
    assert "".join(pieces) == "y" * length


@pytest.mark.parametrize("mode", ["prefix", "capture"])
async def test_exited_rank_exception_quotes_its_last_stderr_lines(mode: str) -> None:
    ctx = await aiospawn.start_processes(
        ranks.out_stderr_then_fail, (30, "exit"), nprocs=1, join=False, stderr=mode
    )
    with pytest.raises(aiospawn.ProcessExitedException) as caught:
        await ctx.join()
    message = str(caught.value)
    assert caught.value.exit_code == 3
    assert "last lines of rank 0's stderr:" in message
    for index in range(10, 30):
        assert f"stderr line {index}\n" in message + "\n"
    assert "stderr line 9\n" not in message
    if mode == "capture":
        assert (await leftover(ctx))[-1] == "stderr line 29"


async def test_raised_rank_exception_notes_its_last_stderr_lines() -> None:
    with pytest.raises(aiospawn.ProcessRaisedException) as caught:
        await aiospawn.start_processes(
            ranks.out_stderr_then_fail, (25, "raise"), nprocs=1, stderr="prefix"
        )
    assert "out: failing after stderr lines" in str(caught.value)
    notes = "\n".join(caught.value.__notes__)
    assert "last lines of rank 0's stderr:" in notes
    assert "stderr line 24" in notes
    assert "stderr line 4\n" not in notes + "\n"


async def test_inherited_stderr_is_not_quoted() -> None:
    with pytest.raises(aiospawn.ProcessExitedException) as caught:
        await aiospawn.start_processes(ranks.out_stderr_then_fail, (3, "exit"), nprocs=1)
    assert "stderr line" not in str(caught.value)


async def test_env_mapping_reaches_every_rank() -> None:
    results = await aiospawn.start_processes(
        ranks.out_environ, ("OUT_SHARED", "OUT_OTHER"), nprocs=2, env={"OUT_SHARED": "yes"}
    )
    assert results == [{"OUT_SHARED": "yes", "OUT_OTHER": None}] * 2


def _rank_env(rank: int) -> dict[str, str]:
    return {"OUT_RANK": str(rank), "OUT_TWICE": str(2 * rank)}


async def test_env_callable_gives_each_rank_its_own() -> None:
    results = await aiospawn.start_processes(
        ranks.out_environ, ("OUT_RANK", "OUT_TWICE"), nprocs=2, env=_rank_env
    )
    assert results == [{"OUT_RANK": "0", "OUT_TWICE": "0"}, {"OUT_RANK": "1", "OUT_TWICE": "2"}]
    assert "OUT_RANK" not in os.environ  # set in the ranks only


def test_a_broken_supervisor_stdout_does_not_break_supervision(anyio_backend: str) -> None:
    # In a process of its own, which takes whatever the defect leaves with it.
    report = subprocess.run(
        [sys.executable, "-m", "tests.cli_programs.broken_stdout", anyio_backend],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=TRIPWIRE,
        check=True,
    )
    outcome = json.loads(report.stdout)
    # The lines are lost; the ranks are not, and nothing is left behind.
    assert outcome == {"results": [None, None], "children left": [], "fds left": []}


async def test_pump_ends_quietly_when_the_rank_exit_drains_the_pipe_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The interleaving that happens for real: the pipe turns readable, and
    # before the pump task resumes, the watcher sees the rank's exit and
    # drains (and closes) the pipe.
    from aiospawn._local import _output

    read_end, write_end = os.pipe()
    lines: list[bytes] = []
    stream = _output.StreamReader(read_end, "stdout", [lines.append], None)
    stream.prepare()
    os.write(write_end, b"last words\n")
    os.close(write_end)
    readable = anyio.wait_readable

    async def readable_then_drained(fd: int) -> None:
        await readable(fd)
        stream.drain()

    monkeypatch.setattr(anyio, "wait_readable", readable_then_drained)
    with anyio.fail_after(TRIPWIRE):
        await stream.pump()
    assert lines == [b"last words"]


async def test_per_rank_modes_and_tee_choose_each_ranks_streams(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Rank 0: stdout to a file and teed, stderr discarded; rank 1: both prefixed.
    await aiospawn.start_processes(
        ranks.out_hello,
        (1,),
        nprocs=2,
        stdout=lambda rank: tmp_path if rank == 0 else "prefix",
        stderr=lambda rank: "devnull" if rank == 0 else "prefix",
        tee=lambda rank: {"stdout"} if rank == 0 else False,
    )
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[rank0]: out 0 0", "[rank1]: out 1 0"]
    assert err.splitlines() == ["[rank1]: err 1 0"]
    assert os.listdir(tmp_path) == ["rank0.stdout"]
    assert (tmp_path / "rank0.stdout").read_text() == "out 0 0\n"


@pytest.mark.usefixtures("no_process_start")
async def test_a_bad_per_rank_mode_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"stdout for rank 1 must be one of"):
        await aiospawn.start_processes(
            ranks.out_hello, (1,), nprocs=2, stdout=lambda rank: "prefix" if rank == 0 else 3
        )
    with pytest.raises(ValueError, match=r"tee for rank 0 names stderr, which is not a directory"):
        await aiospawn.start_processes(
            ranks.out_hello, (1,), nprocs=2, stderr="prefix", tee=lambda rank: {"stderr"}
        )


async def test_devices_per_rank_gives_each_rank_its_own_devices() -> None:
    results = await aiospawn.start_processes(
        ranks.out_environ,
        ("CUDA_VISIBLE_DEVICES",),
        nprocs=2,
        devices_per_rank=2,
        devices=[0, 1, 2, "GPU-3"],
    )
    assert results == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,GPU-3"}]


async def test_devices_per_rank_shares_out_the_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    results = await aiospawn.start_processes(
        ranks.out_environ, ("CUDA_VISIBLE_DEVICES",), nprocs=3, devices_per_rank=1
    )
    assert results == [{"CUDA_VISIBLE_DEVICES": device} for device in ("3", "5", "7")]


@pytest.mark.usefixtures("no_process_start")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"devices_per_rank": 2}, r"2 ranks of 2 devices each need 4, but 3 are visible"),
        ({"devices": ["0", "1", "2"]}, r"3 devices do not split evenly over 2 ranks"),
        ({"devices": [0, 0]}, r"names a device twice"),
        ({"devices_per_rank": -1}, r"devices_per_rank must be a non-negative int"),
        ({"devices": "0,1"}, r"devices must be a sequence"),
    ],
)
async def test_devices_that_do_not_fit_are_refused_before_anything_starts(
    options: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match=message):
        await aiospawn.start_processes(ranks.out_hello, (1,), nprocs=2, **options)  # type: ignore[arg-type]


def test_visible_devices_come_from_the_variable_or_the_driver(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from aiospawn._core import _env

    assert _env.visible_devices({"CUDA_VISIBLE_DEVICES": "1, 2"}) == ["1", "2"]
    assert _env.visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    for index in range(2):
        (tmp_path / f"0000:0{index}:00.0").mkdir()
    monkeypatch.setattr(_env, "NVIDIA_GPUS", str(tmp_path))
    assert _env.visible_devices({}) == ["0", "1"]
    monkeypatch.setattr(_env, "NVIDIA_GPUS", str(tmp_path / "missing"))
    assert _env.visible_devices({}) == []
