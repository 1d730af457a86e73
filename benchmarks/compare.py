"""Compare two checkouts of aiospawn on the same scenarios, in alternation, in one run.

    python benchmarks/compare.py --before /tmp/old --after . --rounds 4
    python benchmarks/compare.py --before /tmp/old --after . --quick --rounds 1
    python benchmarks/compare.py ... --scenarios compact-live,compact-unjoined --append results.md

The benchmarks' own code is this directory's, for both checkouts; only the
library differs. Each run of a scenario is a fresh interpreter
(``run.py --worker``) with ``PYTHONPATH=<checkout>/src`` in front, which
``spawn`` and ``forkserver`` ranks inherit; every run records the directory
of the ``aiospawn`` it imported, and a probe checks the ranks' too, so a run
that picked up the wrong library fails the comparison instead of hiding in it.

Round after round, each scenario runs for both checkouts back to back, the
order flipped every round (A B, B A, ...), so that a drift of the machine's
load touches both alike. The load average is recorded before and after
every run. The samples of all rounds are pooled per figure; the section
written gives, per figure, the median before and after, their ratio, the
maxima, and the loads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from harness import ScenarioResult, Series, percentile, progress
from report import fmt, machine
from run import COMPACT, SCENARIOS, _worker_env

HERE = os.path.dirname(os.path.abspath(__file__))

#: What a comparison runs unless told otherwise: what issue 25 asks for, without torch.
DEFAULT_SCENARIOS = (
    "compact-startup",
    "compact-failure",
    "compact-teardown",
    "compact-lag",
    "compact-live",
    "compact-unjoined",
)

#: Run with the checkout's PYTHONPATH: which ``aiospawn`` the parent and its ranks import.
PROBE = """
import anyio, aiospawn, workloads

async def main():
    print("parent", aiospawn.__file__)
    for method in ("spawn", "forkserver", "fork"):
        [origin] = await aiospawn.start_processes(
            workloads.aiospawn_origin, nprocs=1, start_method=method
        )
        print(method, origin)

anyio.run(main)
"""


@dataclass
class Checkout:
    """One side of the comparison: a checkout of the library and what it measured."""

    label: str
    root: str
    commit: str = ""
    subject: str = ""
    dirty: bool = False
    results: dict[str, list[ScenarioResult]] = field(default_factory=dict)
    #: Per scenario, per run: cores' worth of CPU that other processes used meanwhile.
    others: dict[str, list[float]] = field(default_factory=dict)

    @property
    def src(self) -> str:
        return os.path.join(self.root, "src")

    def env(self) -> dict[str, str]:
        env = _worker_env(HERE)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [self.src, HERE, os.environ.get("PYTHONPATH")])
        )
        return env

    def describe(self) -> None:
        def git(*args: str) -> str:
            command = ["git", "-C", self.root, *args]
            return subprocess.run(command, capture_output=True, text=True, check=True).stdout

        self.commit = git("rev-parse", "HEAD").strip()
        self.subject = git("log", "-1", "--format=%s").strip()
        self.dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "src").strip())


def check_library(checkout: Checkout) -> None:
    """Compile the checkout's bytecode, then prove its parent and ranks import it."""
    env = checkout.env()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", checkout.src, HERE], env=env, check=True
    )
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=HERE, capture_output=True, text=True, check=True
    )
    expected = os.path.realpath(checkout.src) + os.sep
    for line in probe.stdout.splitlines():
        where, path = line.split(" ", 1)
        progress(f"[{checkout.label}] {where}: {path}")
        if not os.path.realpath(path).startswith(expected):
            raise SystemExit(f"{checkout.label}: {where} imported {path}, not {checkout.src}")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot (``/proc/stat``)."""
    with open("/proc/stat") as file:
        fields = [int(value) for value in file.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(checkout: Checkout, name: str, quick: bool, scratch: str, tag: str) -> ScenarioResult:
    """One fresh interpreter running scenario ``name`` against ``checkout``.

    Records in ``checkout.others`` how many cores other processes kept busy
    meanwhile: the machine's busy CPU time less the run's own (the worker and
    every rank it reaped), over the run's wall time. The load average lags by
    a minute; this does not.
    """
    json_path = os.path.join(scratch, f"{len(os.listdir(scratch))}-{checkout.label}-{name}.json")
    command = [sys.executable, os.path.join(HERE, "run.py"), "--worker", name, "--json", json_path]
    if quick:
        command.append("--quick")
    progress(f"== {tag} {checkout.label} ({checkout.commit[:7]}): {name}")
    wall, busy, ours = time.monotonic(), _busy_seconds(), _children_seconds()
    completed = subprocess.run(command, env=checkout.env(), cwd=HERE, check=False)
    wall = time.monotonic() - wall
    busy, ours = _busy_seconds() - busy, _children_seconds() - ours
    checkout.others.setdefault(name, []).append(max(0.0, busy - ours) / wall)
    if completed.returncode != 0 or not os.path.exists(json_path):
        raise SystemExit(f"{name} failed for {checkout.label} (exit code {completed.returncode})")
    with open(json_path) as file:
        result = ScenarioResult.from_json(json.load(file))
    expected = os.path.join(os.path.realpath(checkout.src), "aiospawn")
    if os.path.realpath(result.library) != expected:
        raise SystemExit(f"{name} for {checkout.label} ran {result.library}, not {expected}")
    return result


def pooled(results: list[ScenarioResult]) -> dict[tuple[str, str, str], Series]:
    """Every round's samples of each (case, metric, peer), in first-seen order."""
    merged: dict[tuple[str, str, str], Series] = {}
    for result in results:
        for item in result.series:
            key = (item.case, item.metric, item.peer)
            if key not in merged:
                merged[key] = Series(item.scenario, item.case, item.metric, item.peer, [])
            merged[key].samples.extend(item.samples)
    return merged


def _loads(side: Checkout, name: str) -> str:
    return ", ".join(
        f"{result.load_before[0]:.1f} ({result.seconds:.0f} s, {others:.1f})"
        for result, others in zip(side.results[name], side.others[name], strict=True)
    )


def section(before: Checkout, after: Checkout, names: list[str], mode: str) -> str:
    """The Markdown section: commits, machine, loads, a table per scenario, the verdicts."""
    host = machine()
    every = [r for side in (before, after) for name in names for r in side.results[name]]
    ones = sorted(r.load_before[0] for r in every)
    others = {
        side.label: sorted(value for name in names for value in side.others[name])
        for side in (before, after)
    }
    out = [
        f"## Before and after the group's owner (issue 25), {host['date']}",
        "",
        f"- Machine: {host['cores']} cores, {host['cpu']}; {host['python']};"
        f" kernel {host['kernel']}",
        f"- {mode}",
    ]
    bench = subprocess.run(
        ["git", "-C", HERE, "log", "-1", "--format=%h"], capture_output=True, text=True, check=False
    ).stdout.strip()
    out.append(f"- Benchmark code (both sides): `benchmarks/` at {bench or 'unknown'}")
    for side in (before, after):
        dirty = " (with uncommitted changes under src/)" if side.dirty else ""
        # The commit, not the checkout's path: a path says nothing to a reader elsewhere.
        out.append(f'- {side.label}: {side.commit[:10]}{dirty}, "{side.subject}"')
    out += [
        f"- Load average (1 min) before the {len(every)} runs: median"
        f" {percentile(ones, 50):.1f}, from {ones[0]:.1f} to {ones[-1]:.1f} (2 cores: above"
        " about 1 the figures are noisy; compare the two sides, and each side's floor rows,"
        " which do not depend on aiospawn).",
        "- Cores other processes kept busy during the runs (the machine's busy CPU time less"
        " the run's own, over its wall time), median: "
        + "; ".join(f"{label} {percentile(values, 50):.2f}" for label, values in others.items())
        + ".",
        "",
        "Each scenario ran for both checkouts back to back, in fresh interpreters with"
        " `PYTHONPATH=<checkout>/src` (checked: the parent and its spawn, forkserver and fork"
        " ranks imported that checkout), the order flipped every round; the benchmark code is"
        " this branch's for both. Medians and maxima are over every sample of every round (n"
        " each); 'after / before' divides the medians (below 1 is faster, but for MB/s).",
        "",
    ]
    for name in names:
        title = {**SCENARIOS, **COMPACT}[name][2]
        out += [f"### {title} (`{name}`)", ""]
        old, new = pooled(before.results[name]), pooled(after.results[name])
        out += [
            "| case | metric | peer | before | after | after / before | max before | max after"
            " | n |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, item in old.items():
            other = new.get(key)
            if other is None:
                continue
            ratio = f"{other.median / item.median:.2f}x" if item.median else "-"
            case, metric, peer = key
            out.append(
                f"| {case} | {metric} | {peer} | {fmt(item.median)} | {fmt(other.median)}"
                f" | {ratio} | {fmt(max(item.samples))} | {fmt(max(other.samples))}"
                f" | {len(item.samples)}, {len(other.samples)} |"
            )
        out += [
            "",
            "Load average (1 min) before each run (the run's time, and the cores other"
            f" processes kept busy meanwhile): before {_loads(before, name)};"
            f" after {_loads(after, name)}.",
            "",
        ]
    for name in ("unjoined", "compact-unjoined"):
        if name in names:
            out += verdicts(before, after, name)
    return "\n".join(out)


def verdicts(before: Checkout, after: Checkout, name: str) -> list[str]:
    """Issue 25's two figures: reaping within 100 ms, and the round trip of a block."""
    out = [f"### A `join=False` group nobody joins: the issue's bounds (`{name}`)", ""]
    for side in (before, after):
        series = pooled(side.results[name])
        reap = next(
            s
            for k, s in series.items()
            if k[1] == "exit to reaped [ms]" and k[2] == "join=False, nobody joins"
        )
        within = sum(value <= 100.0 for value in reap.samples)
        trip = {k[2]: s.median for k, s in series.items() if k[1] == "p50 [µs]"}
        unjoined, block = trip["join=False, nobody joins"], trip["open_group block"]
        out.append(
            f"- {side.label}: exits reaped within 100 ms: {within} of {len(reap.samples)}"
            f" (median {fmt(reap.median)} ms, max {fmt(max(reap.samples))} ms);"
            f" 64 B round trip p50 unjoined {fmt(unjoined)} µs against {fmt(block)} µs in a"
            f" block ({unjoined / block:.2f}x)."
        )
    out.append("")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="checkout measured as 'before'")
    parser.add_argument("--after", required=True, help="checkout measured as 'after'")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two (3)")
    parser.add_argument(
        "--budget",
        type=float,
        help="minutes: start no round once the time so far plus the slowest round exceeds this",
    )
    parser.add_argument("--quick", action="store_true", help="the scenarios' --quick sizes")
    parser.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help=f"comma-separated run.py scenario names (default: {','.join(DEFAULT_SCENARIOS)})",
    )
    parser.add_argument("--out", help="write the Markdown section to this file")
    parser.add_argument("--append", help="append the Markdown section to this file")
    args = parser.parse_args(argv)
    names = [name for name in args.scenarios.split(",") if name]
    unknown = [name for name in names if name not in {**SCENARIOS, **COMPACT}]
    if unknown:
        parser.error(f"unknown scenarios {unknown!r}")
    sides = [
        Checkout("before", os.path.abspath(args.before)),
        Checkout("after", os.path.abspath(args.after)),
    ]
    for side in sides:
        side.describe()
        check_library(side)
        side.results = {name: [] for name in names}
    started = time.monotonic()
    slowest = 0.0
    rounds = 0
    with tempfile.TemporaryDirectory(prefix="aiospawn-compare-") as scratch:
        for round_index in range(args.rounds):
            elapsed = time.monotonic() - started
            if args.budget is not None and rounds and elapsed + slowest > args.budget * 60:
                progress(f"compare.py: stopping after {rounds} rounds (--budget {args.budget:g})")
                break
            began = time.monotonic()
            for name in names:
                order = sides if round_index % 2 == 0 else sides[::-1]
                for side in order:
                    tag = f"round {round_index + 1}/{args.rounds}"
                    side.results[name].append(run_one(side, name, args.quick, scratch, tag))
            slowest = max(slowest, time.monotonic() - began)
            rounds += 1
    minutes = (time.monotonic() - started) / 60
    command = f"--rounds {args.rounds}" + (f" --budget {args.budget:g}" if args.budget else "")
    mode = (
        f"Mode: {'quick' if args.quick else 'full'} sizes, {rounds} rounds,"
        f" {minutes:.0f} min in all, aiospawn on asyncio;"
        f" `benchmarks/compare.py {command}{' --quick' if args.quick else ''}`"
    )
    text = section(sides[0], sides[1], names, mode)
    print(text)
    if args.out:
        with open(args.out, "w") as file:
            file.write(text + "\n")
    if args.append:
        with open(args.append, "a") as file:
            file.write("\n" + text + "\n")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M UTC")
    progress(f"compare.py: done at {stamp}, {minutes:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
