"""Modules that warm-start tests preload into a template (see tests/test_warm.py)."""
