"""``python -m aiospawn``: the command-line launcher (see :mod:`aiospawn._cli`)."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
