"""Sphinx configuration of aiospawn's documentation (MyST Markdown, furo theme).

Build it with warnings as errors, as CI does:

    .venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import Any

from docutils import nodes

project = "aiospawn"
author = "The aiospawn developers"
copyright = "the aiospawn developers"
release = _version("aiospawn")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# MyST: anchors for headings down to level 3, so pages can link to sections
# (and GitHub's rendering of the same files keeps working links).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# The API reference documents the public names only (aiospawn.X), never the
# private modules they live in, which may move.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Type hints name classes by their public names where those resolve (see
# _public_reference below).
python_use_unqualified_type_names = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"aiospawn {release}"


def _public_reference(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve ``aiospawn._module.Name`` (from a type hint) to the public ``Name``.

    Type hints name the private module a class is defined in; the reference
    documents each class under its public name only. A private name with no
    public one (an internal protocol) is shown by its bare name, unlinked.
    """
    target = node.get("reftarget", "")
    *modules, name = target.split(".")
    private = modules[:1] == ["aiospawn"] and any(part.startswith("_") for part in modules)
    if node.get("refdomain") != "py" or not private:
        return None
    for public in ("aiospawn", "aiospawn.sync", "aiospawn.ray"):
        if name in getattr(importlib.import_module(public), "__all__", ()):
            public_target = f"{public}.{name}"
            domain = env.get_domain("py")
            builder, kind = app.builder, node["reftype"]
            return domain.resolve_xref(
                env, node["refdoc"], builder, kind, public_target, node, contnode
            )
    return nodes.literal(name, name) if node.get("refexplicit") else nodes.Text(name)


def setup(app: Any) -> None:
    app.connect("missing-reference", _public_reference)
