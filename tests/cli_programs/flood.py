"""Print ``ready PID``, then lines without end."""

import os

if __name__ == "__main__":
    print(f"ready {os.getpid()}", flush=True)
    line = 0
    while True:
        print(f"line {line}")
        line += 1
