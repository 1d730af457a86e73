"""Starts, at import, a thread that ``threading`` does not know of, as a C library's pool is.

A thread started with ``_thread`` is not in ``threading.enumerate()``: to the
template it is a native thread, as OpenBLAS's pool (started by numpy) is. It
sleeps, holding no lock, so forking beside it is safe.
"""

from __future__ import annotations

import _thread
import time

_thread.start_new_thread(time.sleep, (3600,))
