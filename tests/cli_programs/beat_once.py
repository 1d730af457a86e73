"""Send one heartbeat, print ``ready PID``, then never beat again (a hang)."""

import os
import time

import aiospawn

if __name__ == "__main__":
    aiospawn.heartbeat()
    print(f"ready {os.getpid()}", flush=True)
    while True:
        time.sleep(3600)
