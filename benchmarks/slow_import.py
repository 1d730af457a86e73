"""A module whose import takes 1 s, as a rank's heavy imports do (torch issue 133010).

Under ``spawn`` and ``forkserver`` a rank imports it while it unpickles ``fn``,
before it reads the rest of its arguments; with arguments larger than the
64 KiB pipe buffer, the parent's ``Process.start()`` waits that long.
"""

from __future__ import annotations

import time

from workloads import write_stamp

IMPORT_SECONDS = 1.0

time.sleep(IMPORT_SECONDS)


def record_entry_with_payload(rank: int, outdir: str, payload: bytes) -> float:
    """Record the entry time of rank ``rank`` (``payload`` is only carried) and return it."""
    now = time.monotonic()
    write_stamp(outdir, str(rank), now)
    return now
