"""How long ``aiospawn run -n 2`` takes on a script that does nothing, against its peers.

Peers, run in alternation (A B C A B C ...) so that a drift of the machine's
load touches each alike, after one untimed warm-up run each:

* ``aiospawn``: ``aiospawn run -n 2 noop.py`` (the installed command);
* ``python x2``: two ``python noop.py`` started side by side, both waited for:
  the floor, what two ranks cost without any launcher;
* ``torchrun``: ``torchrun --nproc-per-node 2 noop.py``, if ``torchrun`` is
  installed next to this interpreter.

Each sample is the wall time from starting the command to its exit, with
``OMP_NUM_THREADS=1`` set (so neither launcher prints its note). Prints the
median and 95th percentile of each peer, and the ratios the targets are
stated in: aiospawn within 1.5x of ``python x2``, and at least 5x faster than
torchrun. ``--profile`` adds where aiospawn's time goes: the launcher's and a
rank's imports, from ``python -X importtime``.

Usage::

    .venv/bin/python benchmarks/bench_cli.py [--trials 10] [--profile] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NPROCS = 2

#: Targets: aiospawn / python x2 at most this, torchrun / aiospawn at least this.
MAX_RATIO_TO_PYTHON = 1.5
MIN_SPEEDUP_OVER_TORCHRUN = 5.0


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile, interpolated between the nearest ranks."""
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def timed(commands: list[list[str]], env: dict[str, str], cwd: str) -> float:
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
            raise SystemExit(f"{process.args} failed ({process.returncode}):\n{err.decode()}")
    return time.perf_counter() - began


def peers(script: str) -> dict[str, list[list[str]]]:
    """The commands of each peer; torchrun only if it is installed."""
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


def bench_env(tmp: str) -> dict[str, str]:
    """The peers' environment: no OMP note, and compiled modules cached as installed.

    Without a bytecode cache (``PYTHONDONTWRITEBYTECODE``, or a source tree
    nobody may write to) every process compiles aiospawn's modules again,
    which costs more than running them; an installed package has its cache.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPYCACHEPREFIX=os.path.join(tmp, "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def measure(trials: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="aiospawn-bench-cli-") as tmp:
        env = bench_env(tmp)
        script = os.path.join(tmp, "noop.py")
        Path(script).write_text("")
        commands = peers(script)
        for peer_commands in commands.values():  # warm-up: page cache, .pyc files
            timed(peer_commands, env, tmp)
        samples: dict[str, list[float]] = {name: [] for name in commands}
        for trial in range(trials):
            for name, peer_commands in commands.items():
                samples[name].append(timed(peer_commands, env, tmp))
            print(f"trial {trial + 1}/{trials}", file=sys.stderr, end="\r", flush=True)
        print(file=sys.stderr)
    return samples


def report(samples: dict[str, list[float]]) -> dict[str, float]:
    print(f"{'peer':<10} {'median':>10} {'p95':>10}  ({len(next(iter(samples.values())))} trials)")
    for name, values in samples.items():
        median, p95 = statistics.median(values) * 1000, percentile(values, 95) * 1000
        print(f"{name:<10} {median:>8.1f} ms {p95:>7.1f} ms")
    median = {name: statistics.median(values) for name, values in samples.items()}
    ratios = {"aiospawn / python x2": median["aiospawn"] / median["python x2"]}
    verdicts = {"aiospawn / python x2": ratios["aiospawn / python x2"] <= MAX_RATIO_TO_PYTHON}
    if "torchrun" in median:
        ratios["torchrun / aiospawn"] = median["torchrun"] / median["aiospawn"]
        verdicts["torchrun / aiospawn"] = ratios["torchrun / aiospawn"] >= MIN_SPEEDUP_OVER_TORCHRUN
    else:
        print("torchrun: not installed next to this interpreter, skipped")
    targets = {
        "aiospawn / python x2": f"<= {MAX_RATIO_TO_PYTHON}",
        "torchrun / aiospawn": f">= {MIN_SPEEDUP_OVER_TORCHRUN}",
    }
    for name, ratio in ratios.items():
        verdict = "met" if verdicts[name] else "MISSED"
        print(f"{name:<22} {ratio:6.2f}x  (target {targets[name]}: {verdict})")
    return ratios


def import_profile(code: str, top: int, env: dict[str, str]) -> list[tuple[str, float]]:
    """The ``top`` slowest imports of ``python -c code``, by cumulative time, in ms."""
    subprocess.run([sys.executable, "-c", code], env=env, check=True)  # fills the cache
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if match and not match[3]:  # top-level imports only: their times include the rest
            rows.append((match[4], int(match[2]) / 1000))
    return sorted(rows, key=lambda row: -row[1])[:top]


def profile() -> None:
    """Where a run's time goes, as far as imports tell."""
    with tempfile.TemporaryDirectory(prefix="aiospawn-bench-cli-") as tmp:
        env = bench_env(tmp)
        bare = min(timed([[sys.executable, "-c", "pass"]], env, ".") for _ in range(5))
        print(f"\nbare interpreter start and exit: {bare * 1000:.1f} ms")
        launcher = "import aiospawn._cli, aiospawn._api, anyio, asyncio, anyio._backends._asyncio"
        rank = "import multiprocessing.spawn, aiospawn._child, aiospawn._cli, runpy"
        for title, code in (("launcher", launcher), ("each rank", rank)):
            rows = import_profile(code, 8, env)
            print(f"{title}: slowest top-level imports (cumulative ms) of `{code}`:")
            for name, ms in rows:
                print(f"  {ms:7.1f}  {name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also profile the imports")
    parser.add_argument("--json", metavar="FILE", help="write the samples and ratios here")
    options = parser.parse_args(argv)
    samples = measure(options.trials)
    ratios = report(samples)
    if options.profile:
        profile()
    if options.json:
        Path(options.json).write_text(json.dumps({"samples": samples, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
