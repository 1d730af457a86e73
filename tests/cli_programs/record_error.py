"""Rank 1 writes an error file as torch's ``@record`` does, then exits 5; rank 0 waits.

The file is torch's shape (``ErrorHandler.record_exception``), written to the
rank's ``TORCHELASTIC_ERROR_FILE``; torch itself is not needed.
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    if os.environ["RANK"] != "1":
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(3600)
    record = {
        "message": {
            "message": "RuntimeError: recorded by rank 1",
            "extraInfo": {"py_callstack": "Traceback: recorded", "timestamp": "1700000000"},
        }
    }
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as file:
        json.dump(record, file)
    sys.exit(5)
