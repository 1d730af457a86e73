"""Starts two long-lived processes at import: one with ``subprocess.Popen``, one with ``os.fork``.

Their pids are appended to the file named by ``$WARM_CHILDREN_LOG``, one a line.
Both inherit the importing process's standard streams, as such helpers do.
"""

from __future__ import annotations

import os
import signal
import subprocess

_popen = subprocess.Popen(["sleep", "600"])

_forked = os.fork()
if _forked == 0:
    try:
        while True:
            signal.pause()
    finally:
        os._exit(0)

with open(os.environ["WARM_CHILDREN_LOG"], "a", encoding="utf-8") as log:
    log.write(f"{_popen.pid}\n{_forked}\n")
