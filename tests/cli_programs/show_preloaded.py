"""Print as one JSON line whether ``decimal`` was imported before this script, and the parent."""

import json
import os
import sys

if __name__ == "__main__":
    preloaded = "decimal" in sys.modules
    # One write: print() writes the newline apart, and both ranks share stdout.
    sys.stdout.write(json.dumps({"preloaded": preloaded, "ppid": os.getppid()}) + "\n")
    sys.stdout.flush()
