"""Warm starts: ranks forked from a template that imported the heavy modules once.

`preload=[...]` names modules (in real use `torch`, your model package) that a
template process imports once; each rank, and each restart, is forked from it
and finds them imported. Here the standard library's `decimal` and `json`
stand in for torch. Rank 1 fails its first run; its restart is forked from the
same template.

Run it with:  python examples/warm_start.py
"""

import os
import sys

import anyio

import aiospawn

PRELOAD = ["decimal", "json"]


def work(rank: int, failing_rank: int) -> int:
    already = all(name in sys.modules for name in PRELOAD)  # before this rank imports them
    print(f"rank {rank}: run {aiospawn.restart_count()}, preloaded: {already}", flush=True)
    if rank == failing_rank and aiospawn.restart_count() == 0:
        raise RuntimeError("rank 1 fails its first run")
    return os.getppid()  # the template that forked this rank


async def main() -> None:
    parents = await aiospawn.start_processes(
        work,
        (1,),
        nprocs=2,
        preload=PRELOAD,
        restart=aiospawn.RestartPolicy(strategy="one_for_one", backoff=aiospawn.Backoff(0)),
    )
    print(f"every rank and the restart forked from one template: {len(set(parents)) == 1}")
    again = await aiospawn.spawn(work, (-1,), nprocs=2, preload=PRELOAD)
    print(f"a later group reuses it: {set(again) == set(parents)}")


if __name__ == "__main__":
    anyio.run(main)
