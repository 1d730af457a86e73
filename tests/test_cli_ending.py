"""How the launcher ends a node of a job across nodes (``aiospawn._cli.end_at_once``).

A node's launcher ends as a rank does (``aiospawn._rank.ending``): Python's
exit steps, then ``os._exit``, never the interpreter's finalization. Each
case runs in a fresh interpreter; the whole launcher's ending is checked in
``test_cli_nodes.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.cli_helpers import REPO, TRIPWIRE

# A store call abandoned in a daemon thread, as the launcher leaves one when
# it stops waiting (``_rounds.off_loop``), that returns while the process
# ends. The interpreter's finalization, once torch is imported, takes longer
# than the wait: without skipping it, the thread leaves torch's C++ code
# mid-finalization and the process aborts (SIGABRT) after its report, its
# status lost. An atexit handler and unflushed output show the exit steps ran.
ENDING = textwrap.dedent(
    """
    import atexit, contextlib, sys, threading
    from datetime import timedelta
    from torch._C._distributed_c10d import TCPStore
    from aiospawn._cli import end_at_once

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    waiting = threading.Event()

    def wait():
        waiting.set()
        with contextlib.suppress(RuntimeError):
            store.wait(["never"], timedelta(seconds=float(sys.argv[1])))

    threading.Thread(target=wait, daemon=True).start()
    waiting.wait()
    atexit.register(print, "atexit ran", file=sys.stderr)
    print("the report", end="")  # not flushed yet: the exit steps flush it
    end_at_once(3)
    """
)


@pytest.mark.torch
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install torch==2.13.0)",
)
@pytest.mark.parametrize("wait", [0.1, 0.3])
def test_a_store_call_returning_as_the_launcher_ends_leaves_its_status_and_output(
    wait: float,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", ENDING, str(wait)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TRIPWIRE,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "the report"
    assert "atexit ran" in done.stderr
    assert "terminate called" not in done.stderr
