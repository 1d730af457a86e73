"""Print as one JSON line the thread counts ``threads_at_import`` saw, and where it was imported."""

import json
import os
import sys

import threads_at_import

if __name__ == "__main__":
    shown = {
        "seen_at_import": threads_at_import.SEEN,
        "imported_here": os.getpid() == threads_at_import.IMPORTED_IN,
    }
    # One write: print() writes the newline apart, and both ranks share stdout.
    sys.stdout.write(json.dumps(shown) + "\n")
    sys.stdout.flush()
