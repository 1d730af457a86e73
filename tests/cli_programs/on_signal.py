"""``on_signal.py SIGNAL``: print ``ready PID``; on SIGNAL print ``got SIGNAL PID`` and exit 0.

As a training script does with SLURM's SIGUSR1: save a checkpoint, then end.
"""

import os
import signal
import sys
import time


def on_signal(signum: int, frame: object) -> None:
    print(f"got {signal.Signals(signum).name} {os.getpid()}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    signal.signal(getattr(signal, sys.argv[1]), on_signal)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        time.sleep(3600)
