"""The values of ``aiospawn run``'s options: one function per kind, each checks one.

Each is an argparse ``type``: it takes the word as typed and returns the value,
or raises :class:`argparse.ArgumentTypeError` with what it wants and what it
got, which the parser reports as a usage error naming the option.
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal

from aiospawn._core._env import visible_devices
from aiospawn._core._spec import UNCATCHABLE_SIGNALS, check_seconds

__all__ = [
    "STREAM_MODES",
    "count",
    "device_list",
    "env_pair",
    "module_list",
    "nprocs",
    "positive_seconds",
    "rank_list",
    "seconds",
    "signal_list",
    "stream_mode",
]

#: The ``--stdout``/``--stderr`` modes that are not a directory.
STREAM_MODES = ("prefix", "inherit", "devnull")


def nprocs(text: str) -> int:
    """``-n``: a positive count, or ``auto``, ``cpu`` or ``gpu``."""
    if text == "gpu" or (text == "auto" and visible_devices()):
        gpus = len(visible_devices())
        if not gpus:
            raise argparse.ArgumentTypeError("'gpu' wants GPUs, and none is visible here")
        return gpus
    if text in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants a positive integer, 'auto', 'cpu' or 'gpu', got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"wants a positive integer, 'auto', 'cpu' or 'gpu', got {text!r}"
        )
    return value


def seconds(text: str) -> float:
    """Seconds: a finite number, 0 or more."""
    try:
        value = float(text)
        check_seconds("SECONDS", value, allow_none=False, finite=True)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"wants a non-negative number of seconds, got {text!r}"
        ) from None
    return value


def positive_seconds(text: str) -> float:
    """Seconds, more than 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("wants more than 0 seconds")
    return value


def count(text: str) -> int:
    """A whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"wants a non-negative whole number, got {text!r}")
    return value


def signal_list(text: str) -> list[signal.Signals]:
    """``--signals-to-handle``: signal names, with or without ``SIG``; never SIGKILL or SIGSTOP."""
    signums: list[signal.Signals] = []
    for item in text.split(","):
        name = item.strip().upper()
        if name and not name.startswith("SIG"):
            name = "SIG" + name
        value = getattr(signal, name, None)
        if not isinstance(value, signal.Signals) or value in UNCATCHABLE_SIGNALS:
            raise argparse.ArgumentTypeError(
                f"wants signal names such as SIGTERM,SIGUSR1 (not SIGKILL or SIGSTOP),"
                f" got {item.strip()!r}"
            )
        signums.append(value)
    return signums


def stream_mode(text: str) -> str:
    """``--stdout``/``--stderr``: a mode of :data:`STREAM_MODES`, or a directory."""
    if text == "capture":
        raise argparse.ArgumentTypeError(
            "'capture' is for the Python API (ctx.output()); use prefix, inherit, devnull"
            " or a directory"
        )
    if not text:
        raise argparse.ArgumentTypeError("wants prefix, inherit, devnull or a directory")
    if text not in STREAM_MODES and not _names_a_directory(text):
        # A bare word that is no mode is far more often a typo (--stdout prefx)
        # than a directory to make; a path says it is one.
        close = difflib.get_close_matches(text, STREAM_MODES, n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a mode ({', '.join(STREAM_MODES)}) nor an existing"
            f" directory; {guess}for a new directory, give a path: ./{text}"
        )
    return text


def _names_a_directory(text: str) -> bool:
    """True if a ``--stdout``/``--stderr`` value is a directory: one that exists, or a path."""
    separators = {os.sep} | ({os.altsep} if os.altsep else set())
    return os.path.isdir(text) or any(sep in text for sep in separators)


def rank_list(text: str) -> frozenset[int]:
    """``--local-ranks-filter``: rank numbers, ``0`` or ``0,3``."""
    items = text.split(",")
    if not all(item.strip().isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"wants ranks such as 0 or 0,3, got {text!r}")
    return frozenset(int(item) for item in items)


def device_list(text: str) -> list[str]:
    """``--devices``: device ids, ``0,1,2,3``."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"wants device ids such as 0,1,2,3, got {text!r}")
    return items


def module_list(text: str) -> list[str]:
    """``--preload`` value: comma-separated module names."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected module names separated by commas, got {text!r}")
    return names


def env_pair(text: str) -> tuple[str, str]:

    key, equals, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"wants KEY=VALUE or KEY, got {text!r}")
    if not equals:
        # The value from our own environment: a secret given on the command
        # line is in our argv, which every local user can read (ps).
        if key not in os.environ:
            raise argparse.ArgumentTypeError(
                f"{key} is not set in the launcher's environment (--env KEY takes its value"
                " from there)"
            )
        value = os.environ[key]
    return key, value
