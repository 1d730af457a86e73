"""Stops every process its importer forks, for good: a forked rank outlives its template.

A template that preloads this forks ranks that hang in an at-fork hook, before
they drop the template's ends of their siblings' status sockets, and that do
not die with the template (no ``PR_SET_PDEATHSIG`` yet): only a signal ends them.
"""

from __future__ import annotations

import os
import signal


def _stall() -> None:
    while True:
        signal.pause()


os.register_at_fork(after_in_child=_stall)
