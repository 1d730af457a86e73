"""How the launcher ends a node of a multi-node job (``aiospawn._cli.end_at_once``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.cli_helpers import REPO, TRIPWIRE

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not installed (pip install torch==2.13.0)",
    ),
]

# A store call abandoned in a daemon thread, as the launcher leaves one when
# it stops waiting (off_loop), that returns while the process ends: the
# interpreter's finalization takes longer than the wait here, so without
# skipping it the thread leaves torch's C++ code mid-finalization and the
# process aborts (SIGABRT) after its report, with its status lost.
ENDING = textwrap.dedent(
    """
    import contextlib, sys, threading, time
    from datetime import timedelta
    from torch._C._distributed_c10d import TCPStore
    from aiospawn._cli import end_at_once

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def wait():
        with contextlib.suppress(RuntimeError):
            store.wait(["never"], timedelta(seconds=float(sys.argv[1])))

    threading.Thread(target=wait, daemon=True).start()
    time.sleep(0.05)
    print("the report", end="")  # not flushed yet: end_at_once must flush it
    print("the log", file=sys.stderr, end="")
    end_at_once(3)
    """
)


@pytest.mark.parametrize("wait", [0.1, 0.3, 0.6])
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
    assert "the log" in done.stderr
    assert "terminate called" not in done.stderr
