"""The async main: an ``async def fn``'s coroutine run on an event loop of its own.

Imported only by a rank whose ``fn`` returned a coroutine (see
``outcome.run_fn``), and the event loop it names only then: a sync rank
imports no event loop (invariant 7 on the architecture page). The processes
that ranks are forked from import it beforehand, once for all of their ranks:
the fork server (``forkserver``), a warm template, and the supervisor of a
``fork`` group (``process.RankSetup``). The loop is the
one ``rank_loop=`` chose: asyncio, uvloop or trio, whichever loop the
supervisor runs. SIGTERM cancels the rank's main task, so its cleanup runs.

Part of the rank-side package: standard library only (the event loop is the
user's choice, imported here when a rank needs it).
"""

from __future__ import annotations

import signal
from collections.abc import Coroutine

from . import api

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Terminated(BaseException):
    """SIGTERM cancelled an ``async def fn``, which has run its cleanup.

    Raised by :func:`run_coroutine`; :func:`~aiospawn._rank.outcome.run_fn`
    turns it into ``Ending.terminated``.
    """


def run_coroutine(main: Coroutine[Any, Any, Any], loop: str) -> Any:
    """Run the coroutine of an ``async def fn`` on a new event loop; SIGTERM cancels it.

    The first SIGTERM cancels the rank's main task, so its ``finally`` blocks
    and ``async with`` exits run, and puts back the default action: a second
    SIGTERM ends the rank at once. Once the task has unwound, the rank ends
    as killed by SIGTERM (see :func:`~aiospawn._rank.outcome.die_of_sigterm`),
    as a sync rank would.

    Args:
        main: The coroutine that ``fn(rank, *args)`` returned.
        loop: ``"asyncio"``, ``"trio"`` or ``"uvloop"``.

    Returns:
        What the coroutine returned.

    Raises:
        Terminated: SIGTERM cancelled the task (whatever it returned then).
    """
    api.use_loop("trio" if loop == "trio" else "asyncio")
    terminated: list[bool] = []
    if loop == "trio":
        import trio

        value = trio.run(_trio_main, main, terminated)
    else:
        import asyncio

        factory = None
        if loop == "uvloop":
            import importlib

            factory = importlib.import_module("uvloop").new_event_loop
        with asyncio.Runner(loop_factory=factory) as runner:
            value = runner.run(_asyncio_main(main, terminated))
    if terminated:
        raise Terminated
    return value


async def _asyncio_main(main: Coroutine[Any, Any, Any], terminated: list[bool]) -> Any:
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_sigterm() -> None:
        terminated.append(True)
        loop.remove_signal_handler(signal.SIGTERM)  # back to the default: a second one kills
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await main
    except asyncio.CancelledError:
        if not terminated:
            raise
        return None
    finally:
        if not terminated:
            loop.remove_signal_handler(signal.SIGTERM)


async def _trio_main(main: Coroutine[Any, Any, Any], terminated: list[bool]) -> Any:
    import trio

    token = trio.lowlevel.current_trio_token()
    value = None
    with trio.CancelScope() as scope:

        def on_sigterm(signum: int, frame: Any) -> None:
            terminated.append(True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one kills
            token.run_sync_soon(scope.cancel)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            value = await main
        finally:
            if not terminated:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return value
