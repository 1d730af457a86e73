"""The Monarch actor of the ``dataplane`` scenario (imported only where Monarch is installed)."""

from __future__ import annotations

from typing import Any

from dataplane_ranks import handle
from monarch.actor import Actor, endpoint


class MonarchRank(Actor):
    """One actor per Monarch process, serving the scenario's requests."""

    @endpoint
    def handle(self, op: str, payload: Any) -> Any:
        return handle(op, payload)
