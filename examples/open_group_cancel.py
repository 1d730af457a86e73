"""Supervise a group inside an `async with` block and cancel it with a deadline.

The ranks run "forever"; after one second `move_on_after` cancels the block,
and aiospawn stops every rank (SIGTERM, then SIGKILL after the grace period)
before the block is left. Meanwhile the event loop stays free for other work.

Run it with:  python examples/open_group_cancel.py
"""

import signal
import time

import anyio

import aiospawn


def serve(rank: int) -> None:
    def stop(signum: int, frame: object) -> None:
        print(f"rank {rank}: got SIGTERM, shutting down cleanly", flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(0.1)


async def heartbeat() -> None:
    while True:
        await anyio.sleep(0.25)
        print("event loop: still responsive", flush=True)


async def main() -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        with anyio.move_on_after(1.0) as scope:
            async with aiospawn.open_group(serve, nprocs=2, grace_period=5.0) as group:
                print(f"started ranks with pids {group.pids()}", flush=True)
                await anyio.sleep_forever()
        print(f"cancelled: {scope.cancelled_caught}; every rank has been reaped", flush=True)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
