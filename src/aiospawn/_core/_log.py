"""The package's logger, ``logging.getLogger("aiospawn")``, for operational events.

Escalation to SIGKILL, a rank ignoring SIGTERM, a failure absorbed by a
restart: things an operator wants in the logs. The library never prints.

A caller that stands in for another library can have its groups' events
logged where that library logs its own (:func:`log_as`): ``aiospawn.sync``
logs on ``torch.multiprocessing.spawn``, as torch's ``spawn`` does, so that
logging set up for torch sees them. Such a record is emitted once, on that
logger (and goes up its hierarchy to the root logger); handlers attached to
the ``aiospawn`` logger itself get it too, so no configuration of either
name misses it and the root logger never sees it twice.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["log_as", "logger"]

_home = logging.getLogger("aiospawn")

#: The logger a stand-in caller logs on, for the tasks and threads that run
#: its groups (they inherit the context that set it); None: ``aiospawn``'s.
_stand_in: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "aiospawn_log_as", default=None
)


def log_as(name: str) -> None:
    """Log the events of the groups run from this context on the logger ``name``.

    For the rest of the current context, and the tasks and threads that copy
    it; a thread of its own is the natural scope.
    """
    _stand_in.set(name)


class _OperationalLogger(logging.LoggerAdapter[logging.Logger]):
    """The ``aiospawn`` logger, or the stand-in's when :func:`log_as` named one."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        # One more frame than the logger counts: the record names our caller.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        name = _stand_in.get()
        if name is None:
            self.logger.log(level, msg, *args, **kwargs)
            return
        stand_in = logging.getLogger(name)
        home_wants = self.logger.isEnabledFor(level) and bool(self.logger.handlers)
        if not (stand_in.isEnabledFor(level) or home_wants):
            return
        record = _make_record(stand_in, level, msg, args, kwargs)
        if stand_in.isEnabledFor(level):
            stand_in.handle(record)  # its handlers, its ancestors', the root's
        if home_wants and not self.logger.disabled and self.logger.filter(record):
            # Only the aiospawn logger's own handlers: its parent is the root,
            # which the stand-in's record has reached already.
            for handler in self.logger.handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)


def _make_record(
    target: logging.Logger,
    level: int,
    msg: object,
    args: tuple[object, ...],
    kwargs: dict[str, Any],
) -> logging.LogRecord:
    """The record ``target.log(level, msg, *args, **kwargs)`` would make, without handling it."""
    # Counted from here: this frame and log()'s are two more than the caller's stacklevel.
    try:
        path, line, function, stack = target.findCaller(
            kwargs.get("stack_info", False), kwargs["stacklevel"] + 1
        )
    except ValueError:  # pragma: no cover - a stack shallower than the logging call
        path, line, function, stack = "(unknown file)", 0, "(unknown function)", None
    exc_info = kwargs.get("exc_info")
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    elif exc_info and not isinstance(exc_info, tuple):
        exc_info = sys.exc_info()
    extra: Mapping[str, object] | None = kwargs.get("extra")
    return target.makeRecord(
        target.name, level, path, line, msg, args, exc_info or None, function, extra, stack
    )


logger = _OperationalLogger(_home)
