"""Starts a thread at import time, as some libraries do: not safe to fork afterwards."""

from __future__ import annotations

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, name="started-by-threaded", daemon=True).start()
