"""Stops every process its importer forks at once: a forked rank never reads its payload.

A template that preloads this forks ranks that hang in an at-fork hook until
their parent, the template, dies (they die with it, ``PR_SET_PDEATHSIG``):
their payload stays unread on their status socket.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def _stall() -> None:
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    while True:
        signal.pause()


os.register_at_fork(after_in_child=_stall)
