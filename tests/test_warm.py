"""Warm starts (``preload=``): ranks forked from a template that imported modules once.

Every test here stops the templates it started (``stop_all``) before the leak
checks run, so a template shared across groups is never taken for a leak.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

import aiospawn
from aiospawn._local import _template, _templates
from tests import ranks, warm_ranks
from tests.helpers import (
    Events,
    ImportGate,
    is_gone,
    is_reaped,
    is_running,
    live_children,
    receive_ready,
    tripwire,
    wait_until,
)
from tests.test_child import CRASH_MATRIX, Row
from tests.test_launch import _read_line_within, is_alive
from tests.test_reliability import make_rng, our_threads_blocked, scaled

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
COUNTED = warm_ranks.COUNTED
LEAVES_CHILDREN = "tests.warm_modules.leaves_children"


@pytest.fixture(autouse=True)
def _stop_templates() -> Iterator[None]:
    yield
    _templates.stop_all()


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory removed after the test (tmp_path would outlive it in the temp dir)."""
    with tempfile.TemporaryDirectory() as path:
        yield Path(path)


@pytest.fixture
def import_log(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The file ``tests.warm_modules.counted`` appends its importer's pid to."""
    log = scratch / "imports.log"
    log.touch()
    monkeypatch.setenv("WARM_IMPORT_LOG", str(log))
    return log


def importers(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()]


def only_template() -> int:
    [pid] = _templates.running_templates()
    return pid


async def join_after_killing_the_template(
    ctx: aiospawn.AsyncProcessContext[Any], template: int, ranks: str
) -> None:
    """SIGKILL ``template``; ``ctx.join()`` must raise SIGKILL naming the template's death."""
    os.kill(template, signal.SIGKILL)
    with (
        tripwire(60, f"join() of {ranks} after their template was killed"),
        pytest.raises(aiospawn.ProcessExitedException) as info,
    ):
        await ctx.join()
    assert info.value.signal_name == "SIGKILL"
    assert f"its warm-start template (pid {template}) died while it ran" in info.value.msg


@contextlib.contextmanager
def descriptors_past(number: int) -> Iterator[None]:
    """Hold open descriptors up to ``number``, so that the next ones opened are numbered past it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = number + 512
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    held = []
    try:
        while not held or held[-1] < number:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_warm_ranks_process_joins_while_the_supervisor_holds_descriptors_past_1024(
    events: Events,
) -> None:
    # select() refuses descriptors numbered 1024 and up; a service holds that many.
    reader, writer = events
    with descriptors_past(1100):
        ctx = await aiospawn.start_processes(
            warm_ranks.ready_then_wait, (writer,), nprocs=2, preload=["json"], join=False
        )
        await receive_ready(reader, 2)
        process = ctx.processes[0]
        assert process.sentinel > 1024  # the descriptor join() waits on
        process.join(0.05)  # still running: returns after the timeout
        assert process.exitcode is None
        await ctx.terminate(grace_period=10)
        with tripwire(30, "join() of a stopped warm rank"):
            await anyio.to_thread.run_sync(process.join, 30)
        assert process.exitcode == -signal.SIGTERM


async def test_a_preloaded_module_is_imported_once_and_every_rank_has_it(
    import_log: Path,
) -> None:
    first = await aiospawn.start_processes(warm_ranks.report, nprocs=3, preload=[COUNTED])
    second = await aiospawn.spawn(warm_ranks.report, nprocs=2, preload=[COUNTED])
    template = only_template()
    # One import in all, in the template; five ranks of two groups found it done.
    assert importers(import_log) == [template]
    for report in first + second:
        assert report["preloaded"] is True
        assert report["imported_in"] == template != report["pid"]
        assert report["ppid"] == template
    assert [r["rank"] for r in first] == [0, 1, 2]
    assert [r["rank"] for r in second] == [0, 1]


async def test_preloaded_modules_read_the_template_environment_not_the_rank_env(
    import_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WARM_PROBE", "supervisor")
    [report] = await aiospawn.start_processes(
        warm_ranks.report, preload=[COUNTED], env={"WARM_PROBE": "rank"}
    )
    assert (report["probe_at_import"], report["probe_now"]) == ("supervisor", "rank")
    # Another environment is another template: its imports see the new value.
    monkeypatch.setenv("WARM_PROBE", "changed")
    [report] = await aiospawn.start_processes(warm_ranks.report, preload=[COUNTED])
    assert report["probe_at_import"] == "changed"
    assert len(importers(import_log)) == 2


async def test_restarts_fork_from_the_same_warm_template(import_log: Path) -> None:
    results = await aiospawn.start_processes(
        warm_ranks.fail_first_run,
        nprocs=2,
        preload=[COUNTED],
        restart=aiospawn.RestartPolicy(max_restarts=1, strategy="one_for_one"),
    )
    template = only_template()
    assert importers(import_log) == [template]
    assert [r["restart"] for r in results] == [0, 1]
    assert all(r["ppid"] == r["imported_in"] == template for r in results)


async def test_a_template_killed_while_its_ranks_run_fails_them_and_is_replaced(
    import_log: Path, events: tuple[object, object]
) -> None:
    reader, writer = events
    ctx = await aiospawn.start_processes(
        warm_ranks.ready_then_wait,
        (writer,),
        nprocs=2,
        join=False,
        preload=[COUNTED],
        grace_period=1,
    )
    killed = only_template()
    await receive_ready(reader, 2)  # type: ignore[arg-type]
    os.kill(killed, signal.SIGKILL)
    with (
        tripwire(60, "join() of ranks whose template was SIGKILLed"),
        pytest.raises(aiospawn.ProcessExitedException) as info,
    ):
        await ctx.join()
    # The ranks died with their template (their status died with it too).
    assert info.value.signal_name == "SIGKILL"
    # Reparented when the template died, so not ours to reap: gone or a zombie.
    assert wait_until(lambda: all(map(is_gone, ctx.pids())))
    [report] = await aiospawn.start_processes(warm_ranks.report, preload=[COUNTED])
    assert report["ppid"] == only_template() != killed
    assert importers(import_log) == [killed, report["ppid"]]


async def test_a_start_on_a_dead_template_fails_clearly_and_the_next_start_replaces_it() -> None:
    template = await _templates.acquire(("json",))
    _templates.release(template)
    assert template.process is not None
    template.process.kill()
    template.process.join()
    with pytest.raises(_template.TemplateError, match=r"template \(pid \d+\) died .*new template"):
        template.fork(b"", [])


async def test_two_starts_that_see_the_template_die_at_once_both_report_its_exit_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two ranks' starts on worker threads see one death and both reap the
    # template. The thread whose waitpid() wins records the code late here;
    # the other's waitpid() finds no child: it must still report the code.
    template = await _templates.acquire(("json",))
    _templates.release(template)
    assert template.process is not None
    os.kill(template.process.pid, signal.SIGKILL)
    assert wait_until(lambda: psutil.Process(template.pid).status() == psutil.STATUS_ZOMBIE)
    real_waitpid = os.waitpid

    def slow_to_record(pid: int, options: int) -> tuple[int, int]:
        reaped = real_waitpid(pid, options)
        if reaped[0] == pid:
            time.sleep(0.3)  # reaped; its exit code not yet recorded
        return reaped

    monkeypatch.setattr(os, "waitpid", slow_to_record)
    messages: list[str] = []

    def died() -> None:
        messages.append(str(template._died()))

    threads = [threading.Thread(target=died) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)  # a deadlock tripwire
    monkeypatch.undo()
    await anyio.to_thread.run_sync(template.stop)
    assert len(messages) == 2
    assert all("died (SIGKILL (-9))" in message for message in messages), messages


async def test_a_template_that_dies_while_importing_fails_the_start() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"exited with exit code 3 while importing preload=\['tests.warm_modules.exits'\]",
    ):
        await aiospawn.start_processes(warm_ranks.report, preload=["tests.warm_modules.exits"])
    assert _templates.running_templates() == []


async def test_a_template_killed_between_groups_is_started_again(import_log: Path) -> None:
    await aiospawn.start_processes(warm_ranks.report, preload=[COUNTED])
    killed = only_template()
    os.kill(killed, signal.SIGKILL)
    assert wait_until(lambda: psutil.Process(killed).status() == psutil.STATUS_ZOMBIE)
    [report] = await aiospawn.start_processes(warm_ranks.report, preload=[COUNTED])
    assert report["ppid"] == only_template() != killed
    assert importers(import_log) == [killed, report["ppid"]]


@pytest.mark.parametrize(
    ("module", "why"),
    [
        pytest.param(
            "tests.warm_modules.threaded",
            "started Python threads ['started-by-threaded'];",  # the main thread is no culprit
            id="threads",
        ),
        pytest.param("tests.warm_modules.fake_cuda", "initialised CUDA", id="cuda"),
    ],
)
async def test_a_preload_that_makes_forking_unsafe_is_refused_naming_the_module(
    module: str, why: str
) -> None:
    with pytest.raises(RuntimeError) as info:
        await aiospawn.start_processes(warm_ranks.report, nprocs=2, preload=["json", module])
    message = str(info.value)
    assert message.startswith(f"warm starts refused: importing preload module {module!r} {why}")
    assert "leave the module out of preload" in message
    assert _templates.running_templates() == []


async def test_native_threads_a_preload_left_are_a_note_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The usual one, OpenBLAS's pool, is made again in a rank that needs it.
    caplog.set_level(logging.DEBUG, logger="aiospawn")
    module = "tests.warm_modules.native_thread"
    [report] = await aiospawn.start_processes(warm_ranks.report, preload=[module])
    assert report["ppid"] == only_template()
    notes = [record for record in caplog.records if "native thread" in record.getMessage()]
    assert [record.levelno for record in notes] == [logging.INFO]
    assert f"preload module {module!r} left 1 native thread(s) running" in notes[0].getMessage()


@pytest.mark.parametrize("row", [pytest.param(row, id=row.behaviour) for row in CRASH_MATRIX])
async def test_crash_matrix_under_preload(row: Row) -> None:
    failing = None if row.raises is None else 1
    ctx = await aiospawn.start_processes(
        ranks.crash_row,
        (row.behaviour, failing),
        nprocs=2,
        join=False,
        preload=["json"],
        grace_period=0.2,
    )
    pids = ctx.pids()
    if row.raises is None:
        with tripwire(60, f"join() of warm ranks that did {row.behaviour}"):
            assert await ctx.join() is True
        assert ctx.results == list(row.results)
        assert [p.exitcode for p in ctx.processes] == [0, 0]
    else:
        with (
            tripwire(60, f"join() of a warm group whose rank 1 did {row.behaviour}"),
            pytest.raises(row.raises) as info,
        ):
            await ctx.join()
        error = info.value
        assert type(error) is row.raises
        assert (error.error_index, error.error_pid) == (1, pids[1])
        assert re.fullmatch(row.message, error.msg, re.DOTALL), error.msg
        if isinstance(error, aiospawn.ProcessExitedException):
            assert (error.exit_code, error.signal_name) == (row.exit_code, row.signal_name)
        if row.cause is not None:
            row.cause(error.__cause__, error.msg)
        # A row may say what the process's own status is, when it differs.
        status = getattr(row, "process_exit_code", None)
        assert ctx.processes[1].exitcode == (row.exit_code if status is None else status)
        assert ctx.processes[0].exitcode == -signal.SIGTERM
    for pid in pids:
        assert not psutil.pid_exists(pid), f"rank pid {pid} was not reaped"


async def test_warm_ranks_have_their_streams_env_and_heartbeats() -> None:
    ctx = await aiospawn.start_processes(
        warm_ranks.say_and_beat,
        nprocs=2,
        join=False,
        preload=["json"],
        stdout="capture",
        stderr="capture",
        heartbeat_timeout=60,
    )
    with tripwire(60, "join() of warm ranks that print and beat"):
        await ctx.join()
    assert ctx.results == [0, 1]
    with tripwire(30, "reading the captured lines of ranks that ended"):
        lines = {(item.rank, item.stream, item.line) async for item in ctx.output()}
    assert lines == {
        (rank, stream, f"{name} from rank {rank}")
        for rank in (0, 1)
        for stream, name in (("stdout", "out"), ("stderr", "err"))
    }


@pytest.mark.parametrize(
    ("preload", "start_method", "error", "message"),
    [
        (["json"], "fork", ValueError, "start_method='fork' copies the supervisor"),
        ("json", "spawn", TypeError, "preload must be a list of module names, got 'json'"),
        (["json", 3], "spawn", TypeError, "preload must be a list of module names"),
        (["not a module"], "spawn", ValueError, "preload names modules"),
    ],
)
async def test_bad_preload_options_are_refused_before_anything_starts(
    preload: object, start_method: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        await aiospawn.start_processes(
            warm_ranks.report,
            preload=preload,  # type: ignore[arg-type]
            start_method=start_method,
        )
    assert _templates.running_templates() == []


def run_main_script(start: str, extra: Path) -> list[dict[str, object]]:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "warm_main_script.py"), start, str(extra)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    results: list[dict[str, object]] = json.loads(completed.stdout.splitlines()[-1])
    return results


def test_main_script_and_sys_path_behave_as_under_forkserver(scratch: Path) -> None:
    (scratch / "extra_module.py").write_text("VALUE = 'found'\n")
    warm = run_main_script("warm", scratch)
    forkserver = run_main_script("forkserver", scratch)
    # Where the script's top level ran differs: once, in the template, for
    # warm ranks; under forkserver in every rank up to Python 3.13.7 (its
    # __main__ preload changed in 3.13.8). sys.argv too: the template has the
    # script's, as a spawn child does; a fork server's changed in 3.13.8.
    assert warm[0]["argv"] == ["warm", str(scratch)]
    assert all(result["main_ran_here"] is False for result in warm)
    for result in (*warm, *forkserver):
        del result["argv"], result["main_ran_here"]
    assert warm == forkserver
    assert warm[0] == {
        "main_name": "__mp_main__",
        "fn_module": "__mp_main__",
        "same_main": True,
        "main_file": "warm_main_script.py",
        "extra_on_path": True,
        "extra_module": "found",
    }


def test_a_sigkilled_supervisor_leaves_no_template_and_no_rank(anyio_backend: str) -> None:
    command = [sys.executable, "-m", "tests.supervisor_script", "warm", anyio_backend]
    descendants: list[psutil.Process] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": tmp},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as supervisor,
    ):
        try:
            pids = json.loads(_read_line_within(supervisor, 60))["pids"]
            descendants = psutil.Process(supervisor.pid).children(recursive=True)
            templates = {psutil.Process(pid).ppid() for pid in pids}
            assert len(templates) == 1
            assert supervisor.pid not in templates
            assert {*pids, *templates} <= {p.pid for p in descendants}
            os.kill(supervisor.pid, signal.SIGKILL)
            assert supervisor.wait(30) == -signal.SIGKILL
            assert wait_until(lambda: not any(map(is_alive, descendants)), 5.0), (
                "still running 5 s after their supervisor was SIGKILLed: "
                f"{sorted(p.pid for p in descendants if is_alive(p))}"
                f" (ranks: {pids}, template: {templates})"
            )
        finally:
            if supervisor.poll() is None:
                supervisor.stdin.close()  # type: ignore[union-attr]
                supervisor.wait(60)
            for process in descendants:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()


def test_a_template_stays_single_threaded_and_runs_no_user_code_of_its_own() -> None:
    # What the template holds once ready: the preload, our rank side, one thread.
    code = textwrap.dedent(
        """
        import json, os, sys
        import anyio
        from aiospawn._local import _templates
        t = anyio.run(_templates.acquire, ("json",))
        tasks = os.listdir(f"/proc/{t.pid}/task")
        print(json.dumps(len(tasks)))
        _templates.stop_all()
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == 1


def test_the_launcher_passes_preload_on() -> None:
    shown = two_ranks_of_the_launcher(
        [sys.executable, "-m", "aiospawn"], "decimal,json", ["tests/cli_programs/show_preloaded.py"]
    )
    assert [line["preloaded"] for line in shown] == [True, True]
    assert len({line["ppid"] for line in shown}) == 1  # one template forked both


def two_ranks_of_the_launcher(
    launcher: list[str], preload: str, target: list[str], cwd: Path = ROOT
) -> list[Any]:
    """Run ``aiospawn run -n 2 --preload PRELOAD TARGET`` to its end; the JSON line of each rank."""
    completed = subprocess.run(
        [*launcher, "run", "-n", "2", "--preload", preload, "--stdout", "inherit", *target],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    shown = [json.loads(line) for line in completed.stdout.splitlines()]
    assert len(shown) == 2, completed.stdout
    return shown


#: A package of the user's beside their script: ``--preload`` must find it as the rank does.
USER_PACKAGE = {
    "mypkg/__init__.py": "",
    "mypkg/model.py": "import os\n\nIMPORTED_IN = os.getpid()\n",
    "mypkg/show.py": textwrap.dedent(
        """
        import json, os, sys
        from mypkg import model

        def show(rank=0, *args):
            # One write: print() writes the newline apart, and both ranks share stdout.
            line = json.dumps({"importer": model.IMPORTED_IN, "pid": os.getpid()})
            sys.stdout.write(line + "\\n")
            sys.stdout.flush()

        if __name__ == "__main__":
            show()
        """
    ),
    "train.py": "from mypkg.show import show\n\nshow()\n",
}


@pytest.mark.parametrize(
    ("target", "from_elsewhere"),
    [(["train.py"], True), (["-m", "mypkg.show"], False), (["--fn", "mypkg.show:show"], False)],
    ids=["script", "module", "fn"],
)
def test_the_aiospawn_command_preloads_the_targets_own_modules(
    scratch: Path, target: list[str], from_elsewhere: bool
) -> None:
    for name, text in USER_PACKAGE.items():
        (scratch / name).parent.mkdir(exist_ok=True)
        (scratch / name).write_text(text)
    if from_elsewhere:  # a script's imports start from its own directory, wherever we are
        target = [str(scratch / target[0])]
    # The console command: its sys.path starts with its own directory, not ours.
    command = Path(sys.executable).with_name("aiospawn")
    shown = two_ranks_of_the_launcher(
        [str(command)], "mypkg.model", target, cwd=ROOT if from_elsewhere else scratch
    )
    # Imported once, in the template both ranks were forked from.
    assert len({line["importer"] for line in shown}) == 1, shown
    assert all(line["importer"] != line["pid"] for line in shown), shown


def fd_census() -> set[str]:
    """Every descriptor of this process, as fd:target (sockets too, which the leak check skips)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed meanwhile
            fds.add(f"{name}:{os.readlink(f'/proc/self/fd/{name}')}")
    return fds


async def test_a_template_that_dies_as_it_forks_fails_the_start_and_leaks_nothing() -> None:
    before = fd_census()
    with pytest.raises(
        _template.TemplateError,
        match=r"template \(pid \d+\) died \(exit code 5\) before it could start the rank",
    ):
        await aiospawn.start_processes(
            warm_ranks.report, nprocs=2, preload=["tests.warm_modules.dies_at_fork"]
        )
    _templates.stop_all()
    assert wait_until(lambda: fd_census() <= before), sorted(fd_census() - before)


async def test_a_template_killed_before_its_ranks_read_their_payload_fails_the_group_clearly() -> (
    None
):
    # The ranks stall before they read their payload; the template dies then,
    # and the ranks with it: their status sockets end with data unread (a reset).
    before = fd_census()
    ctx = await aiospawn.start_processes(
        warm_ranks.report, nprocs=2, join=False, preload=["tests.warm_modules.stalls_ranks"]
    )
    await join_after_killing_the_template(
        ctx, only_template(), "ranks that had not read their payload"
    )
    del ctx
    _templates.stop_all()
    assert wait_until(lambda: fd_census() <= before), sorted(fd_census() - before)


async def wait_dead(pid: int) -> None:
    """Wait until ``pid`` (a child of ours, or of one of our children) has exited."""
    with contextlib.suppress(ProcessLookupError):  # reaped already
        pidfd = os.pidfd_open(pid)
        try:
            with tripwire(60, f"the death of process {pid}"):
                await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)


async def test_a_rank_is_reported_when_its_template_died_though_a_sibling_holds_its_socket() -> (
    None
):
    # Rank 1, stalled in a preload's at-fork hook, holds the template's end of
    # rank 0's status socket and outlives the template: that socket never
    # reaches end-of-file. Rank 0 dies after the template, so no status comes.
    ctx = await aiospawn.start_processes(
        warm_ranks.report, nprocs=2, join=False, preload=["tests.warm_modules.outlives_template"]
    )
    killed = only_template()
    first, second = ctx.pids()
    os.kill(killed, signal.SIGKILL)
    await wait_dead(killed)  # first: a living template would reap rank 0 and say how it died
    os.kill(first, signal.SIGKILL)
    with (
        tripwire(60, "join() of a rank whose status socket a sibling holds"),
        pytest.raises(aiospawn.ProcessExitedException) as info,
    ):
        await ctx.join()
    assert (info.value.error_index, info.value.signal_name) == (0, "SIGKILL")
    assert f"its warm-start template (pid {killed}) died while it ran" in info.value.msg
    assert wait_until(lambda: is_gone(second))  # stopped with the group, though not its child


async def test_a_rank_whose_template_died_before_it_started_never_runs() -> None:
    # The rank's at-fork hook returns only once the template is dead: the rank
    # must not go on to run fn, a process nobody can reap or report on.
    reader, writer = multiprocessing.Pipe(duplex=False)
    with reader, writer:
        ctx = await aiospawn.start_processes(
            warm_ranks.ready_then_wait,
            args=(writer,),
            join=False,
            preload=["tests.warm_modules.waits_out_template"],
        )
        [rank] = ctx.pids()
        await join_after_killing_the_template(ctx, only_template(), "a rank that outlived it")
        assert is_gone(rank)
        assert not reader.poll(), reader.recv()


@pytest.fixture
def children_log(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where ``tests.warm_modules.leaves_children`` lists its processes; they end with the test."""
    log = scratch / "children.log"
    log.touch()
    monkeypatch.setenv("WARM_CHILDREN_LOG", str(log))
    yield log
    for pid in importers(log):  # should they have outlived their template, for the next tests
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


async def test_processes_a_preload_started_end_with_their_template(children_log: Path) -> None:
    await aiospawn.start_processes(warm_ranks.report, preload=[LEAVES_CHILDREN])
    template = only_template()
    popen, forked = importers(children_log)
    assert {psutil.Process(popen).ppid(), psutil.Process(forked).ppid()} == {template}
    _templates.stop_all()
    assert wait_until(lambda: is_gone(popen) and is_gone(forked)), "outlived their template"


async def test_a_template_reaps_the_processes_of_its_own_that_exit(children_log: Path) -> None:
    # Its subreaper's duty: a child of the preload's (or an orphan) that exits is no zombie.
    await aiospawn.start_processes(warm_ranks.report, preload=[LEAVES_CHILDREN])
    children = importers(children_log)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: all(map(is_reaped, children))), [
        psutil.Process(pid).status() for pid in children if not is_reaped(pid)
    ]


def test_the_launcher_with_a_preload_that_starts_processes_ends(children_log: Path) -> None:
    # As `aiospawn run --preload ... | cat`: the output pipe ends when the launcher does.
    with subprocess.Popen(
        [
            *(sys.executable, "-m", "aiospawn", "run", "-n", "2", "--stdout", "inherit"),
            *("--preload", LEAVES_CHILDREN, "-m", "tests.cli_programs.show_preloaded"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as launcher:
        try:
            out, err = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.communicate()
            pytest.fail("the launcher's output pipe was still open 60 s after it started")
    assert launcher.returncode == 0, err
    assert len(out.splitlines()) == 2, out
    assert not any(map(is_running, importers(children_log)))


GATED = "tests.warm_modules.gated"


@pytest.fixture
async def gate(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ImportGate]:
    """Imports of ``tests.warm_modules.gated`` wait at this gate (opened after the test)."""
    path = scratch / "gate.sock"
    listener = await anyio.create_unix_listener(path)
    monkeypatch.setenv("WARM_GATE", str(path))
    gate = ImportGate(listener)
    yield gate
    await gate.open()


@pytest.mark.parametrize("moment", ["at_once", "while_importing"])
async def test_a_warm_start_cancelled_during_its_templates_import_returns_without_it(
    gate: ImportGate, moment: str
) -> None:
    before = fd_census()
    scope = anyio.CancelScope()

    async def start() -> None:
        with scope:
            await aiospawn.start_processes(warm_ranks.report, preload=[GATED])
        assert scope.cancelled_caught, "the start ended before it was cancelled"

    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.open_after, 20)  # should the start wait for the import
        async with anyio.create_task_group() as starts:
            starts.start_soon(start)
            if moment == "at_once":
                await anyio.wait_all_tasks_blocked()
            else:
                await gate.entered()  # the template is importing
            scope.cancel()
        in_time = not gate.is_open
        blocked = our_threads_blocked()
        await gate.open()
    assert in_time, "the cancelled start waited for its template's import"
    assert blocked == []
    # The import ran on, in the template the cancelled start spawned; no rank started.
    [importing] = _templates.running_templates()
    assert psutil.Process(importing).children() == []
    [report] = await aiospawn.start_processes(warm_ranks.report, preload=[GATED])
    assert report["ppid"] == importing
    _templates.stop_all()
    assert wait_until(lambda: fd_census() <= before), sorted(fd_census() - before)


async def test_unrelated_warm_groups_do_not_wait_for_each_others_imports(gate: ImportGate) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.open_after, 20)  # should the second group wait for the import
        tg.start_soon(lambda: aiospawn.start_processes(warm_ranks.report, preload=[GATED]))
        await gate.entered()
        [report] = await aiospawn.start_processes(warm_ranks.report, preload=["json"])
        in_time = not gate.is_open
        await gate.open()  # the first group ends too
    assert in_time, "a warm group waited for another group's template to import"
    assert report["rank"] == 0


async def test_idle_templates_beyond_the_bound_are_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_templates, "MAX_TEMPLATES", 1)
    await aiospawn.start_processes(warm_ranks.report, preload=["json"])
    first = only_template()
    await aiospawn.start_processes(warm_ranks.report, preload=["decimal"])
    assert only_template() != first
    assert is_reaped(first)


async def test_a_template_idle_for_the_idle_timeout_is_stopped_at_the_next_warm_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_templates, "IDLE_TIMEOUT", 0.0)
    await aiospawn.start_processes(warm_ranks.report, preload=["json"])
    first = only_template()
    # A service that changes its environment between groups: a new key, a new template.
    monkeypatch.setenv("WARM_PROBE", "another environment")
    await aiospawn.start_processes(warm_ranks.report, preload=["json"])
    assert only_template() != first
    assert is_reaped(first)


async def test_a_template_whose_ranks_run_is_never_stopped_as_idle(
    monkeypatch: pytest.MonkeyPatch, events: tuple[Connection, Connection]
) -> None:
    monkeypatch.setattr(_templates, "MAX_TEMPLATES", 1)
    monkeypatch.setattr(_templates, "IDLE_TIMEOUT", 0.0)
    reader, writer = events
    ctx = await aiospawn.start_processes(
        warm_ranks.ready_then_wait, (writer,), join=False, preload=["json"]
    )
    [pid] = (await receive_ready(reader, 1)).values()
    busy = only_template()
    await aiospawn.start_processes(warm_ranks.report, preload=["decimal"])
    assert busy in _templates.running_templates()
    assert is_running(pid)
    await ctx.terminate()
    # Idle now: the next warm start stops it.
    await aiospawn.start_processes(warm_ranks.report, preload=["decimal"])
    assert busy not in _templates.running_templates()
    assert is_reaped(busy)


async def test_warm_starts_cancelled_at_random_points_leave_nothing_behind() -> None:
    # The template's spawn, its import, the forks, the ranks' run: each start
    # begins with no template (stop_all) and is cancelled somewhere along it.
    rng = make_rng("warm cancellation storm")
    before, children = fd_census(), live_children()
    for _ in range(scaled(12)):
        with anyio.move_on_after(rng.uniform(0, 0.6)):
            await aiospawn.start_processes(warm_ranks.report, nprocs=2, preload=["json"])
        assert our_threads_blocked() == []
        if rng.random() < 0.5:  # or the next start finds this one, ready or importing
            _templates.stop_all()
    _templates.stop_all()
    assert wait_until(lambda: live_children() <= children), live_children() - children
    assert wait_until(lambda: fd_census() <= before), sorted(fd_census() - before)
