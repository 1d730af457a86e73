"""Run with ``-m tests.cli_programs.mod_main``: print how the module was run, as JSON."""

import json
import os
import sys

if __name__ == "__main__":
    shown = {"name": __name__, "spec": __spec__.name, "argv": sys.argv[1:]}
    shown["rank"] = os.environ["RANK"]
    print(json.dumps(shown))
