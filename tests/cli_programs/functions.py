"""Functions for ``aiospawn run --fn tests.cli_programs.functions:NAME``."""

from __future__ import annotations

import json
import os

NOT_CALLABLE = 3


def greet(rank: int, *args: str) -> str:
    """Print the rank, the arguments and RANK from the environment as JSON."""
    print(json.dumps({"rank": rank, "args": list(args), "env_rank": os.environ["RANK"]}))
    return "ignored"  # the launcher does not use what the function returns
