"""``nodes_job.py [--fail-rank R] [--fail-once] [--hang[-once]]``: a gloo job over a test's "nodes".

Each rank joins the process group by ``env://`` (as a torchrun script does),
all-reduces its rank, and prints one JSON line: the sum and the torchrun
variables it was given. ``--fail-rank R`` makes global rank R exit with
status 3 after the first all-reduce (``--fail-once``: only in the first round,
``TORCHELASTIC_RESTART_COUNT=0``); the other ranks then print ``waiting PID``
and sit in a second all-reduce that rank R never joins, as a job's ranks do
when a peer dies. ``--hang``: every rank prints ``waiting PID`` and sits in
that all-reduce after the first (``--hang-once``: only in the first round).
``--on-usr1``: a rank prints ``got SIGUSR1 RANK`` when it receives SIGUSR1
(as a job checkpoints on SLURM's preemption warning) and goes on waiting.
``--wait sleep``: the waiting is a sleep
instead, which no peer's death ends (as an NCCL collective's often does not):
only the launcher can stop such a rank.
"""

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

NAMES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-once", action="store_true")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--hang-once", action="store_true")
    parser.add_argument("--wait", choices=("collective", "sleep"), default="collective")
    parser.add_argument("--on-usr1", action="store_true")
    options = parser.parse_args()
    if options.on_usr1:
        signal.signal(
            signal.SIGUSR1,
            lambda *_: os.write(1, f"got SIGUSR1 {os.environ['RANK']}\n".encode()),
        )
    # Long enough that a collective's own timeout never ends a test's wait.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    env = {name: os.environ.get(name) for name in NAMES}
    # One write each, so that lines of ranks sharing a pipe (torchrun's) never mix.
    os.write(1, (json.dumps({"sum": int(value.item()), "env": env}) + "\n").encode())
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    failing = options.fail_rank == rank and (first_round or not options.fail_once)
    if failing:
        # When it fails, for the benchmark's clock (one machine: one clock).
        os.write(1, f"failing {os.getpid()} {time.time()!r}\n".encode())
        sys.exit(3)
    hang = options.hang or (options.hang_once and first_round)
    if hang or (options.fail_rank is not None and (first_round or not options.fail_once)):
        os.write(1, f"waiting {os.getpid()}\n".encode())
        if options.wait == "sleep":
            threading.Event().wait()
        dist.all_reduce(value)
    dist.destroy_process_group()
