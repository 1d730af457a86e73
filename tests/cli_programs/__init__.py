"""Small programs that tests/test_cli.py runs through the ``aiospawn`` command.

Each prints what the test needs to see, as JSON or plain lines, and flushes,
so that a test can wait for a line instead of sleeping.
"""
