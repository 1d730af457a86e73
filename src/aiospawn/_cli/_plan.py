"""A checked ``aiospawn run`` command line: what to start, and how."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

import aiospawn
from aiospawn._rank.programs import (
    rank_function,
    rank_module,
    rank_program,
    rank_script,
    resolve_function,
)

from ._parse import STREAM_MODES, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Plan"]


class Plan:
    """A checked ``aiospawn run`` command line: what to start and how."""

    def __init__(self, options: argparse.Namespace) -> None:
        if options.restart_window is not None and not options.max_restarts:
            raise UsageError("--restart-window needs --max-restarts N, N > 0")
        if options.restart_window == 0:
            raise UsageError("--restart-window must be more than 0 seconds")
        self.restart = (
            aiospawn.RestartPolicy(
                max_restarts=options.max_restarts,
                window=options.restart_window or math.inf,
            )
            if options.max_restarts
            else None
        )
        if options.target is None:
            raise UsageError(
                "missing TARGET: a script, -m module, --fn module:function or --no-python program"
            )
        self.nprocs: int = options.nprocs
        self.start_method: str = options.start_method
        self.grace_period: float | None = options.grace_period
        self.verbose: bool = options.verbose
        self.fn, self.args, self.name = _target(options)
        default = "prefix" if self.nprocs > 1 else "inherit"
        log_dir = options.log_dir
        self.stdout: str = options.stdout or log_dir or default
        self.stderr: str = options.stderr or log_dir or default
        self.tee: bool = options.tee
        if self.tee and all(mode in STREAM_MODES for mode in (self.stdout, self.stderr)):
            raise UsageError("--tee needs --log-dir DIR, or a directory for --stdout or --stderr")
        # Beside the torchrun_env variables; --env wins over both.
        self.env = dict(options.env)
        self.omp_note = (
            self.nprocs > 1
            and "OMP_NUM_THREADS" not in os.environ
            and "OMP_NUM_THREADS" not in self.env
        )
        if self.omp_note:
            self.env = {"OMP_NUM_THREADS": "1", **self.env}


def _target(options: argparse.Namespace) -> tuple[Callable[..., None], tuple[Any, ...], str]:
    """The rank function and its arguments for the launch mode; UsageError if unusable."""

    target: str = options.target
    args: list[str] = list(options.args)
    if options.module:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as python -m: the current directory first
        _check_module(target)
        return rank_module, (target, args), f"-m {target}"
    if options.fn:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            resolve_function(target)
        except Exception as exc:
            raise UsageError(f"--fn {target}: {exc}") from None
        return rank_function, (target, args), f"--fn {target}"
    if options.no_python:
        if shutil.which(target) is None:
            raise UsageError(f"--no-python {target}: no such executable program")
        return rank_program, ([target, *args],), target
    if not os.path.exists(target):
        raise UsageError(f"script {target!r} does not exist")
    return rank_script, (target, args), target


def _check_module(name: str) -> None:

    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:  # a parent package failed to import, or a bad name
        raise UsageError(f"-m {name}: {exc}") from None
    if spec is None:
        raise UsageError(f"-m {name}: no module named {name!r}")
