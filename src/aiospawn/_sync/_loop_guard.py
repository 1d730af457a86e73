"""A blocking call refuses to run in a thread whose event loop it would stall.

Except in a notebook's synchronous cell: ipykernel runs every cell inside
its asyncio loop, and blocking a synchronous cell blocks what the kernel
expects a running cell to block, as ``torch.multiprocessing.spawn`` does
there.

Imports the standard library and ``aiospawn._core._loops``.
"""

from __future__ import annotations

import inspect
import sys
import types

from aiospawn._core._loops import running_loop

_COROUTINE_FLAGS = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR


def refuse_inside_event_loop(call: str) -> None:
    """Raise unless this thread may block.

    Args:
        call: The blocking call, as the message names it: ``"spawn()"``.

    Raises:
        RuntimeError: This thread runs an asyncio or trio event loop, outside
            a notebook's synchronous cell.
    """
    library = running_loop()
    if library is not None and not _called_from_a_notebook_cell():
        article = "an" if library == "asyncio" else "a"
        raise RuntimeError(
            f"aiospawn.sync.{call} blocks its thread, and this thread runs {article} {library}"
            " event loop that would stall meanwhile; use the async API instead: `await"
            " aiospawn.start_processes(...)` or `async with aiospawn.open_group(...) as group`"
        )


def _called_from_a_notebook_cell() -> bool:
    """True if the caller is a synchronous IPython cell (a Jupyter notebook's, say).

    ipykernel runs every cell inside its asyncio loop, so a plain cell sees a
    running loop, and even a current task (the kernel's own): neither tells a
    synchronous cell from a coroutine. The stack does. IPython executes a
    cell from its coroutine ``InteractiveShell.run_code``; a synchronous cell
    is plain code, so the nearest coroutine frame above the caller is
    ``run_code`` itself. A cell with top-level ``await``, or a coroutine
    defined anywhere, is a coroutine frame of its own, and is refused as in any
    async program.
    """
    interactiveshell = sys.modules.get("IPython.core.interactiveshell")
    shell = getattr(interactiveshell, "InteractiveShell", None)
    run_code = getattr(getattr(shell, "run_code", None), "__code__", None)
    if run_code is None:
        return False
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_flags & _COROUTINE_FLAGS:
            return frame.f_code is run_code
        frame = frame.f_back
    return False
