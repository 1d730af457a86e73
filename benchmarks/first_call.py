"""The first call's cost, checkouts in alternation: the loop's worst gap and the parent's CPU.

Issue 25's start-up bounds, measured apart from ``run.py`` (which keeps one
interpreter per scenario, so its first call is a warm-up): each trial is a
fresh interpreter that runs ``groups`` groups of ``nprocs`` ranks returning
their rank, one after the other, and reports per group:

* the wall time, from just before the call to the values in hand;
* the loop's worst gap: a task sleeping 1 ms in a loop records how late each
  wake-up is (``--ticker``; it costs CPU of its own, so CPU is measured
  without it), and the most CPU the loop's thread spent between two wake-ups
  (``gap_cpu``: the longest stretch of work on the loop, apart from what the
  kernel's scheduler and other threads holding the GIL add);
* the parent's CPU (user + sys of every thread of the supervising process,
  ``getrusage(RUSAGE_SELF)``), and the loop thread's own (``time.thread_time()``
  read on the loop: what ran on the loop, GIL waits and preemption excluded).

Peers: ``aiospawn`` (``await aiospawn.start_processes(...)``, in ``anyio.run``
or with ``--asyncio-run`` in ``asyncio.run``, whose anyio has not loaded its
backend yet); ``mp`` (plain ``multiprocessing``: a ``Pipe`` per rank, the
``Process`` objects started one after the other on the loop's thread, values
received, joined, as ``bench_small_parent.py`` does); ``mp-thread`` (the same
in a worker thread, the loop free meanwhile); ``idle`` (the ticker alone).
Each ``--checkout LABEL=SRC`` runs the ``aiospawn`` peer with ``SRC`` first on
``PYTHONPATH`` (checked: the trial reports the file it imported). Rounds
alternate the order. Prints the medians and writes every trial as a JSON line
to ``--out``::

    python benchmarks/first_call.py --checkout before=/tmp/old/src \\
        --checkout after=src --method spawn --method forkserver --ticker --rounds 6

``--nice N`` runs the trials at that niceness (negative needs the privilege):
on a shared machine, it gives the trial and its ranks the cores first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from harness import run_trial

#: The trial, run as ``python -c``. argv: peer, method, nprocs, groups, ticker, runner.
TRIAL = """
import json, resource, sys, time
import workloads

peer, method, nprocs, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ticker_on, runner = sys.argv[5] == "1", sys.argv[6]
import anyio, aiospawn, multiprocessing

state = {"max": 0.0, "max_cpu": 0.0}
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mp_group():
    values = workloads.plain_group(method, nprocs)
    assert values == list(range(nprocs)), values


async def ticker(sleep):
    while True:
        began, busy = time.perf_counter(), time.thread_time()
        await sleep(0.001)
        state["max"] = max(state["max"], time.perf_counter() - began - 0.001)
        # The loop thread's own CPU between two wake-ups: the longest stretch
        # of work on the loop, whatever the scheduler and the GIL did.
        state["max_cpu"] = max(state["max_cpu"], time.thread_time() - busy)


async def main():
    # Under asyncio.run the trial itself uses asyncio alone, so that anyio's
    # backend is still to be loaded when the group starts, as in a plain
    # asyncio program.
    if runner == "asyncio":
        import asyncio

        sleep = asyncio.sleep

        def in_thread(fn):
            return asyncio.get_running_loop().run_in_executor(None, fn)
    else:
        sleep, in_thread = anyio.sleep, anyio.to_thread.run_sync
    out = []
    ticking = None
    if ticker_on and runner == "asyncio":
        ticking = asyncio.get_running_loop().create_task(ticker(sleep))

    async def groups():
        await sleep(0.05)
        for _ in range(count):
            state["max"] = state["max_cpu"] = 0.0
            cpu0, loop0, began = cpu(), time.thread_time(), time.perf_counter()
            if peer == "aiospawn":
                values = await aiospawn.start_processes(
                    workloads.return_rank, nprocs=nprocs, start_method=method
                )
                assert values == list(range(nprocs)), values
            elif peer == "mp-thread":
                await in_thread(mp_group)
            elif peer == "mp":
                mp_group()
            else:
                await sleep(0.3)
            wall = time.perf_counter() - began
            out.append({
                "wall": wall * 1e3, "gap": state["max"] * 1e3, "gap_cpu": state["max_cpu"] * 1e3,
                "cpu": (cpu() - cpu0) * 1e3, "loop_cpu": (time.thread_time() - loop0) * 1e3,
            })
    if runner == "asyncio" or not ticker_on:
        await groups()
        if ticking is not None:
            ticking.cancel()
    else:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker, sleep)
            await groups()
            tg.cancel_scope.cancel()
    return out


if runner == "asyncio":
    import asyncio
    groups_out = asyncio.run(main())
else:
    groups_out = anyio.run(main)
print(json.dumps({"groups": groups_out, "file": aiospawn.__file__}))
"""


def trial(args: argparse.Namespace, peer: str, method: str, src: str | None) -> dict[str, object]:
    """One fresh interpreter; its groups' figures."""
    args_ = [peer, method, str(args.nprocs), str(args.groups)]
    args_ += ["1" if args.ticker else "0", "asyncio" if args.asyncio_run else "anyio"]
    prefix = ["nice", "-n", str(args.nice)] if args.nice else []
    result: dict[str, object] = run_trial(TRIAL, *args_, src=src, prefix=prefix)
    return result


def main() -> None:
    """Run the trials in alternation and print the medians per peer and group."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkout", action="append", default=[], metavar="LABEL=SRC")
    parser.add_argument("--method", action="append", default=[])
    parser.add_argument("--peer", action="append", default=[], help="mp, mp-thread, idle")
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ticker", action="store_true")
    parser.add_argument("--asyncio-run", action="store_true")
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    checkouts = [item.split("=", 1) for item in args.checkout]
    peers = [(label, "aiospawn", src) for label, src in checkouts]
    peers += [(peer, peer, None) for peer in args.peer]
    rows: dict[tuple[str, str], list[dict[str, object]]] = {}
    for method in args.method or ["spawn"]:
        for round_ in range(args.rounds):
            order = peers if round_ % 2 == 0 else peers[::-1]
            for label, peer, src in order:
                load = os.getloadavg()[0]
                result = trial(args, peer, method, src)
                result.update(label=label, method=method, load=load)
                rows.setdefault((method, label), []).append(result)
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps(result) + "\n")
    for (method, label), results in rows.items():
        cells = []
        for index in range(args.groups):
            for key in ("wall", "gap", "gap_cpu", "cpu", "loop_cpu"):
                values = [r["groups"][index][key] for r in results]  # type: ignore[index]
                cells.append(f"g{index}.{key}={statistics.median(values):.1f}")
        load = statistics.median(float(r["load"]) for r in results)  # type: ignore[arg-type]
        print(method, label, " ".join(cells), f"load={load:.1f} n={len(results)}")


if __name__ == "__main__":
    main()
