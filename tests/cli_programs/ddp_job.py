"""A two-rank DDP job on CPU (gloo) for ``aiospawn run -n 2``: prints its rank's weights' checksum.

The process group is left for the process's end to tear down, as many
training scripts leave it (see ``tests/ddp_ranks.py``, the same job as a
rank function).
"""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_ranks import step  # the tests directory, put on the path above

if __name__ == "__main__":
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    print(f"checksum {step(int(os.environ['RANK']))}", flush=True)
