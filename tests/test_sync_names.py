"""aiospawn.sync as a stand-in for the whole ``torch.multiprocessing`` module.

torch's module is ``multiprocessing`` (every name of its ``__all__``), torch's
sharing strategies and reductions, and torch's spawn API; aiospawn.sync has
each of these names, with its own spawn API, and imports torch only for a name
of torch's own. What imports torch runs in a fresh interpreter
(``tests/sync_names_probe.py``): this process must not fork with torch loaded.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import aiospawn
import aiospawn.sync as mp
from aiospawn._torch_mp import TORCH_NAMES
from tests.sync_names_probe import SPAWN_API

ROOT = Path(__file__).resolve().parent.parent

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="compares with torch.multiprocessing: needs torch (pip install torch==2.13.0)",
)


def probe(*flags: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-m", "tests.sync_names_probe", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # a tripwire: importing torch takes seconds on a busy machine
    )
    assert completed.returncode == 0, completed.stderr
    report: dict[str, Any] = json.loads(completed.stdout)
    return report


def test_every_name_of_multiprocessing_is_the_standard_librarys_object() -> None:
    # torch.multiprocessing re-exports multiprocessing.__all__ (`from multiprocessing import *`).
    assert set(multiprocessing.__all__) <= set(dir(mp))
    for name in multiprocessing.__all__:
        assert getattr(mp, name) is getattr(multiprocessing, name), name
    ctx = mp.get_context("spawn")
    assert ctx is multiprocessing.get_context("spawn")
    assert mp.current_process() is multiprocessing.current_process()


def test_the_spawn_api_is_aiospawns() -> None:
    assert set(dir(mp)) >= SPAWN_API
    assert mp.ProcessRaisedException is aiospawn.ProcessRaisedException
    assert mp.ProcessExitedException is aiospawn.ProcessExitedException
    for name in SPAWN_API - {"ENV_VAR_PARALLEL_START"}:
        assert getattr(mp, name).__module__.startswith("aiospawn"), name


def test_a_name_of_neither_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"module 'aiospawn.sync' has no attribute 'spwan'$"):
        mp.spwan  # noqa: B018
    assert not hasattr(mp, "reduction")  # multiprocessing's submodule, not in its __all__


@pytest.mark.torch
@needs_torch
def test_every_public_name_of_torch_multiprocessing() -> None:
    report = probe()
    assert not report["torch_imported_by_multiprocessing_names"]
    assert report["torch_imported_by_a_torch_name"]
    assert set(report["torch_names"]) - set(report["listed"]) == set(), "missing from dir()"
    # What torch defines beyond multiprocessing's names and the spawn API: TORCH_NAMES, exactly.
    assert set(report["torch_names"]) - set(multiprocessing.__all__) - SPAWN_API == TORCH_NAMES
    assert report["not_the_same_object"] == []  # the sharing strategies are torch's own
    assert report["strategy_seen_by_torch"] == "file_system"
    assert all(module.startswith("aiospawn") for module in report["spawn_api_modules"].values())
    assert report["same_parallel_start_variable"]


def test_without_torch_the_names_are_multiprocessings() -> None:
    report = probe("--no-torch")
    assert not report["probe_of_a_missing_name"]
    assert set(multiprocessing.__all__) | SPAWN_API <= set(report["listed"])
    assert not TORCH_NAMES & set(report["listed"])
    assert report["torch_name_error"] == (
        "module 'aiospawn.sync' has no attribute 'get_sharing_strategy': it is"
        " torch.multiprocessing's, and torch is not installed (pip install torch)"
    )
