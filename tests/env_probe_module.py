"""Imported by a spawn rank: records the environment as it was when the module was imported."""

from __future__ import annotations

import os

AT_IMPORT = os.environ.get("AIOSPAWN_PROBE")


def probe_at_import(rank: int) -> str | None:
    return AT_IMPORT
