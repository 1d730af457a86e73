"""aiospawn: an async supervisor for rank groups.

Start N worker processes that each run ``fn(rank, *args)``, watch them from an
asyncio or trio program without blocking its event loop, and shut them down
gracefully (SIGTERM, grace period, SIGKILL) when one fails or the owner is
cancelled. ``aiospawn.sync`` is a blocking drop-in for ``torch.multiprocessing.spawn``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._api import GroupOptions as GroupOptions
    from ._api import open_group as open_group
    from ._api import spawn as spawn
    from ._api import start_processes as start_processes
    from ._child import heartbeat as heartbeat
    from ._child import restart_count as restart_count
    from ._context import AsyncProcessContext as AsyncProcessContext
    from ._errors import ProcessException as ProcessException
    from ._errors import ProcessExitedException as ProcessExitedException
    from ._errors import ProcessHungException as ProcessHungException
    from ._errors import ProcessRaisedException as ProcessRaisedException
    from ._errors import RemoteTraceback as RemoteTraceback
    from ._events import Event as Event
    from ._events import EventsLost as EventsLost
    from ._events import Exited as Exited
    from ._events import GroupStatistics as GroupStatistics
    from ._events import Hung as Hung
    from ._events import RankEvent as RankEvent
    from ._events import RankStatistics as RankStatistics
    from ._events import Restarting as Restarting
    from ._events import Started as Started
    from ._events import Stopped as Stopped
    from ._events import Terminating as Terminating
    from ._output import OutputLine as OutputLine
    from ._policy import Backoff as Backoff
    from ._policy import RestartPolicy as RestartPolicy
    from ._policy import RestartRecord as RestartRecord
    from ._shutdown import DEFAULT_GRACE_PERIOD as DEFAULT_GRACE_PERIOD

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "AsyncProcessContext",
    "Backoff",
    "Event",
    "EventsLost",
    "Exited",
    "GroupOptions",
    "GroupStatistics",
    "Hung",
    "OutputLine",
    "ProcessException",
    "ProcessExitedException",
    "ProcessHungException",
    "ProcessRaisedException",
    "RankEvent",
    "RankStatistics",
    "RemoteTraceback",
    "RestartPolicy",
    "RestartRecord",
    "Restarting",
    "Started",
    "Stopped",
    "Terminating",
    "heartbeat",
    "open_group",
    "restart_count",
    "spawn",
    "start_processes",
]

# Every rank imports this package to reach its bootstrap (aiospawn._child), so
# the public names load on first use: a rank must not pay for anyio and the
# supervisor's modules it never runs (DESIGN.md, invariant 7).
_HOMES = {
    "DEFAULT_GRACE_PERIOD": "._shutdown",
    "AsyncProcessContext": "._context",
    "Backoff": "._policy",
    "Event": "._events",
    "EventsLost": "._events",
    "Exited": "._events",
    "GroupOptions": "._api",
    "GroupStatistics": "._events",
    "Hung": "._events",
    "RankEvent": "._events",
    "RankStatistics": "._events",
    "RestartPolicy": "._policy",
    "RestartRecord": "._policy",
    "Restarting": "._events",
    "Started": "._events",
    "Stopped": "._events",
    "Terminating": "._events",
    "heartbeat": "._child",
    "restart_count": "._child",
    "OutputLine": "._output",
    "ProcessException": "._errors",
    "ProcessExitedException": "._errors",
    "ProcessHungException": "._errors",
    "ProcessRaisedException": "._errors",
    "RemoteTraceback": "._errors",
    "open_group": "._api",
    "spawn": "._api",
    "start_processes": "._api",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'aiospawn' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
