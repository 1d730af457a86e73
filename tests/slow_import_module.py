"""A module whose import takes one second, like a rank importing torch.

tests/test_launch.py starts ranks whose ``fn`` lives here: a ``spawn`` or
``forkserver`` rank imports this module while it reads its arguments, so the
parent's ``Process.start()`` waits out that second when the arguments exceed
the pipe buffer.
"""

from __future__ import annotations

import time

IMPORT_SECONDS = 1.0

time.sleep(IMPORT_SECONDS)


def payload_size(rank: int, payload: bytes) -> int:
    return len(payload)
