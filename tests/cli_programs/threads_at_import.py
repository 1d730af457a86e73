"""A preload module that reads thread counts at import, as native math libraries do."""

from __future__ import annotations

import os

#: What this process's environment said when the module was imported.
SEEN = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
IMPORTED_IN = os.getpid()
