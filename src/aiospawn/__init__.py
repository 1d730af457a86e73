"""aiospawn: an async supervisor for rank groups.

Start N worker processes that each run ``fn(rank, *args)``, watch them from an
asyncio or trio program without blocking its event loop, and shut them down
gracefully (SIGTERM, grace period, SIGKILL) when one fails or the owner is
cancelled. ``aiospawn.sync`` is a blocking drop-in for ``torch.multiprocessing.spawn``.

The package's layers (the docs' architecture page draws them):

- ``aiospawn._core``: backend-agnostic supervision (the group supervisor, its
  restart and hang policies, shutdown escalation, outcomes, errors, events).
  It imports no backend, and of the rank side only its wire format.
- ``aiospawn._local``: the local-process backend (the default).
- ``aiospawn.ray``: the Ray backend, a public package of private modules.
- ``aiospawn._rank``: the code that runs inside a rank; standard library only.
- This module, ``_api``, ``sync`` and ``_cli``: the public surface over them.

Every rank imports this package on its way to ``aiospawn._rank``, so the public
names below load on first use: a rank must not pay for anyio and the
supervisor's modules it never runs (invariant 7 on the architecture page).
The import block below is the one list of public names: ``__all__`` and the
lazy map are read from it, and each name reports ``__module__ == "aiospawn"``.
"""

from __future__ import annotations

import importlib

# For the checker only: a rank, which imports this package, never imports typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._api import GroupOptions as GroupOptions
    from ._api import open_group as open_group
    from ._api import spawn as spawn
    from ._api import start_processes as start_processes
    from ._core._capture import OutputLine as OutputLine
    from ._core._channel import RankChannel as RankChannel
    from ._core._context import AsyncProcessContext as AsyncProcessContext
    from ._core._errors import ProcessException as ProcessException
    from ._core._errors import ProcessExitedException as ProcessExitedException
    from ._core._errors import ProcessHungException as ProcessHungException
    from ._core._errors import ProcessRaisedException as ProcessRaisedException
    from ._core._errors import RemoteTraceback as RemoteTraceback
    from ._core._events import Event as Event
    from ._core._events import EventsLost as EventsLost
    from ._core._events import Exited as Exited
    from ._core._events import GroupStatistics as GroupStatistics
    from ._core._events import Hung as Hung
    from ._core._events import RankEvent as RankEvent
    from ._core._events import RankStatistics as RankStatistics
    from ._core._events import Ready as Ready
    from ._core._events import Restarting as Restarting
    from ._core._events import Started as Started
    from ._core._events import Stopped as Stopped
    from ._core._events import Terminating as Terminating
    from ._core._policy import Backoff as Backoff
    from ._core._policy import RestartPolicy as RestartPolicy
    from ._core._policy import RestartRecord as RestartRecord
    from ._core._shutdown import DEFAULT_GRACE_PERIOD as DEFAULT_GRACE_PERIOD
    from ._rank.api import channel as channel
    from ._rank.api import heartbeat as heartbeat
    from ._rank.api import ready as ready
    from ._rank.api import restart_count as restart_count
    from ._rank.api import serve as serve

__version__: str


def _read_exports() -> dict[str, str]:
    # The block above, read as text: ast, tokenize or pathlib would cost every
    # rank a module import, and the lines have one fixed shape (ruff keeps it).
    homes: dict[str, str] = {}
    with open(__file__, encoding="utf-8") as source:
        lines = source.read().splitlines()
    for line in lines:
        words = line.split()
        if len(words) == 6 and words[0] == "from" and words[2] == "import" and words[4] == "as":
            homes[words[5]] = words[1]
    return homes


_HOMES = _read_exports()
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        value: Any = version("aiospawn")
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
        if getattr(value, "__module__", None) not in (None, __name__):
            value.__module__ = __name__  # users see aiospawn.X, never the private home
    else:
        raise AttributeError(f"module 'aiospawn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
