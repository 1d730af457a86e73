"""Find a rank that stopped making progress, and see where it is stuck.

Each rank calls `aiospawn.heartbeat()` as it works. Rank 1 stops beating: it
waits for a peer that never comes. One second later (`heartbeat_timeout=1`)
aiospawn takes every thread's Python stack from the hung rank, stops the
group, and raises `ProcessHungException`, whose message ends with the stacks.

Run it with:  python examples/hang_detection.py
"""

import time

import anyio

import aiospawn


def wait_for_peer_that_never_comes() -> None:
    while True:
        time.sleep(0.1)


def train(rank: int) -> None:
    for step in range(10):
        aiospawn.heartbeat()  # cheap: call it as often as you like
        if rank == 1 and step == 2:
            wait_for_peer_that_never_comes()
        time.sleep(0.1)  # one training step


async def main() -> None:
    try:
        await aiospawn.spawn(train, nprocs=2, heartbeat_timeout=1.0, grace_period=1.0)
    except aiospawn.ProcessHungException as exc:
        print(f"rank {exc.error_index} (pid {exc.error_pid}) hung; where it was stuck:")
        print(exc)


if __name__ == "__main__":  # required: spawn re-imports this file in every rank
    anyio.run(main)
