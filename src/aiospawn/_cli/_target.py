"""What ``aiospawn run`` runs in each rank: a script, ``-m`` module, ``--fn`` or program.

Found and checked in the launcher before anything starts, from the
directory the target's own imports start from, with each refusal said in the
command line's words.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

from aiospawn._rank.programs import (
    rank_function,
    rank_module,
    rank_program,
    rank_script,
    resolve_function,
)

from ._parse import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["search_target_directory", "target"]


def search_target_directory(options: argparse.Namespace) -> None:
    """Put first on ``sys.path`` the directory the target's imports start from.

    As the rank will, and as ``python`` does: the current directory for ``-m``
    and ``--fn``, the script's own for a script (in place of the launcher's
    own first entry, as ``rank_script`` does it). So the launcher finds the
    modules the target finds when it checks ``--fn``, ``-m`` and ``--preload``,
    and so does a warm template, which takes the launcher's ``sys.path`` (run
    as the ``aiospawn`` command, its first entry is the command's directory).
    """
    if options.module or options.fn:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
    elif not options.no_python and os.path.exists(options.target):
        sys.path[0] = os.path.dirname(os.path.abspath(options.target))


def target(
    options: argparse.Namespace, *, absolute: bool
) -> tuple[Callable[..., None], tuple[Any, ...], str]:
    """The rank function and its arguments for the launch mode; UsageError if unusable.

    With ``absolute``, a script's path is made absolute: a Ray worker runs in
    a directory of its own.
    """

    target: str = options.target
    args: list[str] = list(options.args)
    if options.module:
        _check_module(target)
        return rank_module, (target, args), f"-m {target}"
    if options.fn:
        module, colon, _ = target.partition(":")
        if colon and module:
            _import_here(module, f"--fn {target}")
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
    path = os.path.abspath(target) if absolute else target
    return rank_script, (path, args), target


#: The variables a rank has and the launcher has not (torchrun's, per rank).
RANK_VARIABLES = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR"}
    | {"MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"}
)


def _import_here(module: str, flag: str) -> None:
    """Import ``module`` in the launcher, to check it; UsageError that says what went wrong."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module + ".").startswith(exc.name + "."):
            raise UsageError(f"{flag}: no module named {exc.name!r}") from None
        raise UsageError(_import_failed(module, flag, exc)) from None
    except (Exception, SystemExit) as exc:
        raise UsageError(_import_failed(module, flag, exc)) from None


def _import_failed(module: str, flag: str, exc: BaseException) -> str:

    message = (
        f"{flag}: importing module {module!r} in the launcher, to check that the function"
        f" exists, raised {type(exc).__name__}: {exc}"
    )
    if isinstance(exc, KeyError) and exc.args and exc.args[0] in RANK_VARIABLES:
        message += (
            f" ({exc.args[0]} is set in each rank, not in the launcher: read it when the"
            " function runs, not at import)"
        )
    return message


def _check_module(name: str) -> None:

    try:
        spec = importlib.util.find_spec(name)
    except Exception as exc:  # a parent package failed to import, or a bad name
        raise UsageError(f"-m {name}: {exc}") from None
    if spec is None:
        raise UsageError(f"-m {name}: no module named {name!r}")
