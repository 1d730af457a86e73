"""Rank 1 exits with 3 in the group's first run; every run prints its rank and restart count."""

import json
import os
import sys

if __name__ == "__main__":
    rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(json.dumps({"rank": rank, "restart": restart, "port": os.environ["MASTER_PORT"]}))
    sys.stdout.flush()
    if rank == "1" and restart == "0":
        sys.exit(3)
