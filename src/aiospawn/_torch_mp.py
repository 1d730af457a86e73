"""The rest of ``torch.multiprocessing``'s namespace, for :mod:`aiospawn.sync`.

``torch.multiprocessing`` is three things in one module: the standard
library's ``multiprocessing`` (every name of its ``__all__``, as the very same
objects), torch's own additions (the sharing strategies and the tensor
reductions), and torch's spawn API. :mod:`aiospawn.sync` defines the spawn API
itself and hands every other name to :func:`lookup` (its module
``__getattr__``), which finds it on first use:

- a name of ``multiprocessing.__all__`` comes from ``multiprocessing``: torch
  re-exports the same objects, and its tensor reductions are registered by
  ``import torch`` whoever imports it, so a program that has tensors to share
  has them already;
- a name torch adds comes from ``torch.multiprocessing``, and only that imports
  torch (seconds, and hundreds of MB), the first time one is used.

So ``import aiospawn.sync`` stays as cheap as it was. Without torch installed,
the module is a stand-in for ``multiprocessing`` plus the spawn API, and
torch's names raise :class:`AttributeError` saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
from typing import Any

__all__ = ["TORCH_NAMES", "lookup", "names"]

#: What ``torch.multiprocessing`` defines itself, besides its spawn API and
#: besides what it re-exports from ``multiprocessing`` (read in torch 2.13).
#: The sharing strategies are a global of torch's module, set and read there.
TORCH_NAMES = frozenset(
    {
        "get_all_sharing_strategies",
        "get_sharing_strategy",
        "init_reductions",
        "reductions",
        "set_sharing_strategy",
    }
)


def names() -> set[str]:
    """The names :func:`lookup` finds: ``multiprocessing``'s, and torch's if it is installed.

    Looks for torch without importing it.
    """
    found = set(multiprocessing.__all__)
    if _torch_installed():
        found |= TORCH_NAMES
    return found


def lookup(module: str, name: str) -> Any:
    """Return the object ``torch.multiprocessing`` has under ``name``.

    Args:
        module: The name of the module asking, for the error message.
        name: The attribute looked up.

    Returns:
        ``multiprocessing``'s object for one of its names; torch's for one of
        :data:`TORCH_NAMES` (importing torch if it is not yet).

    Raises:
        AttributeError: ``name`` is none of these, or it is torch's and torch
            is not installed.
        Exception: torch is installed and its import failed (raised as is).
    """
    if name in multiprocessing.__all__:
        return getattr(multiprocessing, name)
    if name in TORCH_NAMES:
        if not _torch_installed():
            raise AttributeError(
                f"module {module!r} has no attribute {name!r}: it is torch.multiprocessing's,"
                " and torch is not installed (pip install torch)",
                name=name,
            )
        # Any error of torch's own import is the one to see: not caught.
        return getattr(importlib.import_module("torch.multiprocessing"), name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}", name=name)


def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None
