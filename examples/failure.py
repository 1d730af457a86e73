"""One rank fails: the others are stopped, and the rank's real error is raised.

Run it with:  python examples/failure.py
"""

import time

import anyio

import aiospawn


def train(rank: int, steps: int) -> int:
    for step in range(steps):
        if rank == 1 and step == 3:
            raise ValueError(f"rank {rank}: loss became NaN at step {step}")
        time.sleep(0.05)
    return steps


async def main() -> None:
    try:
        await aiospawn.start_processes(train, args=(100,), nprocs=3, grace_period=1.0)
    except aiospawn.ProcessRaisedException as exc:
        print(f"rank {exc.error_index} (pid {exc.error_pid}) failed; its traceback:")
        print(str(exc).strip())
        print(f"the original exception is chained: {exc.__cause__!r}")


if __name__ == "__main__":
    anyio.run(main)
