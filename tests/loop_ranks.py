"""Rank functions of tests/test_rank_loops.py: the loop an async rank runs on, what it imports."""

from __future__ import annotations

import sys

#: Modules of the supervisor that a rank must never import (trio itself imports sniffio).
SUPERVISOR_MODULES = ("anyio", "aiospawn._core", "aiospawn._local", "aiospawn.ray")


def _supervisor_modules() -> list[str]:
    return sorted(
        name
        for name in sys.modules
        if any(name == top or name.startswith(top + ".") for top in SUPERVISOR_MODULES)
    )


async def asyncio_loop_name(rank: int) -> tuple[str, list[str]]:
    import asyncio

    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__qualname__}", _supervisor_modules()


async def trio_run_name(rank: int) -> tuple[str, list[str]]:
    import trio

    trio.lowlevel.current_trio_token()  # raises outside trio.run
    return "trio", _supervisor_modules()


def sync_imports(rank: int) -> tuple[bool, list[str]]:
    return "asyncio" in sys.modules, _supervisor_modules()


def _rank_side_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.startswith("aiospawn._rank."))


def sync_rank_side(rank: int) -> list[str]:
    return _rank_side_modules()


async def async_rank_side(rank: int) -> list[str]:
    return _rank_side_modules()
