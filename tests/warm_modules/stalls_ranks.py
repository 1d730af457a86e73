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

#: The importer, the template: the parent of every process it forks. Known
#: before the fork, since a parent that died before prctl() is no longer
#: what os.getppid() says in the child.
_TEMPLATE = os.getpid()


def _stall() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _TEMPLATE:  # it died before prctl(): die as if it had come later
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        signal.pause()


os.register_at_fork(after_in_child=_stall)
