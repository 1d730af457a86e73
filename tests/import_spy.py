"""Records each import after its own, and each fork: preloaded in a fork server, what ranks import.

A rank is a fork of the server: what it imported itself is what follows
the last ``FORK`` mark in :data:`imported`.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

FORK = "<fork>"

imported: list[str] = []


class _Spy:
    """A finder first on ``sys.meta_path`` that only writes down what is looked for."""

    def find_spec(
        self, name: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        imported.append(name)
        return None


def imported_in_rank(rank: int) -> list[str]:
    """A rank's ``fn``: what this process imported since it was forked."""
    last_fork = len(imported) - imported[::-1].index(FORK)
    return imported[last_fork:]


sys.meta_path.insert(0, _Spy())
os.register_at_fork(after_in_child=lambda: imported.append(FORK))
