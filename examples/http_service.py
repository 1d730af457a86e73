"""An HTTP inference service whose model is split across a group of shard ranks.

Each of the SHARDS ranks loads its stand-in shard of a linear model (a few
weights), says `aiospawn.ready()` and serves calls. A request is answered
with one collective call, `ctx.call("predict", x)`, which asks every shard
at once; the service adds their partial answers. The group lives in the
app's lifespan: the server accepts requests only once every shard is ready,
and on shutdown the `async with` ends, the shards' `serve()` returns and
every rank is reaped.

Kill a rank and the restart policy starts the group again; meanwhile the
service answers 503 with a JSON body saying so, and serves again as soon as
the new shards are ready. Ctrl-C stops uvicorn, then the group.

Run it with (the `examples` extra: starlette, uvicorn, httpx):

    python examples/http_service.py [port]       # default 8000
    curl 'localhost:8000/predict?x=2'            # {"y":26.0,"shards":4}
    curl localhost:8000/health                   # the ranks' pids, states, readiness
    kill -9 <a pid from /health>                 # then /predict again: 503, then 200
"""

import contextlib
import sys
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import aiospawn

SHARDS = 4


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
    await aiospawn.serve(model)  # until the service closes the group


def restarting(group: aiospawn.AsyncProcessContext[None]) -> JSONResponse:
    states = {rank.rank: rank.state for rank in group.statistics().ranks}
    return JSONResponse(
        {"error": "the model's shard group is restarting, retry shortly", "ranks": states},
        status_code=503,
        headers={"Retry-After": "1"},
    )


async def predict(request: Request) -> JSONResponse:
    group: aiospawn.AsyncProcessContext[None] = request.state.group
    try:
        x = float(request.query_params["x"])
    except (KeyError, ValueError):
        return JSONResponse({"error": "give a number: /predict?x=1.5"}, status_code=400)
    if any(rank.state != "running" for rank in group.statistics().ranks):
        return restarting(group)
    try:
        parts = await group.call("predict", x, timeout=5)
    except aiospawn.ProcessException:  # a shard died during the call
        return restarting(group)
    except TimeoutError as exc:  # a shard is alive but silent: say so, do not hang the client
        return JSONResponse({"error": str(exc)}, status_code=504)
    return JSONResponse({"y": sum(parts), "shards": len(parts)})


async def health(request: Request) -> JSONResponse:
    group: aiospawn.AsyncProcessContext[None] = request.state.group
    stats = group.statistics()
    ranks = [
        {"rank": r.rank, "pid": r.pid, "state": r.state, "ready": r.ready, "restarts": r.restarts}
        for r in stats.ranks
    ]
    healthy = all(r.state == "running" for r in stats.ranks)
    return JSONResponse(
        {"healthy": healthy, "restarts": stats.restarts, "ranks": ranks},
        status_code=200 if healthy else 503,
    )


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[dict[str, object]]:
    # Restart the whole group (shards of one model go together), at most 10 times a minute.
    policy = aiospawn.RestartPolicy(max_restarts=10, window=60)
    async with aiospawn.open_group(
        shard, nprocs=SHARDS, restart=policy, grace_period=2.0, wait_ready=True
    ) as group:
        print(f"shards ready: pids {group.pids()}", flush=True)
        yield {"group": group}  # the server runs here
    print("shards stopped", flush=True)


app = Starlette(
    routes=[Route("/predict", predict), Route("/health", health)],
    lifespan=lifespan,
)

if __name__ == "__main__":  # required: spawn re-imports this file in every rank
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    uvicorn.run(app, host="127.0.0.1", port=port)
