"""Rank 1's first run exits 3; after that every rank prints ``ready PID restart N`` and waits."""

import os
import sys
import time

if __name__ == "__main__":
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    if os.environ["RANK"] == "1" and restart == "0":
        sys.exit(3)
    print(f"ready {os.getpid()} restart {restart}", flush=True)
    while True:
        time.sleep(3600)
