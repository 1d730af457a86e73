"""Where a call's worst loop gap goes: what each of the supervisor's threads ran during it.

Issue 25 asks where the loop's gap goes while ranks start: our threads holding
the GIL, or the CPU scheduler. Each trial is a fresh interpreter (as in
``first_call.py``) that runs ``groups`` groups of 8 ranks returning their
rank, with a task on the loop sleeping 1 ms in a loop. At each of its
wake-ups the task reads the CPU clock of every thread of the process
(``time.pthread_getcpuclockid``). For each group's worst gap it reports:

* the gap (how late the 1 ms sleep woke up), and when it began, counted from
  the call;
* the CPU the loop's thread spent in it (its own work);
* the CPU each other thread spent in it, by name (``asyncio_0`` imports the
  supervisor's modules on a first call; ``aiospawn-start_N`` start ranks);
* the rest: time in which no thread of ours ran although the loop wanted to,
  so the CPU went to other processes (the ranks, the fork server and the
  resource tracker starting up), or a thread of ours held the GIL while
  the kernel had it off the CPU.

Run::

    python benchmarks/first_call_gap.py --method forkserver --trials 8

The reading of one run is in ``results.md`` ("Where the first call's worst gap goes").
"""

from __future__ import annotations

import argparse
import os
import statistics

from harness import run_trial

#: The trial, run as ``python -c``. argv: method, groups.
TRIAL = """
import json, sys, threading, time
import anyio, aiospawn
import workloads

method, count = sys.argv[1], int(sys.argv[2])
wakes = []  # (late, began, woke, {thread name: CPU seconds at the wake-up})


def clocks():
    seen = {}
    for thread in threading.enumerate():
        try:
            seen[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, TypeError, ValueError):  # ended meanwhile
            pass
    return seen


async def ticker():
    while True:
        began = time.perf_counter()
        await anyio.sleep(0.001)
        woke = time.perf_counter()
        wakes.append((woke - began - 0.001, began, woke, clocks()))


async def main():
    out = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.05)
        for _ in range(count):
            first = len(wakes)
            called = time.perf_counter()
            values = await aiospawn.start_processes(
                workloads.return_rank, nprocs=8, start_method=method
            )
            assert values == list(range(8)), values
            ended = time.perf_counter()
            await anyio.sleep(0.003)  # the wake-up that ends a gap still running
            during = [i for i in range(max(first, 1), len(wakes)) if wakes[i][1] < ended]
            worst = max(during, key=lambda i: wakes[i][0])
            late, began, woke, after = wakes[worst]
            before = wakes[worst - 1][3]
            spent = {name: (cpu - before.get(name, 0.0)) * 1e3 for name, cpu in after.items()}
            spent = {name: ms for name, ms in spent.items() if ms >= 0.05}
            out.append({
                "wall": (ended - called) * 1e3, "gap": late * 1e3, "at": (began - called) * 1e3,
                "span": (woke - began) * 1e3, "threads": spent,
            })
        tg.cancel_scope.cancel()
    return out


print(json.dumps(anyio.run(main)))
"""


def trial(method: str, groups: int) -> list[dict[str, object]]:
    """One fresh interpreter; each group's worst gap and the threads' CPU in it."""
    result: list[dict[str, object]] = run_trial(TRIAL, method, str(groups))
    return result


def main() -> None:
    """Run the trials; print each group's worst gap, split by thread, and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--method", default="forkserver")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    print(f"start method {args.method}; load {os.getloadavg()[0]:.2f}")
    rows: dict[int, list[dict[str, object]]] = {}
    for _ in range(args.trials):
        for index, group in enumerate(trial(args.method, args.groups)):
            rows.setdefault(index, []).append(group)
            threads = group["threads"]
            assert isinstance(threads, dict)
            loop = threads.get("MainThread", 0.0)
            others = {name: ms for name, ms in threads.items() if name != "MainThread"}
            span = float(group["span"])  # type: ignore[arg-type]
            rest = span - loop - sum(others.values())
            named = ", ".join(f"{name} {ms:.1f}" for name, ms in others.items()) or "none"
            print(
                f"group {index}: gap {group['gap']:.1f} ms at {group['at']:.0f} ms;"
                f" loop {loop:.1f}, others: {named}; no thread of ours"
                f" {max(rest, 0.0):.1f} (of {span:.1f} ms)"
            )
    for index, groups in rows.items():
        gaps = [float(group["gap"]) for group in groups]  # type: ignore[arg-type]
        print(f"group {index}: median worst gap {statistics.median(gaps):.1f} ms, n={len(gaps)}")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
