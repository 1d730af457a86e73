"""Ranks for test_sync_interrupts: they report, then wait to be released.

The handshake uses pipes only: a rank killed while it waits on a
``multiprocessing.Event`` can leave the Event's Condition broken for whoever
sets it next, and these ranks are killed at every possible moment.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


def report_then_wait(rank: int, ready: Connection, release: Connection) -> int:
    """Send ``(rank, pid)`` on ``ready``, wait until ``release`` is readable, return the rank."""
    ready.send((rank, os.getpid()))
    release.poll(None)  # readable once the test sends; nothing is consumed
    return rank
