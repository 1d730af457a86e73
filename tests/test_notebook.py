"""Real notebooks in a real kernel: ipykernel, run through nbclient and jupyter_client.

Functions defined in cells run in ranks under every start method; rank output
and a rank's error show in the cell; cancelling, interrupting, shutting down or
restarting the kernel leaves no rank; ``aiospawn.sync`` works in a synchronous
cell. Most tests share one kernel (started once for the module, as a notebook
session would be); those that end a kernel, and the notebooks run whole by
nbclient, start their own. Every assertion reads what the cells output.

The kernel is this interpreter's ipykernel, through a kernelspec written into
a temporary Jupyter directory, where its runtime files and temp files go too.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from tests.helpers import is_gone, wait_until

KERNEL_NAME = "aiospawn-test"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: Seconds any one kernel message may take: a tripwire, not a synchronization.
PATIENCE = 90

#: A rank that reports its pid as a line of output, then runs until stopped,
#: saying so when a SIGTERM stops it.
READY_FOREVER = """
import os, signal, sys, time

def ready_forever(rank):
    def stop(signum, frame):
        print("stopped by SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        time.sleep(3600)
"""


class Kernel:
    """One ipykernel process, and a blocking client that keeps every IOPub message it reads."""

    def __init__(self, env: dict[str, str]) -> None:
        self.manager = KernelManager(kernel_name=KERNEL_NAME)
        self.manager.start_kernel(env=env)
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=PATIENCE)
        self.messages: list[dict[str, Any]] = []

    def execute(self, code: str) -> str:
        """Send a cell; return its message id without waiting for it."""
        msg_id: str = self.client.execute(textwrap.dedent(code))
        return msg_id

    def run(self, code: str) -> list[Any]:
        """Run a cell; return its outputs (nbformat output nodes) once it is done."""
        return self.outputs(self.execute(code))

    def outputs(self, msg_id: str) -> list[Any]:
        """The outputs of cell ``msg_id``, once the kernel says it is idle after it."""
        self.wait_for(
            lambda msg: msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle",
            msg_id,
            "the end of the cell",
        )
        return [
            nbformat.v4.output_from_msg(msg)
            for msg in self.messages
            if parent_id(msg) == msg_id
            and msg["msg_type"] in ("stream", "error", "execute_result", "display_data")
        ]

    def wait_for_line(self, msg_id: str, pattern: str) -> re.Match[str]:
        """Wait until cell ``msg_id`` printed a line matching ``pattern``; return the match."""
        found: list[re.Match[str]] = []

        def matches(msg: dict[str, Any]) -> bool:
            if msg["msg_type"] != "stream":
                return False
            found[:] = list(re.finditer(pattern, msg["content"]["text"], re.M))[:1]
            return bool(found)

        self.wait_for(matches, msg_id, f"a line matching {pattern!r}")
        return found[0]

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], msg_id: str, what: str) -> None:
        """Read IOPub until a message of cell ``msg_id`` satisfies ``predicate``."""
        for msg in self.messages:
            if parent_id(msg) == msg_id and predicate(msg):
                return
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=PATIENCE)
            except queue.Empty:
                pytest.fail(f"deadlock: no {what} from the kernel within {PATIENCE} s")
            self.messages.append(msg)
            if parent_id(msg) == msg_id and predicate(msg):
                return

    def shutdown(self, *, now: bool = False) -> None:
        """Shut the kernel down (``now``: kill it) and reap it."""
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=now)


def parent_id(msg: dict[str, Any]) -> str | None:
    """The message id of the cell a message belongs to."""
    parent: str | None = msg["parent_header"].get("msg_id")
    return parent


def text(outputs: list[Any], name: str) -> str:
    """Everything the cell wrote to one stream."""
    return "".join(out["text"] for out in outputs if out.get("name") == name)


def errors(outputs: list[Any]) -> list[Any]:
    """The error outputs of a cell."""
    return [out for out in outputs if out["output_type"] == "error"]


def assert_no_error(outputs: list[Any]) -> None:
    assert not errors(outputs), "\n".join(
        line for error in errors(outputs) for line in error["traceback"]
    )


@pytest.fixture(scope="module")
def jupyter_root() -> Iterator[Path]:
    """A directory for everything Jupyter and the tests write, removed at the end."""
    root = Path(tempfile.mkdtemp(prefix="aiospawn-jupyter-"))
    yield root
    shutil.rmtree(root)


@pytest.fixture
def scratch(jupyter_root: Path) -> Path:
    """A fresh directory for one test (pytest's tmp_path would outlive the temp-file check)."""
    return Path(tempfile.mkdtemp(dir=jupyter_root / "tmp"))


@pytest.fixture(scope="module")
def kernel_env(jupyter_root: Path) -> Iterator[dict[str, str]]:
    """A private Jupyter setup: a kernelspec for this interpreter, runtime and temp dirs."""
    root = jupyter_root
    spec_dir = root / "data" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec_dir / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "aiospawn tests", "language": "python"})
    )
    (root / "tmp").mkdir()
    dirs = {
        "JUPYTER_DATA_DIR": str(root / "data"),
        "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
        "JUPYTER_CONFIG_DIR": str(root / "config"),
        "IPYTHONDIR": str(root / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in dirs.items():
            patch.setenv(name, value)
        # The kernel's own temp files (its cells' code files) go to our dir.
        yield {**os.environ, "TMPDIR": str(root / "tmp")}


@pytest.fixture(scope="module")
def kernel(kernel_env: dict[str, str]) -> Iterator[Kernel]:
    """The module's kernel, with the helper processes it keeps (fork server, resource tracker)."""
    shared = Kernel(kernel_env)
    # Started once per kernel and kept until it exits, as in the test process.
    assert_no_error(
        shared.run(
            """
            import multiprocessing.forkserver, multiprocessing.resource_tracker
            multiprocessing.forkserver.ensure_running()
            multiprocessing.resource_tracker.ensure_running()
            """
        )
    )
    yield shared
    shared.shutdown()


def test_rank_output_appears_in_its_cell_line_by_line_as_it_is_produced(
    kernel: Kernel, scratch: Path
) -> None:
    gates = [scratch / f"gate{rank}" for rank in range(2)]
    for gate in gates:
        os.mkfifo(gate)
    cell = kernel.execute(
        f"""
        import sys, aiospawn

        def talk(rank, gates):
            print(f"first from {{rank}}", flush=True)
            with open(gates[rank]) as gate:  # blocks until the test opens it
                gate.read()
            print(f"second from {{rank}}")
            print(f"to stderr from {{rank}}", file=sys.stderr)

        await aiospawn.start_processes(talk, ({[str(gate) for gate in gates]!r},), 2)
        """
    )
    for rank, gate in enumerate(gates):
        # Shown while the rank still runs: it waits for the gate below.
        kernel.wait_for_line(cell, rf"^\[rank{rank}\]: first from {rank}$")
        gate.write_text("go")
    outputs = kernel.outputs(cell)
    assert_no_error(outputs)
    stdout, stderr = text(outputs, "stdout"), text(outputs, "stderr")
    for rank in range(2):
        assert f"[rank{rank}]: second from {rank}\n" in stdout
        assert f"[rank{rank}]: to stderr from {rank}\n" in stderr


def test_lines_of_a_group_started_in_one_cell_stay_in_that_cell_while_another_runs(
    kernel: Kernel, scratch: Path
) -> None:
    gate = scratch / "gate"
    os.mkfifo(gate)
    first = kernel.execute(
        f"""
        import asyncio, aiospawn

        def talk_later(rank, gate):
            print("early", flush=True)
            with open(gate) as opened:
                opened.read()
            print("late", flush=True)

        background = asyncio.ensure_future(
            aiospawn.start_processes(talk_later, ({str(gate)!r},), 1)
        )
        """
    )
    kernel.wait_for_line(first, r"^\[rank0\]: early$")
    assert_no_error(kernel.outputs(first))
    second = kernel.execute('await background\nprint("second cell done")')
    # The kernel runs the second cell (it announces its input once it is that
    # cell's turn) when the rank writes its next line.
    kernel.wait_for(lambda msg: msg["msg_type"] == "execute_input", second, "second cell start")
    gate.write_text("go")
    assert_no_error(kernel.outputs(second))
    # Written while the second cell ran, shown in the cell that started the group.
    kernel.wait_for_line(first, r"^\[rank0\]: late$")
    assert "[rank0]" not in text(kernel.outputs(second), "stdout")
    assert text(kernel.outputs(second), "stdout") == "second cell done\n"


def test_open_group_under_a_deadline_cancelled_from_a_cell_leaves_no_rank(
    kernel: Kernel,
) -> None:
    outputs = kernel.run(
        """
        import json, multiprocessing, os, time
        import anyio, aiospawn

        def report_then_wait(rank, writer):
            writer.send(os.getpid())
            while True:
                time.sleep(3600)

        reader, writer = multiprocessing.Pipe(duplex=False)
        with anyio.move_on_after(600) as scope:
            async with aiospawn.open_group(report_then_wait, (writer,), 2) as ctx:
                pids = [await anyio.to_thread.run_sync(reader.recv) for _ in range(2)]
                scope.deadline = anyio.current_time()  # due now, with both ranks running
                await anyio.sleep_forever()
        print(json.dumps({"pids": pids, "cancelled": scope.cancelled_caught}))
        """
    )
    assert_no_error(outputs)
    report = json.loads(text(outputs, "stdout"))
    assert report["cancelled"] is True
    assert len(report["pids"]) == 2
    assert all(is_gone(pid) for pid in report["pids"])


@pytest.mark.parametrize(
    ("call", "raised"),
    [
        pytest.param(
            "await aiospawn.start_processes(ready_forever, nprocs=2)", "CancelledError", id="async"
        ),
        pytest.param(
            "aiospawn.sync.spawn(ready_forever, nprocs=2)", "KeyboardInterrupt", id="sync"
        ),
    ],
)
def test_a_kernel_interrupt_stops_the_ranks_gracefully_and_the_kernel_stays_usable(
    kernel: Kernel, call: str, raised: str
) -> None:
    cell = kernel.execute(f"import aiospawn, aiospawn.sync\n{READY_FOREVER}\n{call}")
    pids = [
        int(kernel.wait_for_line(cell, rf"^\[rank{rank}\]: ready (\d+)$")[1]) for rank in (0, 1)
    ]
    kernel.manager.interrupt_kernel()
    outputs = kernel.outputs(cell)
    assert [error["ename"] for error in errors(outputs)] == [raised]
    stdout = text(outputs, "stdout")
    assert "[rank0]: stopped by SIGTERM" in stdout
    assert "[rank1]: stopped by SIGTERM" in stdout
    assert all(is_gone(pid) for pid in pids)
    after = kernel.run("print(6 * 7)")
    assert_no_error(after)
    assert text(after, "stdout") == "42\n"


def test_the_sync_drop_in_runs_in_a_sync_cell_and_refuses_in_a_coroutine(kernel: Kernel) -> None:
    outputs = kernel.run(
        """
        import aiospawn.sync as mp

        def square(rank, offset):
            print(f"square {rank * rank + offset}")

        mp.spawn(square, args=(100,), nprocs=2, start_method="spawn")
        context = mp.start_processes(square, args=(200,), nprocs=2, join=False)
        while not context.join():
            pass
        print("joined")
        """
    )
    assert_no_error(outputs)
    stdout = text(outputs, "stdout")
    for line in ("[rank0]: square 100", "[rank1]: square 101", "[rank1]: square 201", "joined"):
        assert line + "\n" in stdout
    inside_a_coroutine = kernel.run(
        """
        async def blocks_the_loop():
            mp.spawn(square, args=(0,), nprocs=1)

        await blocks_the_loop()
        """
    )
    [error] = errors(inside_a_coroutine)
    assert error["ename"] == "RuntimeError"
    assert "blocks its thread" in error["evalue"]
    assert "[rank0]" not in text(inside_a_coroutine, "stdout")  # refused before any start


@pytest.mark.parametrize("how", ["shutdown", "restart"])
def test_a_kernel_shutdown_or_restart_with_ranks_running_leaves_no_process(
    kernel_env: dict[str, str], how: str
) -> None:
    own = Kernel(kernel_env)
    try:
        cell = own.execute(
            "import asyncio, aiospawn\n"
            + READY_FOREVER
            + "\nrunning = asyncio.ensure_future(aiospawn.start_processes(ready_forever, nprocs=2))"
        )
        match = [own.wait_for_line(cell, rf"^\[rank{rank}\]: ready (\d+)$") for rank in (0, 1)]
        pids = [int(found[1]) for found in match]
        kernel_pid = own.manager.provisioner.pid  # type: ignore[union-attr]
        if how == "restart":
            own.manager.restart_kernel(now=True)
            assert wait_until(lambda: is_gone(kernel_pid), PATIENCE)
        assert all(pids)
    finally:
        own.shutdown()
    assert wait_until(lambda: all(is_gone(pid) for pid in pids), PATIENCE)


def run_notebook(path_or_nb: Path | Any, env: dict[str, str], cwd: Path) -> Any:
    """Execute a notebook whole with nbclient in a new kernel; return it with its outputs."""
    nb = nbformat.read(path_or_nb, as_version=4) if isinstance(path_or_nb, Path) else path_or_nb
    client = NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=PATIENCE,
        allow_errors=False,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute(env=env)
    return nb


def test_cell_functions_run_in_ranks_under_every_start_method_and_a_failure_shows(
    kernel_env: dict[str, str], scratch: Path
) -> None:
    cells = [
        """
        import json, aiospawn

        class Scale:
            def __init__(self, by):
                self.by = by

        def scaled(rank, scale, shift):
            return rank * scale.by + shift(rank)
        """,
        """
        results = {}
        for method in ("spawn", "forkserver", "fork"):
            results[method] = await aiospawn.start_processes(
                scaled, (Scale(10), lambda rank: -rank), 3, start_method=method
            )
        print(json.dumps(results))
        """,
        """
        def diverges(rank, step):
            if rank == 1:
                raise ValueError(f"rank {rank}: loss became NaN at step {step}")

        await aiospawn.start_processes(diverges, (3,), 2)
        """,
    ]
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(textwrap.dedent(source)) for source in cells]
    )
    nb.cells[2].metadata["tags"] = ["raises-exception"]
    run_notebook(nb, kernel_env, scratch)
    defined, ran, failed = (cell.outputs for cell in nb.cells)
    assert defined == []
    expected = [0, 9, 18]
    assert json.loads(text(ran, "stdout")) == dict.fromkeys(
        ["spawn", "forkserver", "fork"], expected
    )
    [error] = errors(failed)
    assert error["ename"] == "ProcessRaisedException"
    shown = "\n".join(error["traceback"])
    # The rank's own traceback, as in a script: its frame and its message.
    assert "-- Process 1 terminated with the following error:" in shown
    assert "in diverges" in shown
    assert "ValueError: rank 1: loss became NaN at step 3" in shown


def test_the_example_notebook_runs(kernel_env: dict[str, str], scratch: Path) -> None:
    nb = run_notebook(EXAMPLES / "notebook.ipynb", kernel_env, scratch)
    # A stream's text carries its own newlines, and one print() may come in
    # two outputs (the kernel flushed between its parts): joined as written.
    shown = "".join(
        out.get("text", "") + "".join(f"{line}\n" for line in out.get("traceback", []))
        for cell in nb.cells
        for out in cell.get("outputs", [])
    )
    for expected in EXPECTED_IN_THE_EXAMPLE:
        assert expected in shown, shown


EXPECTED_IN_THE_EXAMPLE = [
    "[rank0]: rank 0 of 4 says hello",
    "[rank3]: rank 3 of 4 says hello",
    "results: [0, 1, 4, 9]",
    "ValueError: rank 2: loss became NaN",
    "cancelled: True",
    "[rank1]: training on rank 1",
    "spawn returned",
]
