"""An HTTP inference service whose model is split across a group of shard ranks.

Each of the SHARDS ranks loads its stand-in shard of a linear model (a few
weights), says `aiospawn.ready()` and serves calls. A request is answered
with one collective call, `ctx.call("predict", x)`, which asks every shard
at once; the service adds their partial answers. The group lives in the
app's lifespan: the server accepts requests only once every shard is ready.

Kill a rank and the restart policy starts the group again; until every new
shard is ready (not merely running: a shard loads before it serves) the
service answers 503 with a JSON body saying so. A shard that does not answer
within CALL_TIMEOUT gets the request a 504, never a client held for longer.
Ctrl-C stops uvicorn, then the shards: SIGTERM, and SIGKILL for any still
there GRACE_PERIOD seconds later (a shard stuck in a handler, say); a second
Ctrl-C kills them at once.

Run it with (the `examples` extra: starlette, uvicorn, httpx):

    python examples/http_service.py [port]       # default 8000
    curl 'localhost:8000/predict?x=2'            # {"y":26.0,"shards":4}
    curl localhost:8000/health                   # each shard's pid, state, readiness
    kill -9 <a pid from /health>                 # then /predict again: 503, then 200
"""

import contextlib
import signal
import sys
from collections.abc import AsyncIterator

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import aiospawn

SHARDS = 4
CALL_TIMEOUT = 1.0  # seconds a request may wait for the shards
GRACE_PERIOD = 5.0  # seconds from SIGTERM to SIGKILL when the service stops


class Shard:
    """One rank's part of the model: y = sum over shards of weight * x + bias."""

    def __init__(self, rank: int) -> None:
        self.weight = float(rank + 1)  # loading a real shard would take a while
        self.bias = float(rank)

    def predict(self, x: float) -> float:
        return self.weight * x + self.bias


async def shard(rank: int) -> None:
    model = Shard(rank)
    aiospawn.ready()
    await aiospawn.serve(model)  # until the service stops the group


def unavailable(group: aiospawn.AsyncProcessContext[None]) -> JSONResponse:
    ready = {rank.rank: rank.ready for rank in group.statistics().ranks}
    return JSONResponse(
        {"error": "the model's shards are restarting, retry shortly", "ready": ready},
        status_code=503,
        headers={"Retry-After": "1"},
    )


async def predict(request: Request) -> JSONResponse:
    group: aiospawn.AsyncProcessContext[None] = request.state.group
    try:
        x = float(request.query_params["x"])
    except (KeyError, ValueError):
        return JSONResponse({"error": "give a number: /predict?x=1.5"}, status_code=400)
    # Readiness, not the state: a restarted shard is "running" a while before it
    # serves, and a call made then would wait for it.
    if not all(rank.ready for rank in group.statistics().ranks):
        return unavailable(group)
    try:
        parts = await group.call("predict", x, timeout=CALL_TIMEOUT)
    except (aiospawn.ProcessException, anyio.BrokenResourceError, anyio.ClosedResourceError):
        return unavailable(group)  # a shard died, or the group stopped, during the call
    except TimeoutError as exc:  # a shard is alive but silent: say so, do not hold the client
        return JSONResponse({"error": str(exc)}, status_code=504)
    return JSONResponse({"y": sum(parts), "shards": len(parts)})


async def health(request: Request) -> JSONResponse:
    group: aiospawn.AsyncProcessContext[None] = request.state.group
    stats = group.statistics()
    ranks = [
        {"rank": r.rank, "pid": r.pid, "state": r.state, "ready": r.ready, "restarts": r.restarts}
        for r in stats.ranks
    ]
    healthy = all(r.ready for r in stats.ranks)
    return JSONResponse(
        {"healthy": healthy, "restarts": stats.restarts, "ranks": ranks},
        status_code=200 if healthy else 503,
    )


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[dict[str, object]]:
    # Restart the whole group (shards of one model go together), at most 10 times a minute.
    policy = aiospawn.RestartPolicy(max_restarts=10, window=60)
    async with aiospawn.open_group(
        shard, nprocs=SHARDS, restart=policy, grace_period=GRACE_PERIOD, wait_ready=True
    ) as group:
        print(f"shards ready: pids {group.pids()}", flush=True)
        yield {"group": group}  # the server runs here

        # Stop the shards rather than leave the block, which would wait for
        # every shard to return: one stuck in a handler would hold us for ever.
        # uvicorn no longer listens to Ctrl-C once this shutdown has begun.
        with anyio.open_signal_receiver(signal.SIGINT) as ctrl_c:

            async def kill_on_ctrl_c() -> None:
                async for _ in ctrl_c:
                    await group.terminate(grace_period=0)  # hurries the one under way

            print(f"stopping the shards (within {GRACE_PERIOD} s; Ctrl-C: now)", flush=True)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(kill_on_ctrl_c)
                await group.terminate()  # SIGTERM, then SIGKILL after the grace period
                tasks.cancel_scope.cancel()
    print("shards stopped", flush=True)


app = Starlette(
    routes=[Route("/predict", predict), Route("/health", health)],
    lifespan=lifespan,
)

if __name__ == "__main__":  # required: spawn re-imports this file in every rank
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    uvicorn.run(app, host="127.0.0.1", port=port)
