"""The public surface: ``__all__`` discipline, documentation, and lazy imports."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PUBLIC_MODULES = ["aiospawn", "aiospawn.sync", "aiospawn.ray"]


def public_module(name: str) -> types.ModuleType:
    if name == "aiospawn.sync":  # the torch-compatible module may not exist yet
        return pytest.importorskip(name)
    return importlib.import_module(name)


def documented_constant(name: str, value: object) -> bool:
    """True if an aiospawn module assigns ``name`` right below a ``#:`` comment."""
    pattern = re.compile(rf"^#:.*\n(?:#:.*\n)*{re.escape(name)}\b.*=", re.MULTILINE)
    for module in list(sys.modules.values()):
        if not module or not module.__name__.startswith("aiospawn"):
            continue
        if getattr(module, name, None) is value and pattern.search(inspect.getsource(module)):
            return True
    return False


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_exists_and_is_documented(name: str) -> None:
    module = public_module(name)
    assert inspect.getdoc(module), f"{name} has no docstring"
    exported = module.__all__
    assert len(set(exported)) == len(exported), f"{name}.__all__ has duplicates"
    undocumented = []
    for attr in exported:
        value = getattr(module, attr)  # AttributeError: listed but missing
        if inspect.isclass(value):
            documented = bool(vars(value).get("__doc__"))  # its own, not inherited
        elif callable(value):
            documented = bool(value.__doc__)
        else:
            documented = documented_constant(attr, value)
        if not documented:
            undocumented.append(attr)
    assert not undocumented, f"{name}: undocumented public names {undocumented}"
    assert set(exported) <= set(dir(module))


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_objects_live_in_the_package(name: str) -> None:
    module = public_module(name)
    for attr in module.__all__:
        value = getattr(module, attr)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__.startswith("aiospawn"), (attr, value.__module__)


def imported_after(statement: str) -> dict[str, bool]:
    """Run ``statement`` in a fresh interpreter; report which event-loop modules it loaded."""
    code = (
        "import json, sys\n"
        "before = {m: m in sys.modules for m in ('anyio', 'asyncio', 'trio')}\n"
        f"{statement}\n"
        "after = {m: m in sys.modules for m in ('anyio', 'asyncio', 'trio')}\n"
        "print(json.dumps({'before': before, 'after': after}))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(completed.stdout)
    assert not any(report["before"].values()), f"the interpreter itself loaded {report['before']}"
    return report["after"]  # type: ignore[no-any-return]


def test_the_rank_bootstrap_imports_no_event_loop() -> None:
    """DESIGN.md invariant 7: a rank pays for the interpreter and its own code only."""
    assert imported_after("import aiospawn._child") == {
        "anyio": False,
        "asyncio": False,
        "trio": False,
    }


def test_importing_aiospawn_loads_its_names_lazily() -> None:
    assert imported_after("import aiospawn")["anyio"] is False
    # The control: the names do load anyio once used.
    assert imported_after("import aiospawn; aiospawn.start_processes")["anyio"] is True


def test_an_unknown_name_is_an_attribute_error() -> None:
    import aiospawn

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        aiospawn.no_such_name  # noqa: B018
