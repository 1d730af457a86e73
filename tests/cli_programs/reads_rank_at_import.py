"""A ``--fn`` module that reads its rank at import, as torchrun scripts often do."""

from __future__ import annotations

import os

RANK = int(os.environ["RANK"])


def main(rank: int) -> None:
    """Print the rank read at import."""
    print(RANK)
