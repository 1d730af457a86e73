"""A call with a large in-band argument to several ranks: its time, the loop's gap, its memory.

A ``bytes`` argument cannot go through shared memory (pickle copies it into
the request), nor can any large buffer to a backend without shared memory, so
such a request is as large as its argument and goes to every rank asked. Each
trial is a fresh interpreter that starts ``nprocs`` ``forkserver`` ranks
serving a handler that answers with the argument's length, makes one warm-up
call, then one call with ``--mib`` MiB of ``bytes`` to every rank, and
reports:

* the call's wall time;
* the loop's worst gap meanwhile (a task sleeping 1 ms in a loop records how
  late each wake-up is);
* the supervisor's peak of Python-allocated memory during the call, above
  what it held before (``tracemalloc``; the argument itself was allocated
  before, so it is not counted).

Each ``--checkout LABEL=SRC`` runs with ``SRC`` first on ``PYTHONPATH``
(checked: the trial reports the file it imported); rounds alternate the
order. Prints the medians per checkout::

    python benchmarks/bench_large_call.py --checkout before=/tmp/old/src \\
        --checkout after=src --nprocs 4 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics

from harness import run_trial

#: The trial, run as ``python -c``. argv: nprocs, MiB.
TRIAL = """
import json, sys, time, tracemalloc
import anyio, aiospawn
import workloads

nprocs, size = int(sys.argv[1]), int(sys.argv[2]) << 20


async def main():
    payload = b"x" * size
    gap = 0.0
    async with aiospawn.open_group(
        workloads.serve_lengths, nprocs=nprocs, start_method="forkserver", wait_ready=True
    ) as ctx:
        assert await ctx.call("length", b"warm") == [4] * nprocs
        done = anyio.Event()

        async def ticker():
            nonlocal gap
            while not done.is_set():
                began = time.perf_counter()
                await anyio.sleep(0.001)
                gap = max(gap, time.perf_counter() - began - 0.001)

        tracemalloc.start()
        held = tracemalloc.get_traced_memory()[0]
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            began = time.perf_counter()
            lengths = await ctx.call("length", payload)
            took = time.perf_counter() - began
            done.set()
        peak = tracemalloc.get_traced_memory()[1] - held
        tracemalloc.stop()
        assert lengths == [size] * nprocs, lengths
        await ctx.terminate()
    return {"call": took * 1e3, "gap": gap * 1e3, "memory": peak / (1 << 20)}


result = anyio.run(main)
result["file"] = aiospawn.__file__
print(json.dumps(result))
"""


def trial(src: str, nprocs: int, mib: int) -> dict[str, float | str]:
    """One fresh interpreter with ``src`` first on its path; its figures."""
    result: dict[str, float | str] = run_trial(TRIAL, str(nprocs), str(mib), src=src)
    return result


def main() -> None:
    """Run the trials in alternation and print the medians per checkout."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="LABEL=SRC")
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    checkouts = [item.split("=", 1) for item in args.checkout or ["now=src"]]
    rows: dict[str, list[dict[str, float | str]]] = {label: [] for label, _ in checkouts}
    loads = []
    for round_ in range(args.rounds):
        for label, src in checkouts if round_ % 2 == 0 else checkouts[::-1]:
            loads.append(os.getloadavg()[0])
            rows[label].append(trial(src, args.nprocs, args.mib))
    print(f"{args.mib} MiB of bytes to {args.nprocs} ranks, {args.rounds} trials each, medians")
    for label, results in rows.items():
        cells = [
            f"{key} {statistics.median(float(r[key]) for r in results):.1f} {unit}"
            for key, unit in (("call", "ms"), ("gap", "ms"), ("memory", "MiB"))
        ]
        print(f"{label}: " + ", ".join(cells))
    print(f"load average (1 min) before the trials: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    main()
