"""Supervise a group inside an `async with` block and cancel it with a deadline.

The ranks run "forever". Once both have said they are ready (their SIGTERM
handlers are in place), the block gets a deadline one second away; when it
passes, the block is cancelled and aiospawn stops every rank (SIGTERM, then
SIGKILL after the grace period) before the block is left. Meanwhile the event
loop stays free for other work.

Run it with:  python examples/open_group_cancel.py
"""

import multiprocessing
import signal
import time
from multiprocessing.connection import Connection

import anyio

import aiospawn


def serve(rank: int, ready: Connection) -> None:
    def stop(signum: int, frame: object) -> None:
        print(f"rank {rank}: got SIGTERM, shutting down cleanly", flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    ready.send(rank)
    while True:
        time.sleep(0.1)


async def heartbeat() -> None:
    while True:
        await anyio.sleep(0.25)
        print("event loop: still responsive", flush=True)


async def main() -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        reader, writer = multiprocessing.Pipe(duplex=False)
        with anyio.CancelScope() as scope:
            async with aiospawn.open_group(
                serve, args=(writer,), nprocs=2, grace_period=5.0
            ) as group:
                print(f"started ranks with pids {group.pids()}", flush=True)
                for _ in range(2):
                    await anyio.wait_readable(reader.fileno())  # never blocks the loop
                    reader.recv()
                scope.deadline = anyio.current_time() + 1.0
                await anyio.sleep_forever()
        reader.close()
        writer.close()
        print(f"cancelled: {scope.cancelled_caught}; every rank has been reaped", flush=True)
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
