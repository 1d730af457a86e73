"""Print ``ready PID``, then sleep until stopped.

With the argument ``ignore-term`` the rank ignores SIGTERM, printing
``SIGTERM ignored PID`` each time, so that only SIGKILL stops it.
"""

import os
import signal
import time


def ignore(signum: int, frame: object) -> None:
    print(f"SIGTERM ignored {os.getpid()}", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["ignore-term"]:
        signal.signal(signal.SIGTERM, ignore)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        time.sleep(3600)
