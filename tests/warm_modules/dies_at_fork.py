"""Ends its importer with exit code 5 when it is about to fork: a template that dies at a start."""

from __future__ import annotations

import os

os.register_at_fork(before=lambda: os._exit(5))
