"""``show_vars.py NAME...``: print the variables NAME... as one JSON line; a line to stderr."""

import json
import os
import sys

if __name__ == "__main__":
    print(json.dumps({name: os.environ.get(name) for name in sys.argv[1:]}), flush=True)
    print(f"stderr of rank {os.environ['RANK']}", file=sys.stderr, flush=True)
