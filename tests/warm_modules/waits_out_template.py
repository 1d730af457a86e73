"""Holds every process its importer forks until the importer, its template, has died.

A rank forked by a template that preloads this goes on to start only once its
template is gone: its template died before the rank could tie its life to it.
"""

from __future__ import annotations

import contextlib
import os
import select

#: The importer, the template: the parent of every process it forks.
_TEMPLATE = os.getpid()


def _wait_for_template() -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already
        template = os.pidfd_open(_TEMPLATE)
        try:
            select.select([template], [], [])
        finally:
            os.close(template)


os.register_at_fork(after_in_child=_wait_for_template)
