"""Groups started from an interactive ``__main__``: ``python -c`` and a script on standard input.

Such a ``__main__`` cannot be imported again by a ``spawn`` or ``forkserver``
rank, so its functions, classes and lambdas reach the ranks by value. Each
test runs a small supervisor program in a fresh interpreter and reads its
report. (Notebook kernels are in ``test_notebook.py``.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Starts groups whose fn, argument class and lambda are all defined in
#: ``__main__``, under each start method, and prints what came back, with the
#: number of processes started and the modules the ranks had loaded.
INTERACTIVE_MAIN = """
import json, multiprocessing.process, sys
import anyio, aiospawn

started = []
real_start = multiprocessing.process.BaseProcess.start
def start(self):
    started.append(self.name)
    real_start(self)
multiprocessing.process.BaseProcess.start = start

class Scale:
    def __init__(self, by):
        self.by = by

def fn(rank, scale, shift):
    return [rank * scale.by + shift(rank), "cloudpickle" in sys.modules]

class Ceiling:
    def __lt__(self, other):
        return False
    def __gt__(self, other):
        return True

report = {}
for method in ("spawn", "forkserver", "fork"):
    async def main():
        return await aiospawn.start_processes(
            fn, (Scale(10), lambda rank: -rank), 2, start_method=method
        )
    report[method] = anyio.run(main)
    # An importable fn (a builtin) with an instance of a __main__ class.
    async def builtin():
        return await aiospawn.start_processes(min, (Ceiling(),), 2, start_method=method)
    report[method + " builtin"] = anyio.run(builtin)
    report[method + " processes started"] = len(started)
    started.clear()
print(json.dumps(report))
"""


def run_supervisor(how: str) -> dict[str, object]:
    """Run :data:`INTERACTIVE_MAIN` as ``python -c`` or ``python - < script``; return its report."""
    command = [sys.executable, "-c", INTERACTIVE_MAIN] if how == "-c" else [sys.executable, "-"]
    done = subprocess.run(
        command,
        input=None if how == "-c" else INTERACTIVE_MAIN,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_functions_classes_and_lambdas_of_an_interactive_main_run_under_every_start_method(
    how: str,
) -> None:
    report = run_supervisor(how)
    for method in ("spawn", "forkserver"):
        # By value: the rank loaded cloudpickle to read them.
        assert report[method] == [[0, True], [9, True]], report
        assert report[f"{method} processes started"] == 4
    for method in ("spawn", "forkserver", "fork"):
        assert report[f"{method} builtin"] == [0, 1], report
    # A fork rank inherits __main__ as it is: nothing is pickled.
    assert [value for value, _ in report["fork"]] == [0, 9], report  # type: ignore[attr-defined]
    assert report["fork processes started"] == 4
