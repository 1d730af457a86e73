"""Start four ranks, wait for them, and print what each returned.

Run it with:  python examples/quickstart.py
"""

import os

import anyio

import aiospawn


def work(rank: int, base: int) -> str:
    # Runs in its own process; rank is 0..nprocs-1.
    return f"rank {rank} (pid {os.getpid()}) computed {base + rank * rank}"


async def main() -> None:
    results = await aiospawn.spawn(work, args=(100,), nprocs=4)
    for line in results:
        print(line)


if __name__ == "__main__":  # required: spawn re-imports this file in every rank
    anyio.run(main)
