"""A stand-in for a module that initialises CUDA at import: a ``torch`` whose CUDA is initialised.

Installed as ``sys.modules["torch"]`` in the process that imports it (a
template), so that the template's CUDA check sees what it would see after a
real ``torch.cuda.init()``, on a machine without a GPU.
"""

from __future__ import annotations

import sys
import types

torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)  # type: ignore[attr-defined]
sys.modules["torch"] = torch
