"""Print the rank's torchrun variables and ``AIOSPAWN_TEST_*`` variables as one JSON line."""

import json
import os
import sys

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
]

if __name__ == "__main__":
    shown = {name: os.environ.get(name) for name in NAMES}
    shown.update({k: v for k, v in os.environ.items() if k.startswith("AIOSPAWN_TEST_")})
    print(json.dumps(shown), flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)
