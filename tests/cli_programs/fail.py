"""``fail.py HOW RANK``: rank RANK fails by HOW (raise, exit3, sigkill); the others sleep.

The others first print ``ready PID``. The failing rank writes a line to
stderr first, which the launcher's summary quotes.
"""

import os
import signal
import sys
import time

if __name__ == "__main__":
    how, failing = sys.argv[1], int(sys.argv[2])
    if int(os.environ["RANK"]) != failing:
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(3600)
    print(f"rank {failing} is about to fail", file=sys.stderr, flush=True)
    if how == "raise":
        raise ValueError("cli: a bad shard")
    if how == "exit3":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
