"""Warm starts: ranks whose first line is ``import torch``, forked from a preloaded template.

Cases:

- "8 torch ranks": 8 ranks of :func:`workloads.torch_entry`, from just before
  the call to the last rank's entry stamp (taken after its ``import torch``).
  aiospawn with ``preload=["torch"]`` (its template started in the warm-up, as
  in a service that has started one group before), aiospawn ``spawn``,
  ``torch.multiprocessing.spawn``, and plain ``multiprocessing`` forkserver
  with ``set_forkserver_preload(["torch"])`` (its server started in the warm-up).
- "first warm group": the same with preload, in a process whose template does
  not exist yet: the template's own start (a spawned interpreter importing torch).
- "restart": rank 1 of 2 exits 1 on its first run; from its exit stamp to its
  restarted run's entry stamp (after ``import torch``), with ``one_for_one``
  and no backoff: with preload, and with plain ``spawn``.
- "memory": PSS per rank (``/proc/<pid>/smaps_rollup``) of 8 running torch
  ranks, warm and spawned, and the template's own.
"""

from __future__ import annotations

import multiprocessing
import time
from functools import partial

import workloads
from harness import (
    Measure,
    Peer,
    ScenarioResult,
    Skipped,
    alternate,
    import_torch_mp,
    ms,
    progress,
    read_stamp,
    read_stamps,
    stamp_dir,
    torch_ranks_fit,
    wait_stamps,
)

import aiospawn
from aiospawn._local import _templates

NPROCS = 8
PRELOAD = ["torch"]


async def _aiospawn_torch(preload: list[str] | None) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        await aiospawn.start_processes(
            workloads.torch_entry, (outdir,), nprocs=NPROCS, preload=preload
        )
        stamps = read_stamps(outdir, NPROCS)
    return {"all running [ms]": ms(max(stamps) - started)}


async def _first_warm_group() -> Measure:
    _templates.stop_all()
    return await _aiospawn_torch(PRELOAD)


def _torch_spawn(tmp: object) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        tmp.spawn(workloads.torch_entry, (outdir,), nprocs=NPROCS)  # type: ignore[attr-defined]
        stamps = read_stamps(outdir, NPROCS)
    return {"all running [ms]": ms(max(stamps) - started)}


def _forkserver_preloaded(context: object) -> Measure:
    with stamp_dir() as outdir:
        started = time.monotonic()
        processes = [
            context.Process(target=workloads.torch_entry, args=(rank, outdir))  # type: ignore[attr-defined]
            for rank in range(NPROCS)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        assert all(process.exitcode == 0 for process in processes)
        stamps = read_stamps(outdir, NPROCS)
    return {"all running [ms]": ms(max(stamps) - started)}


async def _restart(preload: list[str] | None) -> Measure:
    policy = aiospawn.RestartPolicy(
        max_restarts=1, strategy="one_for_one", backoff=aiospawn.Backoff(initial=0.0)
    )
    with stamp_dir() as outdir:
        await aiospawn.start_processes(
            workloads.torch_fail_then_restart, (outdir,), nprocs=2, preload=preload, restart=policy
        )
        failed = read_stamp(outdir, workloads.FAIL_STAMP)
        restarted = read_stamp(outdir, "restarted")
    return {"failure to restarted run's first line [ms]": ms(restarted - failed)}


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


async def _memory(preload: list[str] | None) -> Measure:
    with stamp_dir() as outdir:
        ctx = await aiospawn.start_processes(
            workloads.torch_entry_then_sleep, (outdir,), nprocs=NPROCS, join=False, preload=preload
        )
        try:
            await wait_stamps(outdir, NPROCS)
            pss = sorted(_pss_kib(pid) for pid in ctx.pids())
            measure: Measure = {"PSS per rank, median [MiB]": pss[len(pss) // 2] / 1024}
            if preload:
                [template] = _templates.running_templates()
                measure["template PSS [MiB]"] = _pss_kib(template) / 1024
        finally:
            await ctx.terminate()
    return measure


async def warm(result: ScenarioResult, quick: bool) -> None:
    """Warm starts against spawn, torch and a preloaded fork server, with torch 2.13 (CPU)."""
    tmp = import_torch_mp()
    if not torch_ranks_fit(NPROCS):
        raise Skipped(f"{NPROCS} torch ranks do not fit in the available memory")
    import torch

    result.note(
        f"torch {torch.__version__}. Every rank's function starts with `import torch`; the"
        " clock starts just before the call and stops at the last rank's stamp, taken after"
        " that import. aiospawn preload: `start_processes(fn, nprocs=8, preload=['torch'])`,"
        " template started in the warm-up. multiprocessing forkserver:"
        " `set_forkserver_preload(['torch'])`, server started in the warm-up, 8 `Process`"
        " started one after the other. torch: `torch.multiprocessing.spawn`."
    )
    slow = 1 if quick else 2
    fast = 3 if quick else 10
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    await alternate(
        result,
        "8 torch ranks",
        [
            Peer("aiospawn", partial(_aiospawn_torch, PRELOAD), fast, warmup=1),
            Peer(
                "multiprocessing forkserver + preload",
                partial(_forkserver_preloaded, context),
                fast,
                warmup=1,
            ),
            Peer("aiospawn spawn", partial(_aiospawn_torch, None), slow),
            Peer("torch", partial(_torch_spawn, tmp), slow),
        ],
    )
    await alternate(
        result, "first warm group", [Peer("aiospawn", _first_warm_group, 1 if quick else 3)]
    )
    result.note(
        "first warm group: the template is stopped before each trial, so the call includes"
        " spawning it and its `import torch`, once for all 8 ranks."
    )
    await alternate(
        result,
        "restart",
        [
            Peer("aiospawn", partial(_restart, PRELOAD), fast, warmup=1),
            Peer("aiospawn spawn", partial(_restart, None), slow),
        ],
    )
    await alternate(
        result,
        "memory",
        [
            Peer("aiospawn", partial(_memory, PRELOAD), 1 if quick else 2, warmup=1),
            Peer("aiospawn spawn", partial(_memory, None), 1),
        ],
    )
    result.note(
        "memory: PSS counts each shared page once, divided among the processes sharing it;"
        " warm ranks share the template's torch pages, spawned ranks each hold their own."
    )
    _templates.stop_all()
    progress(f"[{result.name}] templates stopped")
