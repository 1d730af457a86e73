"""Records each import: appends this process's pid to the file named by ``$WARM_IMPORT_LOG``."""

from __future__ import annotations

import os

#: The process that imported this module.
IMPORTED_IN = os.getpid()

#: What the importing process's ``$WARM_PROBE`` was at import time.
PROBE_AT_IMPORT = os.environ.get("WARM_PROBE")

with open(os.environ["WARM_IMPORT_LOG"], "a", encoding="utf-8") as log:
    log.write(f"{IMPORTED_IN}\n")
