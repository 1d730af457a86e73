"""Print as one JSON line torch's intra-op thread count and OMP_NUM_THREADS."""

import json
import os
import sys

import torch

if __name__ == "__main__":
    shown = {"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}
    # One write: print() writes the newline apart, and both ranks share stdout.
    sys.stdout.write(json.dumps(shown) + "\n")
    sys.stdout.flush()
