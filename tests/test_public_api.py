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
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Made before the leak check's first baseline: not a leak of the first test.
    tmp_path_factory.getbasetemp()


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


def test_the_errors_are_aiospawns_by_name_through_aiospawn_sync_alone() -> None:
    # A program that only does `import aiospawn.sync as mp` sees them in
    # tracebacks and reprs as aiospawn's, not under a private module.
    code = (
        "import aiospawn.sync as mp\n"
        "print(repr([mp.ProcessException, mp.ProcessExitedException,"
        " mp.ProcessRaisedException]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == (
        "[<class 'aiospawn.ProcessException'>, <class 'aiospawn.ProcessExitedException'>,"
        " <class 'aiospawn.ProcessRaisedException'>]"
    )


def imported_after(statement: str) -> dict[str, bool]:
    """Run ``statement`` in a fresh interpreter; report which event-loop modules it loaded."""
    code = (
        "import json, sys\n"
        "before = {m: m in sys.modules for m in ('anyio', 'asyncio', 'trio')}\n"
        f"{statement}\n"
        "after = {m: m in sys.modules for m in ('anyio', 'asyncio', 'trio')}\n"
        "print(json.dumps({'before': before, 'after': after}))\n"
    )
    report = printed_json(code)
    assert not any(report["before"].values()), f"the interpreter itself loaded {report['before']}"
    return report["after"]  # type: ignore[no-any-return]


def test_the_rank_bootstrap_imports_no_event_loop() -> None:
    """Invariant 7 (docs/architecture.md): a rank pays for the interpreter and its own code."""
    assert imported_after("import aiospawn._rank.bootstrap") == {
        "anyio": False,
        "asyncio": False,
        "trio": False,
    }


def test_a_trio_supervisor_never_imports_asyncio() -> None:
    # Importing asyncio took about 15 ms of a trio program's first group: it
    # has no use for it, in a success or a failure.
    statement = (
        "import operator, trio, aiospawn\n"
        "async def main():\n"
        "    ranks = await aiospawn.start_processes(operator.neg, nprocs=2, start_method='fork')\n"
        "    assert ranks == [0, -1], ranks\n"
        "    try:\n"
        "        await aiospawn.start_processes(\n"
        "            operator.truediv, args=(0,), nprocs=2, start_method='fork'\n"
        "        )\n"
        "    except aiospawn.ProcessRaisedException as exc:\n"
        "        assert 'ZeroDivisionError' in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError('a rank divided by zero')\n"
        "trio.run(main)"
    )
    assert imported_after(statement) == {"anyio": True, "asyncio": False, "trio": True}


def printed_json(code: str) -> Any:
    """What ``code``, run in a fresh interpreter from the repository, printed as JSON."""
    completed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def modules_loaded_by(statement: str, after: str = "") -> set[str]:
    """The modules that ``statement`` loads in a fresh interpreter, beyond its start-up.

    ``after``: imports run first, whose modules are not counted.
    """
    code = (
        f"import json, sys\n{after}\n"
        "before = set(sys.modules)\n"
        f"{statement}\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    return set(printed_json(code))


def test_the_rank_side_package_imports_the_standard_library_only() -> None:
    rank_side = {
        f"aiospawn._rank.{path.stem}"
        for path in (ROOT / "src" / "aiospawn" / "_rank").glob("*.py")
        if path.stem != "__init__"
    }
    loaded = modules_loaded_by("import " + ", ".join(sorted(rank_side)))
    ours = {name for name in loaded if name.split(".")[0] == "aiospawn"}
    assert ours == {"aiospawn", "aiospawn._rank", *rank_side}
    foreign = {
        name
        for name in loaded - ours
        if name.split(".")[0] not in sys.stdlib_module_names and not name.startswith("_")
    }
    assert not foreign, f"the rank side imported {sorted(foreign)}"


def test_a_rank_imports_no_typing() -> None:
    # typing costs a spawn rank about 2 ms, and a NamedTuple compiles each of
    # its annotations: the rank side uses it for the checker only.
    loaded = modules_loaded_by("import aiospawn._rank.bootstrap, aiospawn._rank.programs")
    assert "typing" not in loaded
    assert "aiospawn._rank.bootstrap" in loaded


def loaded_by_a_first_group(options: str = "") -> set[str]:
    """The modules a first ``fork`` group (with ``options``) loads, beyond anyio and the facade."""
    return modules_loaded_by(
        "ranks = anyio.run(lambda: aiospawn.start_processes(\n"
        f"    operator.neg, nprocs=2, start_method='fork'{options}))\n"
        "assert ranks == [0, -1], ranks",
        after="import operator, anyio, aiospawn",
    )


def test_only_a_group_that_watches_heartbeats_loads_the_hang_watch() -> None:
    # Its dataclasses took 3-4 ms of every first call.
    assert "aiospawn._core._hangs" not in loaded_by_a_first_group()
    assert "aiospawn._core._hangs" in loaded_by_a_first_group(", heartbeat_timeout=60")


def test_only_a_group_that_writes_to_a_directory_imports_pathlib(tmp_path: Path) -> None:
    # pathlib took about 5 ms of every first call.
    assert "pathlib" not in loaded_by_a_first_group()
    assert "pathlib" in loaded_by_a_first_group(f", stdout={str(tmp_path)!r}")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["rank0.stdout", "rank1.stdout"]


#: What a first call may import on the loop's thread: the facade's entry module,
#: the one that imports the rest off the loop, and the two small modules they
#: need to tell which loop runs them.
ALLOWED_ON_THE_LOOP = (
    "aiospawn._api",
    "aiospawn._imports",
    "aiospawn._core._loops",
    "aiospawn._core._notebook",
)


def imported_on_the_loop(runner: str, start_method: str) -> set[str]:
    """The modules a first group imports on the loop's thread, in a fresh interpreter.

    ``runner``: ``"asyncio"`` (``asyncio.run``, so anyio has imported no
    backend yet) or ``"trio"``. A finder first on ``sys.meta_path`` notes
    every module looked up on the main thread while the call runs.
    """
    run = "asyncio.run(first_group())" if runner == "asyncio" else "trio.run(first_group)"
    code = (
        f"import json, operator, sys, threading, {runner}, aiospawn\n"
        "main, seen = threading.get_ident(), []\n"
        "class Spy:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if threading.get_ident() == main:\n"
        "            seen.append(name)\n"
        "async def first_group():\n"
        "    sys.meta_path.insert(0, Spy)\n"
        "    try:\n"
        "        ranks = await aiospawn.start_processes(\n"
        f"            operator.neg, nprocs=2, start_method={start_method!r})\n"
        "    finally:\n"
        "        sys.meta_path.remove(Spy)\n"
        "    assert ranks == [0, -1], ranks\n"
        f"{run}\n"
        "print(json.dumps(seen))\n"
    )
    return set(printed_json(code))


@pytest.mark.parametrize(
    ("runner", "start_method"),
    [("asyncio", "spawn"), ("asyncio", "forkserver"), ("trio", "forkserver")],
)
def test_a_first_call_imports_the_supervisor_off_the_loop(runner: str, start_method: str) -> None:
    # Issue 25: on the loop, multiprocessing.forkserver's imports took about
    # 9 ms of a first forkserver call, anyio's asyncio backend 25 ms of a
    # first call under asyncio.run; the loop stalls meanwhile.
    loaded = imported_on_the_loop(runner, start_method)
    ours_or_heavy = {
        name
        for name in loaded
        if name.startswith(("aiospawn", "anyio", "multiprocessing", "tempfile"))
        and not name.startswith(ALLOWED_ON_THE_LOOP)
        and name != "aiospawn._core"
    }
    assert not ours_or_heavy, f"imported on the loop's thread: {sorted(ours_or_heavy)}"


def test_a_first_call_hands_the_gil_over_quickly_while_it_imports_then_restores_it() -> None:
    # The import runs on a thread: with the default 5 ms switch interval, the
    # loop waited up to that for the GIL at every wake-up meanwhile.
    code = (
        "import json, operator, sys, threading, asyncio, aiospawn\n"
        "sys.setswitchinterval(0.004)  # the program's own\n"
        "main, during = threading.get_ident(), set()\n"
        "class Spy:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if threading.get_ident() != main and name.startswith('aiospawn.'):\n"
        "            during.add(sys.getswitchinterval())\n"
        "async def first_group():\n"
        "    sys.meta_path.insert(0, Spy)\n"
        "    try:\n"
        "        assert await aiospawn.start_processes(operator.neg, nprocs=2) == [0, -1]\n"
        "    finally:\n"
        "        sys.meta_path.remove(Spy)\n"
        "asyncio.run(first_group())\n"
        "print(json.dumps({'during': sorted(during), 'after': sys.getswitchinterval()}))\n"
    )
    seen = printed_json(code)
    assert seen["during"] == [pytest.approx(0.001)]
    assert seen["after"] == pytest.approx(0.004)


def test_the_core_imports_no_backend_and_no_rank_bootstrap() -> None:
    core = sorted(
        f"aiospawn._core.{path.stem}"
        for path in (ROOT / "src" / "aiospawn" / "_core").glob("_*.py")
        if path.stem != "__init__"
    )
    loaded = modules_loaded_by("import " + ", ".join(core))
    forbidden = {
        name
        for name in loaded
        if name.startswith(("aiospawn._local", "aiospawn.ray", "aiospawn._api", "aiospawn.sync"))
        or name in ("aiospawn._cli", "aiospawn._rank.bootstrap", "aiospawn._rank.programs")
    }
    assert not forbidden, f"aiospawn._core imported {sorted(forbidden)}"


def module_name(path: Path) -> str:
    """The dotted name of the module at ``path``, a file under ``src/``."""
    parts = list(path.relative_to(ROOT / "src").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it.

    At its top, under ``if TYPE_CHECKING:``, or inside a function: an import
    deferred to the first call is still a dependency. ``from package import
    name`` counts as importing ``package.name`` when that is a module.
    """
    import ast

    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                base = ".".join(anchor[: len(anchor) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            folder = ROOT / "src" / Path(*target.split("."))
            modules = {
                f"{target}.{alias.name}"
                for alias in node.names
                if (folder / f"{alias.name}.py").exists() or (folder / alias.name).is_dir()
            }
            # The package itself runs too, and its names, if any, are imported from it.
            found.add(target)
            found.update(modules)
    return found - {name}


def package_imports() -> dict[str, set[str]]:
    """Module -> the aiospawn modules it imports, anywhere in it (see :func:`imports_of`)."""
    return {
        module_name(path): {name for name in imports_of(path) if name.startswith("aiospawn")}
        for path in (ROOT / "src" / "aiospawn").rglob("*.py")
    }


def test_the_package_has_no_import_cycle() -> None:
    graph = package_imports()
    # A package's own __init__ is imported on the way to any of its modules;
    # that edge is Python's, not a design choice, so it does not count.
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph.get(name, ())):
            if name.startswith(target + "."):
                continue
            if state.get(target) == "open":
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, f"import cycles: {cycles}"


#: The modules longer than the 500 lines a module keeps to: the architecture page says why.
LONG_MODULES = frozenset({"_core/_group.py"})


def test_no_module_is_over_500_lines_but_those_the_architecture_page_explains() -> None:
    package = ROOT / "src" / "aiospawn"
    long = {
        path.relative_to(package).as_posix(): len(path.read_text().splitlines())
        for path in package.rglob("*.py")
        if len(path.read_text().splitlines()) > 500
    }
    assert set(long) == LONG_MODULES, long
    page = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    for name in LONG_MODULES:
        assert f"(`{name}`) is longer than the 500 lines" in page, name


#: The standard library modules the core must not import (its package docstring):
#: how local processes are made, pickled for and limited is the local backend's.
CORE_FORBIDS = frozenset({"multiprocessing", "resource"})

#: Of aiospawn's own modules, the core imports only its own and the rank's wire format.
CORE_MAY_IMPORT = ("aiospawn._core", "aiospawn._rank.wire", "aiospawn._rank.buffers")


def core_import_allowed(name: str) -> bool:
    """True if ``aiospawn._core``'s import rule lets it import the module ``name``."""
    top = name.partition(".")[0]
    if top == "aiospawn":
        return name == "aiospawn._rank" or any(
            name == allowed or name.startswith(allowed + ".") for allowed in CORE_MAY_IMPORT
        )
    if top in CORE_FORBIDS:
        return False
    return top in sys.stdlib_module_names or top in ("__future__", "anyio")


def test_the_core_imports_only_what_its_docstring_allows() -> None:
    broken = {
        f"{module_name(path)} imports {name}"
        for path in (ROOT / "src" / "aiospawn" / "_core").glob("*.py")
        for name in imports_of(path)
        if not core_import_allowed(name)
    }
    assert not broken, sorted(broken)


def test_the_core_import_rule_is_the_one_its_docstring_states() -> None:
    import aiospawn._core

    rule = " ".join((aiospawn._core.__doc__ or "").split())
    for forbidden in ("aiospawn._local", "aiospawn.ray", *sorted(CORE_FORBIDS)):
        assert f"``{forbidden}``" in rule.partition("Import rule:")[2], forbidden
    assert not core_import_allowed("aiospawn._local._strategy")
    assert not core_import_allowed("cloudpickle")
    assert core_import_allowed("aiospawn._rank.wire")


def test_public_names_report_the_package_as_their_module() -> None:
    import aiospawn

    for attr in aiospawn.__all__:
        value = getattr(aiospawn, attr)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__ == "aiospawn", (attr, value.__module__)


def test_the_version_comes_from_the_installed_package() -> None:
    from importlib.metadata import version

    import aiospawn

    assert aiospawn.__version__ == version("aiospawn")
    assert "__version__" not in aiospawn.__all__


def test_importing_aiospawn_loads_its_names_lazily() -> None:
    assert imported_after("import aiospawn")["anyio"] is False
    # The control: the names do load anyio once used.
    assert imported_after("import aiospawn; aiospawn.AsyncProcessContext")["anyio"] is True


def test_an_unknown_name_is_an_attribute_error() -> None:
    import aiospawn

    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        aiospawn.no_such_name  # noqa: B018
