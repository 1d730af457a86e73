"""A user's script whose rank function lives in ``__main__``, for tests/test_warm.py.

Run as ``python tests/warm_main_script.py START EXTRA_DIR`` (START is
``forkserver`` or ``warm``). Before starting ranks it puts EXTRA_DIR on
``sys.path`` (which holds ``extra_module.py``), then prints one JSON line: what
each rank saw of ``__main__``, ``sys.path`` and ``sys.argv``.
"""

from __future__ import annotations

import json
import os
import sys

import anyio

import aiospawn

#: The processes that ran this file's top level, under any name.
LOADED_BY = [os.getpid()]


def main_fn(rank: int, extra: str) -> dict[str, object]:
    import extra_module  # type: ignore[import-not-found]  # found through sys.path only

    main = sys.modules["__main__"]
    return {
        "main_name": main.__name__,
        "fn_module": main_fn.__module__,
        "same_main": main is sys.modules.get("__mp_main__"),
        "main_file": os.path.basename(getattr(main, "__file__", "")),
        "main_ran_here": os.getpid() in main.LOADED_BY,
        "extra_on_path": extra in sys.path,
        "extra_module": extra_module.VALUE,
        "argv": sys.argv[1:],
    }


async def run(start: str, extra: str) -> None:
    sys.path.insert(0, extra)
    options: dict[str, object] = {"start_method": "forkserver"}
    if start == "warm":
        options = {"preload": ["json"]}
    results = await aiospawn.start_processes(main_fn, (extra,), nprocs=2, **options)  # type: ignore[call-overload]
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    anyio.run(run, sys.argv[1], sys.argv[2])
