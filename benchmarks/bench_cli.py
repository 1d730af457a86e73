"""Scenario ``cli``: how long ``aiospawn run -n 2`` takes on a script that does nothing.

Peers, each a command started with ``OMP_NUM_THREADS=1`` (so that neither
launcher prints its note), in a scratch directory holding the empty script:

* ``aiospawn``: ``aiospawn run -n 2 noop.py`` (the command installed next to
  this interpreter, else ``python -m aiospawn``);
* ``python x2``: two ``python noop.py`` started side by side, both waited for:
  the floor, what two ranks cost without any launcher;
* ``torchrun``: ``torchrun --nproc-per-node 2 noop.py``, if ``torchrun`` is
  installed next to this interpreter.

Each sample is the wall time from starting the command to its (last) exit. The
targets (checked in ``report.py``): aiospawn within 1.5x of ``python x2``, and
at least 5x faster than torchrun. The notes add where aiospawn's time goes: the
launcher's and a rank's slowest imports, from ``python -X importtime``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from harness import Measure, Peer, ScenarioResult, alternate, ms

NPROCS = 2

#: What the launcher imports before it starts a rank, and what each rank imports.
LAUNCHER_IMPORTS = "import aiospawn._cli, aiospawn._api, anyio, asyncio, anyio._backends._asyncio"
RANK_IMPORTS = "import multiprocessing.spawn, aiospawn._rank.bootstrap, aiospawn._cli, runpy"


def _timed(commands: list[list[str]], env: dict[str, str], cwd: str) -> float:
    """Start ``commands`` side by side; return the seconds until the last has exited."""
    began = time.perf_counter()
    running = [
        subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for command in commands
    ]
    for process in running:
        _, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"{process.args} failed ({process.returncode}):\n{err.decode()}")
    return time.perf_counter() - began


def _run(commands: list[list[str]], env: dict[str, str], cwd: str) -> Measure:
    return {"start to exit [ms]": ms(_timed(commands, env, cwd))}


def _peers(scratch: str) -> dict[str, list[list[str]]]:
    """Write the empty script in ``scratch``; the commands of each peer (torchrun if installed)."""
    script = os.path.join(scratch, "noop.py")
    Path(script).write_text("")
    bindir = Path(sys.executable).parent
    command = bindir / "aiospawn"
    launcher = [str(command)] if command.exists() else [sys.executable, "-m", "aiospawn"]
    found: dict[str, list[list[str]]] = {
        "aiospawn": [[*launcher, "run", "-n", str(NPROCS), script]],
        "python x2": [[sys.executable, script] for _ in range(NPROCS)],
    }
    torchrun = bindir / "torchrun"
    if torchrun.exists():
        found["torchrun"] = [[str(torchrun), "--nproc-per-node", str(NPROCS), script]]
    return found


def _import_profile(code: str, top: int, env: dict[str, str]) -> list[tuple[str, float]]:
    """The ``top`` slowest imports of ``python -c code``, by cumulative time, in ms."""
    subprocess.run([sys.executable, "-c", code], env=env, check=True)  # fills the cache
    completed = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in completed.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if match and not match[3]:  # top-level imports only: their times include the rest
            rows.append((match[4], int(match[2]) / 1000))
    return sorted(rows, key=lambda row: -row[1])[:top]


def _profile(result: ScenarioResult, env: dict[str, str], cwd: str) -> None:
    """Note where a run's time goes, as far as imports tell (untimed, after the trials)."""
    bare = min(_timed([[sys.executable, "-c", "pass"]], env, cwd) for _ in range(5))
    result.note(f"A bare interpreter starts and exits in {ms(bare):.1f} ms (best of 5).")
    for title, code in (("the launcher", LAUNCHER_IMPORTS), ("each rank", RANK_IMPORTS)):
        rows = _import_profile(code, 8, env)
        shown = ", ".join(f"{name} {value:.1f}" for name, value in rows)
        result.note(
            f"Slowest top-level imports of {title} (`python -X importtime -c '{code}'`,"
            f" cumulative ms): {shown}."
        )


async def cli(result: ScenarioResult, quick: bool) -> None:
    """The launcher against two plain interpreters and torchrun, on an empty script."""
    trials = 3 if quick else 10
    with tempfile.TemporaryDirectory(prefix="aiospawn-bench-cli-") as scratch:
        # The worker's environment already caches bytecode as an installed package does.
        env = dict(os.environ, OMP_NUM_THREADS="1")
        commands = _peers(scratch)
        result.note(
            f"Wall time from starting the command to its exit, {NPROCS} ranks, an empty script,"
            " OMP_NUM_THREADS=1. aiospawn: `aiospawn run -n 2 noop.py`; python x2: two"
            " `python noop.py` started side by side and both waited for (the floor: no"
            " launcher); torchrun: `torchrun --nproc-per-node 2 noop.py`. One untimed warm-up"
            " run each (page cache, bytecode)."
        )
        if "torchrun" not in commands:
            result.note("torchrun: not installed next to this interpreter, skipped.")
        peers = [
            Peer(name, partial(_run, peer_commands, env, scratch), trials, warmup=1)
            for name, peer_commands in commands.items()
        ]
        await alternate(result, f"`run -n {NPROCS}`, empty script", peers)
        _profile(result, env, scratch)
