"""The documentation's code runs: every program in docs/ prints what its page says.

A Python block fenced as ```` ```python run ```` is a whole program. It is written
to a file and run in a fresh interpreter, as a reader would run it, and must exit
with 0; a ```` ```text output ```` block right after it holds what it must print
(``...`` matches anything, as in doctest). Every other Python block, a fragment,
must at least compile. The API reference must name every public name.
"""

from __future__ import annotations

import ast
import doctest
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

import aiospawn
import aiospawn.ray
import aiospawn.sync

DOCS = Path(__file__).resolve().parent.parent / "docs"

#: The info strings of a runnable program and of the output it prints.
RUN = ("python", "run")
OUTPUT = ("text", "output")

#: A fenced block: its fence, its info string, its body. Fences of four or more
#: backticks hold blocks that show a fence themselves.
FENCE = re.compile(
    r"^(?P<fence>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    info: tuple[str, ...]
    body: str

    @property
    def language(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    return [
        Block(
            page=path.name,
            line=text.count("\n", 0, match.start()) + 1,
            info=tuple(match["info"].split()),
            body=match["body"],
        )
        for match in FENCE.finditer(text)
    ]


def programs() -> list[tuple[Block, str | None]]:
    """Each runnable program, with the output its page shows (None: not shown)."""
    found = []
    for path in sorted(DOCS.glob("*.md")):
        page = blocks(path)
        for block, following in zip(page, [*page[1:], None], strict=True):
            if block.info == RUN:
                shown = following.body if following and following.info == OUTPUT else None
                found.append((block, shown))
    return found


def fragments() -> list[Block]:
    return [
        block
        for path in sorted(DOCS.glob("*.md"))
        for block in blocks(path)
        if block.language == "python" and block.info != RUN
    ]


PROGRAMS = programs()
FRAGMENTS = fragments()


def test_the_main_examples_are_run() -> None:
    pages = {block.page for block, _ in PROGRAMS}
    assert {"getting-started.md", "guide.md", "supervision.md", "semantics.md", "torch.md"} <= pages
    assert all(shown is not None for _, shown in PROGRAMS), "every program shows its output"


def test_every_output_block_follows_a_program() -> None:
    for path in sorted(DOCS.glob("*.md")):
        page = blocks(path)
        for previous, block in zip([None, *page[:-1]], page, strict=True):
            if block.info == OUTPUT:
                assert previous is not None, f"{block.where}: output of no program"
                assert previous.info == RUN, f"{block.where}: output of no program"


@pytest.mark.parametrize("block", FRAGMENTS, ids=[block.where for block in FRAGMENTS])
def test_fragment_compiles(block: Block) -> None:
    # A fragment may await at the top level, as the pages show it inside a coroutine.
    compile(
        block.body, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )


@pytest.mark.parametrize(("block", "shown"), PROGRAMS, ids=[block.where for block, _ in PROGRAMS])
def test_program_prints_what_the_page_shows(
    block: Block, shown: str | None, tmp_path: Path
) -> None:
    script = tmp_path / f"{Path(block.page).stem.replace('-', '_')}_{block.line}.py"
    script.write_text(block.body, encoding="utf-8")
    completed = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, (
        f"{block.where} exited {completed.returncode}:\n{completed.stderr}"
    )
    if shown is not None:
        checker = doctest.OutputChecker()
        assert checker.check_output(shown, completed.stdout, doctest.ELLIPSIS), (
            f"{block.where} printed:\n{completed.stdout}\nbut the page shows:\n{shown}"
        )


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # pytest makes its base temp dir on first use, inside the tests' temp dir;
    # made before the leak check's baseline, it is not a leak of the first test.
    tmp_path_factory.getbasetemp()


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("aiospawn", aiospawn.__all__),
        ("aiospawn.sync", aiospawn.sync.__all__),
        ("aiospawn.ray", aiospawn.ray.__all__),
    ],
)
def test_the_api_reference_names_every_public_name(module: str, names: list[str]) -> None:
    reference = (DOCS / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"\.\. auto\w+:: ([\w.]+)", reference))
    # aiospawn.sync re-exports aiospawn's exceptions; the page says they are the same objects.
    mentioned = set(re.findall(r"`([\w.]+)`", reference))
    missing = [
        name
        for name in names
        if f"{module}.{name}" not in documented and f"{module}.{name}" not in mentioned
    ]
    assert not missing, f"docs/api.md does not document {missing}"


ROOT = DOCS.parent


def test_installs_of_our_extras_work_from_a_clone() -> None:
    # aiospawn is installed from its repository: "pip install 'aiospawn[x]'"
    # looks for it on a package index instead.
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    wrong = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if "pip install" in line and "aiospawn[" in line
    ]
    assert not wrong, f"pip install 'aiospawn[...]' where -e '.[...]' is meant: {wrong}"


def test_the_readme_names_every_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("## Install") : readme.index("## Quick start")]
    assert [name for name in extras if f"`{name}`" not in install] == []
