"""Which event loop runs the caller, found without importing one.

The one place that asks: the core (asyncio or trio primitives), the local
backend (the loop's wakeup sockets a fork rank inherits) and ``aiospawn.sync``
(a blocking call refuses to stall a loop) all call these.

Both loops are looked up in ``sys.modules``, never imported: a loop that was
never imported runs nothing, and importing asyncio took about 15 ms of a
trio program's first group.

Imports the standard library only.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import asyncio


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running in this thread, if any.

    Under trio's guest mode (``trio.lowlevel.start_guest_run``) this is the
    host loop, in trio's tasks too.
    """
    module = sys.modules.get("asyncio")
    if module is None:
        return None
    try:
        loop: asyncio.AbstractEventLoop = module.get_running_loop()
    except RuntimeError:
        return None
    return loop


def running_loop() -> Literal["asyncio", "trio"] | None:
    """Name the event loop that runs the caller, if any.

    A trio task is trio's even when trio runs as a guest on an asyncio loop:
    its tasks run in the loop's callbacks, so asyncio sees a running loop,
    yet asyncio primitives would break them. Outside a task, a thread inside
    a trio run (an instrument's hook) is trio's too.
    """
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_task():
        return "trio"
    if running_asyncio_loop() is not None:
        return "asyncio"
    if trio is not None and trio.lowlevel.in_trio_run():
        return "trio"
    return None


def runs_asyncio() -> bool:
    """True if the caller runs on an asyncio loop, and not in a trio task."""
    return running_loop() == "asyncio"
