"""Run in a fresh interpreter by tests/test_sync_names.py: what aiospawn.sync's names import.

``python -m tests.sync_names_probe [--no-torch]`` prints one JSON object.
``--no-torch`` makes torch unimportable first, as if it were not installed.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import sys
import types
from typing import Any

#: torch's spawn API, which aiospawn.sync replaces with its own.
SPAWN_API = frozenset(
    {
        "ENV_VAR_PARALLEL_START",
        "ProcessContext",
        "ProcessExitedException",
        "ProcessRaisedException",
        "SpawnContext",
        "spawn",
        "start_processes",
    }
)


def public_names(module: types.ModuleType) -> set[str]:
    """The names a program can use: not private, and not a module imported for its own use.

    ``torch.multiprocessing`` holds ``sys``, ``torch`` and ``multiprocessing``
    because it imports them; its ``reductions`` submodule and ``reducer``
    (in ``multiprocessing.__all__``) are part of its API.
    """
    exported = set(getattr(module, "__all__", ()))
    names = set()
    for name in dir(module):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        if (
            isinstance(value, types.ModuleType)
            and name not in exported
            and not value.__name__.startswith(module.__name__ + ".")
        ):
            continue
        names.add(name)
    return names


def main() -> None:
    if "--no-torch" in sys.argv:
        sys.modules["torch"] = None  # type: ignore[assignment]  # imports of it now fail

    import aiospawn.sync as mp

    report: dict[str, Any] = {"listed": sorted(dir(mp))}
    for name in multiprocessing.__all__:
        getattr(mp, name)
    mp.get_context("spawn").SimpleQueue().close()
    report["probe_of_a_missing_name"] = hasattr(mp, "no_such_name")
    report["torch_imported_by_multiprocessing_names"] = sys.modules.get("torch") is not None
    try:
        mp.get_sharing_strategy()
    except AttributeError as exc:
        report["torch_name_error"] = str(exc)
        print(json.dumps(report))
        return
    report["torch_imported_by_a_torch_name"] = sys.modules.get("torch") is not None

    torch_mp: Any = importlib.import_module("torch.multiprocessing")  # untyped here

    theirs = public_names(torch_mp)
    report["torch_names"] = sorted(theirs)
    report["not_the_same_object"] = sorted(
        name
        for name in theirs - SPAWN_API
        if name in dir(mp) and getattr(mp, name) is not getattr(torch_mp, name)
    )
    report["spawn_api_modules"] = {
        name: getattr(mp, name).__module__
        for name in sorted(SPAWN_API - {"ENV_VAR_PARALLEL_START"})
    }
    report["same_parallel_start_variable"] = (
        mp.ENV_VAR_PARALLEL_START == torch_mp.ENV_VAR_PARALLEL_START
    )
    mp.set_sharing_strategy("file_system")
    report["strategy_seen_by_torch"] = torch_mp.get_sharing_strategy()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
