"""Benchmark aiospawn against torch.multiprocessing, plain multiprocessing and torchrun.

    python benchmarks/run.py             # every scenario but ray and dataplane; about 10 min
    python benchmarks/run.py --quick     # fewer trials and ranks; about 2 minutes
    python benchmarks/run.py --only failure
    python benchmarks/run.py --with-ray  # and the ray scenario (the ray extra, a local cluster)
    python benchmarks/run.py --only dataplane  # issue 26: the data plane against its peers

Prints a Markdown table and writes benchmarks/results.md and results.png.
Each scenario runs in a fresh interpreter (``--worker``), so a forkserver, a
thread pool or an imported torch never carries over from one scenario to the next.

This file is the ``__main__`` module that every ``spawn`` rank and the
forkserver import again (as ``__mp_main__``): it imports nothing at the top
level beyond ``sys``, so that it costs every peer's ranks nothing.
"""

import sys

#: name -> (module, function, title), in report order.
SCENARIOS = {
    "startup": ("bench_start", "startup", "Start-up"),
    "small_parent": (
        "bench_small_parent",
        "small_parent",
        "Start-up from a small parent (a fresh `python -c` supervisor)",
    ),
    "large_arg": ("bench_start", "large_arg", "Large-argument start (torch issue 133010)"),
    "failure": ("bench_supervise", "failure", "Failure detection latency"),
    "lag": ("bench_supervise", "lag", "Event-loop lag while ranks start and stop"),
    "teardown": ("bench_supervise", "teardown", "Teardown"),
    "idle": ("bench_supervise", "idle", "Supervisor overhead while ranks sleep"),
    "scale": ("bench_start", "scale", "Scale"),
    "supervision": ("bench_supervision", "supervision", "Heartbeats, hang detection, restarts"),
    "cli": ("bench_cli", "cli", "The `aiospawn run` launcher"),
    "warm": ("bench_warm", "warm", "Warm starts: torch ranks forked from a preloaded template"),
    "live": ("bench_live", "live", "Live ranks: channels and collective calls"),
    "unjoined": (
        "bench_unjoined",
        "unjoined",
        "A `join=False` group nobody joins: round trip and reaping",
    ),
    "ray": ("bench_ray", "ray_backend", "Ray backend against local ranks"),
    "dataplane": (
        "bench_dataplane",
        "dataplane",
        "The data plane against the floors and its peers (issue 26)",
    ),
}

#: Compact scenarios without torch, for ``compare.py`` (two checkouts, many rounds); a run
#: leaves them out unless named with ``--only``.
COMPACT = {
    "compact-startup": ("bench_compare", "startup", "Start-up, without torch"),
    "compact-failure": ("bench_compare", "failure", "Failure detection, without torch"),
    "compact-teardown": ("bench_compare", "teardown", "Teardown"),
    "compact-lag": ("bench_compare", "lag", "Event-loop lag, without torch"),
    "compact-live": ("bench_compare", "live", "Channels: round trips and collective calls"),
    "compact-unjoined": (
        "bench_compare",
        "unjoined",
        "A `join=False` group nobody joins: round trip and reaping",
    ),
}

#: Scenarios a run leaves out unless named: ``ray`` needs the ray extra and
#: starts a two-node Ray cluster on this machine (``--with-ray`` or ``--only ray``);
#: ``dataplane`` starts about 90 worker processes and a Ray instance, and takes about
#: 15 minutes (``--only dataplane``).
OPT_IN = ("ray", "dataplane")


def main(argv: list[str]) -> int:
    """Parse the command line; run the scenarios (or, with ``--worker``, one of them)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials and ranks (~2 min)")
    parser.add_argument("--only", choices=[*SCENARIOS, *COMPACT], help="run this scenario alone")
    parser.add_argument(
        "--with-ray",
        action="store_true",
        help="add the ray scenario (needs the ray extra; starts a two-node cluster here)",
    )
    parser.add_argument(
        "--backend", choices=["asyncio", "trio"], default="asyncio", help="aiospawn's event loop"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="path prefix of the report files (default: benchmarks/results)",
    )
    parser.add_argument("--worker", choices=[*SCENARIOS, *COMPACT], help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.quick, args.backend, args.json)
    if args.only:
        names = [args.only]
    else:
        names = [name for name in SCENARIOS if name not in OPT_IN or args.with_ray]
    return _orchestrate(names, args.quick, args.backend, args.out)


def _worker(name: str, quick: bool, backend: str, json_path: str) -> int:
    import importlib
    import json
    import os
    import time

    import anyio
    from harness import ScenarioResult, Skipped, progress

    import aiospawn

    module, function, title = {**SCENARIOS, **COMPACT}[name]
    scenario = getattr(importlib.import_module(module), function)
    result = ScenarioResult(name=name, title=title)
    result.library = os.path.dirname(os.path.abspath(aiospawn.__file__))
    result.load_before = os.getloadavg()
    started = time.monotonic()
    try:
        anyio.run(scenario, result, quick, backend=backend)
    except Skipped as skipped:
        result.skipped = str(skipped)
        progress(f"[{name}] skipped: {skipped}")
    result.seconds = time.monotonic() - started
    result.load_after = os.getloadavg()
    if backend != "asyncio":
        result.note(f"aiospawn ran on the {backend} backend.")
    with open(json_path, "w") as file:
        json.dump(result.to_json(), file)
    return 0


#: What the bench extra installs, as imported (each scenario's peers need them).
_BENCH_EXTRA = ("torch", "matplotlib", "psutil")

#: The dataplane scenario's peers, as distributions: their versions go in the report.
_DATAPLANE_PEERS = ("numpy", "pyzmq", "ray", "vllm", "torchmonarch")

#: What the workers and their ranks import, compiled once before anything is timed.
_WARM_IMPORTS = (
    "import anyio, psutil, aiospawn._api, aiospawn._rank.bootstrap, aiospawn._cli,"
    " torch.multiprocessing, multiprocessing.forkserver, multiprocessing.popen_spawn_posix,"
    " multiprocessing.popen_forkserver, multiprocessing.popen_fork"
)


def _worker_env(here: str) -> dict[str, str]:
    """The workers' environment: with a bytecode cache, as an installed package has.

    Some machines set PYTHONDONTWRITEBYTECODE=1; then every spawn or forkserver
    rank compiles aiospawn's modules (and the benchmark's) from source, about
    3 ms per rank that no installed package pays (the standard library and
    site-packages ship their .pyc files). The workers write their bytecode
    under benchmarks/.cache/pycache instead, never next to the sources.
    """
    import os

    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(here, ".cache", "pycache")
    return env


def _orchestrate(names: list[str], quick: bool, backend: str, out: str | None) -> int:
    import importlib.util
    import json
    import os
    import subprocess
    import tempfile
    import time

    from harness import STEADY_MALLOC, ScenarioResult, progress
    from report import machine, markdown, plot

    here = os.path.dirname(os.path.abspath(__file__))
    prefix = out or os.path.join(here, "results")
    env = _worker_env(here)
    missing = [name for name in _BENCH_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"run.py: {', '.join(missing)} not installed: the benchmarks need the bench"
            " extra (pip install -e '.[bench]', which pins torch==2.13.0)",
            file=sys.stderr,
        )
        return 2
    progress("== warming the bytecode cache (benchmarks/.cache/pycache)")
    subprocess.run([sys.executable, "-c", _WARM_IMPORTS], env=env, check=True)
    mode = "quick" if quick else "full"
    results: list[ScenarioResult] = []
    failures: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="aiospawn-bench-") as scratch:
        for name in names:
            json_path = os.path.join(scratch, f"{name}.json")
            command = [sys.executable, os.path.abspath(__file__), "--worker", name]
            command += ["--json", json_path, "--backend", backend]
            if quick:
                command.append("--quick")
            progress(f"== {name}: {' '.join(command[1:])}")
            # The dataplane's allocator held steady, unless the caller set it.
            scenario_env = {**STEADY_MALLOC, **env} if name == "dataplane" else env
            completed = subprocess.run(command, env=scenario_env, check=False)
            if completed.returncode != 0 or not os.path.exists(json_path):
                failures.append(f"Scenario {name} failed (exit code {completed.returncode}).")
                continue
            with open(json_path) as file:
                results.append(ScenarioResult.from_json(json.load(file)))
    total = time.monotonic() - started
    mode += f", {total:.0f} s in all, aiospawn on {backend}"
    chart = f"{prefix}.png"
    plotted = plot(results, chart)
    text = markdown(
        results,
        machine(ray="ray" in names, extra=_DATAPLANE_PEERS if "dataplane" in names else ()),
        mode=mode,
        failures=failures,
        chart=os.path.basename(chart) if plotted else None,
    )
    with open(f"{prefix}.md", "w") as file:
        file.write(text)
    print(text)
    progress(f"wrote {prefix}.md{f' and {chart}' if plotted else ''} in {total:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
