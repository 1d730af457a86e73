"""``touch.py PATH``: create PATH, to show that a rank ran."""

import pathlib
import sys

pathlib.Path(sys.argv[1]).touch()
