"""Ends the importing process with exit code 3, as a crashing extension module would."""

from __future__ import annotations

import os

os._exit(3)
