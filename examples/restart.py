"""Restart a crashed rank group and resume it from its last checkpoint.

Rank 1 raises in its first run. The restart policy (one_for_all) stops rank 0,
starts both ranks again, and each resumes from the step it saved last.
`aiospawn.restart_count()` tells a rank which run it is in; `group.events()`
shows what the supervisor did.

Run it with:  python examples/restart.py
"""

import os
import tempfile
import time

import anyio

import aiospawn

STEPS = 6


def train(rank: int, directory: str) -> int:
    checkpoint = os.path.join(directory, f"rank{rank}.step")
    start = 0
    if os.path.exists(checkpoint):
        with open(checkpoint) as file:
            start = int(file.read())
    print(f"rank {rank}: run {aiospawn.restart_count()}, resuming at step {start}", flush=True)
    for step in range(start, STEPS):
        if rank == 1 and step == 3 and aiospawn.restart_count() == 0:
            raise RuntimeError(f"rank {rank}: lost its GPU at step {step}")
        time.sleep(0.05)  # one training step
        # Save atomically: a rank may be stopped at any moment.
        with open(checkpoint + ".tmp", "w") as file:
            file.write(str(step + 1))
        os.replace(checkpoint + ".tmp", checkpoint)
    return STEPS


async def main() -> None:
    policy = aiospawn.RestartPolicy(max_restarts=2, backoff=aiospawn.Backoff(initial=0.1))
    with tempfile.TemporaryDirectory() as directory:
        async with aiospawn.open_group(
            train, args=(directory,), nprocs=2, restart=policy, grace_period=1.0
        ) as group:
            async for event in group.events():
                if isinstance(event, aiospawn.RankEvent):
                    outcome = f": {event.outcome}" if isinstance(event, aiospawn.Exited) else ""
                    print(f"event: {type(event).__name__} rank {event.rank}{outcome}", flush=True)
    print(f"results: {group.results}; restarts: {group.statistics().restarts}")


if __name__ == "__main__":  # required: spawn re-imports this file in every rank
    anyio.run(main)
