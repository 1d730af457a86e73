"""Where a ``forkserver`` group's time goes: each process's CPU, against plain mp.

Issue 25 bounds a later ``forkserver`` group of 8 trivial ranks at 1.3x plain
``multiprocessing`` in the same kind of parent. On a machine with few cores
such a group is bound by the CPU of everything that runs for it, so this
counts that CPU per later group, process by process:

* the supervisor (``getrusage(RUSAGE_SELF)``: user and system apart, and
  its context switches);
* the fork server, which forks every rank (its own CPU from
  ``/proc/PID/stat``);
* the ranks, which are the fork server's children, not ours (the server's
  ``cutime + cstime`` and ``cminflt``: the CPU and the page faults of the
  ranks it has reaped);
* ``multiprocessing``'s resource tracker, which the fork server's start
  starts too (its own CPU).

Each trial is a fresh interpreter (an ``anyio.run`` program that imported
anyio and aiospawn, as in ``first_call.py``) that runs ``--warm`` groups
untimed, then ``--groups`` timed ones, and reports their means. The peers
alternate trial by trial: ``aiospawn`` (``start_processes`` of
``workloads.return_rank``) and ``mp`` (``workloads.plain_group``: a ``Pipe``
per rank, started one by one on the loop's thread; it starts its own fork
server, without aiospawn's preload). The clock of ``/proc`` counts in ticks
(10 ms), so the timed groups must add up to many ticks (40 groups: about
1.5 s)::

    python benchmarks/group_cpu.py --rounds 6

``--first`` times the first group of each fresh interpreter instead (no
untimed group before it): the supervisor's CPU then holds its first call's
imports, and the fork server's and the resource tracker's their start-up.
One group is a few ticks, so the table gives the means over the trials there,
not the medians::

    python benchmarks/group_cpu.py --first --rounds 16
"""

from __future__ import annotations

import argparse
import os
import statistics

from harness import run_trial

#: The trial, run as ``python -c``. argv: peer, nprocs, warm groups, timed groups.
TRIAL = """
import json, os, resource, sys, time
import workloads

peer, nprocs, warm, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
import anyio, aiospawn

TICK = os.sysconf("SC_CLK_TCK")

def stat(pid):
    # A process's own CPU, its reaped children's and their page faults (zeros before it ran).
    if pid is None:  # not started yet: before a first group
        return {"cpu": 0.0, "children": 0.0, "child_faults": 0}
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    # After the command's name: cminflt 8, utime 11, stime 12, cutime 13, cstime 14.
    return {
        "cpu": (int(fields[11]) + int(fields[12])) / TICK,
        "children": (int(fields[13]) + int(fields[14])) / TICK,
        "child_faults": int(fields[8]),
    }

def pid_of(module, holder, attribute):
    # Read where the peer left it: importing the module here would import, before a
    # first group, what that group's own start imports (multiprocessing.forkserver).
    module = sys.modules.get(f"multiprocessing.{module}")
    return getattr(getattr(module, holder, None), attribute, None)

def server():
    forks = stat(pid_of("forkserver", "_forkserver", "_forkserver_pid"))
    tracker = stat(pid_of("resource_tracker", "_resource_tracker", "_pid"))
    return {
        "server": forks["cpu"],
        "ranks": forks["children"],
        "rank_faults": forks["child_faults"],
        "tracker": tracker["cpu"],
    }

def me():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "user": usage.ru_utime, "sys": usage.ru_stime,
        "switches": usage.ru_nvcsw + usage.ru_nivcsw,
    }

async def group():
    if peer == "aiospawn":
        values = await aiospawn.start_processes(
            workloads.return_rank, nprocs=nprocs, start_method="forkserver"
        )
    else:
        values = workloads.plain_group("forkserver", nprocs)
    assert values == list(range(nprocs)), values

async def main():
    for _ in range(warm):
        await group()
    before, server_before, began = me(), server(), time.perf_counter()
    for _ in range(count):
        await group()
    wall = time.perf_counter() - began
    after, server_after = me(), server()
    out = {"wall": wall / count * 1e3}
    for start, end in ((before, after), (server_before, server_after)):
        for key in start:
            scale = 1 if key in ("switches", "rank_faults") else 1e3
            out[key] = (end[key] - start[key]) / count * scale
    out["cpu"] = sum(out[key] for key in ("user", "sys", "server", "ranks", "tracker"))
    return out

print(json.dumps(anyio.run(main)))
"""

#: Columns of the table: key, heading, per rank (divided by nprocs).
COLUMNS = [
    ("wall", "wall [ms]", False),
    ("user", "supervisor user [ms]", False),
    ("sys", "supervisor sys [ms]", False),
    ("switches", "supervisor context switches", False),
    ("server", "fork server [ms]", False),
    ("ranks", "ranks, per rank [ms]", True),
    ("rank_faults", "page faults, per rank", True),
    ("tracker", "resource tracker [ms]", False),
    ("cpu", "every process's CPU [ms]", False),
]


def trial(args: argparse.Namespace, peer: str) -> dict[str, float]:
    """One fresh interpreter; the means of its timed groups."""
    result: dict[str, float] = run_trial(
        TRIAL, peer, str(args.nprocs), str(args.warm), str(args.groups)
    )
    return result


def main() -> None:
    """Run the peers' trials in alternation; print a Markdown table of their figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--groups", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--first",
        action="store_true",
        help="time each trial's first group (that is, --warm 0 --groups 1)",
    )
    args = parser.parse_args()
    if args.first:
        if (args.warm, args.groups) != (parser.get_default("warm"), parser.get_default("groups")):
            parser.error("--first times one group, the first: it takes no --warm or --groups")
        args.warm, args.groups = 0, 1
    peers = ["aiospawn", "mp"]
    rows: dict[str, list[dict[str, float]]] = {peer: [] for peer in peers}
    loads = []
    for round_ in range(args.rounds):
        for peer in peers if round_ % 2 == 0 else peers[::-1]:
            loads.append(os.getloadavg()[0])
            rows[peer].append(trial(args, peer))
    # One group is a few ticks of /proc's clock: its readings are averaged, not ranked.
    summary = statistics.mean if args.first else statistics.median
    figures = {
        peer: {
            key: summary(r[key] for r in results) / (args.nprocs if per_rank else 1)
            for key, _, per_rank in COLUMNS
        }
        for peer, results in rows.items()
    }
    print("| | " + " | ".join(heading for _, heading, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for peer in peers:
        cells = [f"{figures[peer][key]:.1f}" for key, _, _ in COLUMNS]
        print(f"| {peer} | " + " | ".join(cells) + " |")
    ratio = [
        f"{figures['aiospawn'][key] / figures['mp'][key]:.2f}x" if figures["mp"][key] else "-"
        for key, _, _ in COLUMNS
    ]
    print("| aiospawn / mp | " + " | ".join(ratio) + " |")
    what = "means" if args.first else "medians"
    print(
        f"\n{what} of {args.rounds} trials per peer, {args.groups} timed"
        f" group{'s' if args.groups != 1 else ''} of {args.nprocs} ranks each after"
        f" {args.warm} untimed; load average (1 min)"
        f" {min(loads):.1f}-{max(loads):.1f}"
    )


if __name__ == "__main__":
    main()
