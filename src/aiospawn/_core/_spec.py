"""What a group is asked to run, checked before anything starts.

A :class:`LaunchSpec` is the backend-independent description of a group: the
function and arguments every rank runs, how many ranks, the start method, the
environment and where output goes. :func:`make_spec` and
:func:`make_output_spec` check the user's arguments and say what to do instead;
nothing has started when they raise. :func:`check_seconds` is the one check
of options that are a number of seconds.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_METHODS = ("spawn", "fork", "forkserver")

#: Parent-side file descriptors a running rank holds: sentinel, pidfd, result pipe,
#: plus one while it starts.
FDS_PER_RANK = 4


#: The environment of a group's ranks: one mapping for all, or one per rank.
EnvSpec = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None


STREAMS = ("stdout", "stderr")
MODES = ("inherit", "prefix", "capture", "devnull")

DEFAULT_PREFIX = "[rank{rank}]: "


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputSpec:
    """Where a group's streams go: ``modes`` maps stream name to mode or directory."""

    modes: dict[str, str | Path]
    tee: bool
    prefix: str

    @property
    def captures(self) -> bool:
        """True if some stream is captured for ``ctx.output()``."""
        return "capture" in self.modes.values()


def make_output_spec(stdout: object, stderr: object, tee: object, prefix: object) -> OutputSpec:
    """Check the output options of a group.

    Raises:
        ValueError: A mode is neither a known one nor a path; ``tee`` without a
            directory; a ``prefix`` template with an unknown field.
        TypeError: ``prefix`` is not a string.
    """
    modes: dict[str, str | Path] = {}
    for name, value in zip(STREAMS, (stdout, stderr), strict=True):
        if isinstance(value, str) and value in MODES:
            modes[name] = value
        elif isinstance(value, str | os.PathLike):
            modes[name] = Path(value)
        else:
            raise ValueError(
                f"{name} must be one of {', '.join(map(repr, MODES))} or a directory path,"
                f" got {value!r}"
            )
    if tee and not any(isinstance(mode, Path) for mode in modes.values()):
        raise ValueError("tee=True needs stdout or stderr to be a directory path")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str template, got {prefix!r}")
    try:
        prefix.format(rank=0, pid=0, restart=0)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"prefix may use {{rank}}, {{pid}} and {{restart}}, got {prefix!r}"
        ) from exc
    return OutputSpec(modes=modes, tee=bool(tee), prefix=prefix)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """What every rank of a group runs, and how its process is made."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nprocs: int
    start_method: str
    daemon: bool
    env: EnvSpec
    output: OutputSpec
    torchrun_env: bool = False
    heartbeats: bool = False


def make_spec(
    fn: Callable[..., Any],
    args: Sequence[Any],
    nprocs: int,
    start_method: str | None,
    daemon: bool,
    *,
    env: EnvSpec = None,
    output: OutputSpec,
    torchrun_env: bool = False,
    heartbeats: bool = False,
    check_importable: bool = True,
) -> LaunchSpec:
    """Check a group's arguments before anything starts, and resolve the start method.

    Raises:
        TypeError: ``fn`` is not callable, or cannot reach a ``spawn`` or
            ``forkserver`` child (a lambda, a local function, a function of an
            interactive ``__main__``; checked with ``check_importable`` only);
            ``args`` is not a sequence; ``env`` is
            neither a mapping nor a callable.
        ValueError: ``nprocs`` is not a positive int within :func:`max_nprocs`,
            or ``start_method`` is unknown.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {args!r}")
    if env is not None and not (isinstance(env, Mapping) or callable(env)):
        raise TypeError(f"env must be a mapping, a callable rank -> mapping, or None, got {env!r}")
    check_nprocs(nprocs)
    method = resolve_start_method(start_method)
    if check_importable and method != "fork":
        _check_importable(fn, method)
    return LaunchSpec(
        fn=fn,
        args=tuple(args),
        nprocs=nprocs,
        start_method=method,
        daemon=bool(daemon),
        env=env,
        output=output,
        torchrun_env=bool(torchrun_env),
        heartbeats=heartbeats,
    )


def resolve_start_method(start_method: str | None) -> str:
    """Return the start method to use; ``None`` means the platform default."""
    if start_method is None:
        return multiprocessing.get_context().get_start_method()
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(map(repr, START_METHODS))} or None,"
            f" got {start_method!r}"
        )
    return start_method


def max_nprocs() -> int:
    """The largest group this process can hold, from its process and file limits.

    Each rank needs one process (``RLIMIT_NPROC``) and :data:`FDS_PER_RANK`
    descriptors here (``RLIMIT_NOFILE``, 64 kept for everything else).
    """
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    limits = [
        (nofile - 64) // FDS_PER_RANK if nofile != resource.RLIM_INFINITY else sys.maxsize,
        nproc if nproc != resource.RLIM_INFINITY else sys.maxsize,
    ]
    return max(1, min(limits))


def check_nprocs(nprocs: object) -> None:
    """Raise ValueError unless ``nprocs`` is a positive int this process can hold."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    limit = max_nprocs()
    if nprocs > limit:
        raise ValueError(
            f"nprocs={nprocs} is more than this process can supervise ({limit}, from"
            " RLIMIT_NOFILE and RLIMIT_NPROC); raise the limits (ulimit -n, ulimit -u)"
            " or start fewer ranks"
        )


def check_seconds(
    name: str,
    value: object,
    *,
    allow_none: bool = True,
    allow_negative: bool = False,
    positive: bool = False,
    finite: bool = False,
) -> None:
    """Raise ValueError unless ``value`` is a number of seconds as the option ``name`` takes it.

    The one check for every option that is a number of seconds: an int or
    float, never a bool or NaN, and by default non-negative (``math.inf``
    allowed: "no limit") or ``None``. Each option states its own rule with
    the flags, and the message states that rule:
    ``grace_period must be a non-negative number of seconds or None, got -1``.

    Args:
        name: The option, as the message names it.
        value: What was passed.
        allow_none: ``None`` is allowed (it means "no limit" or "the default").
        allow_negative: Any number is allowed (``sync``'s ``timeout``, which
            torch treats as "check without waiting" when negative).
        positive: Zero is refused too.
        finite: ``math.inf`` is refused too.
    """
    if value is None and allow_none:
        return
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if number:
        assert isinstance(value, int | float)
        valid = (
            not math.isnan(value)
            and (allow_negative or (value > 0 if positive else value >= 0))
            and (not finite or math.isfinite(value))
        )
        if valid:
            return
    sign = "" if allow_negative else "positive " if positive else "non-negative "
    rule = (
        f"a {'finite ' if finite else ''}{sign}number of seconds{' or None' if allow_none else ''}"
    )
    raise ValueError(f"{name} must be {rule}, got {value!r}")


def _check_importable(fn: Callable[..., Any], method: str) -> None:
    module = getattr(fn, "__module__", None)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if module == "__main__" and main_file is None:
        raise TypeError(
            f"fn {fn!r} is defined in an interactive __main__, which a {method!r} rank"
            " cannot import; move it to a module, or use start_method='fork'"
        )
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn {fn!r} cannot be pickled, so a {method!r} rank cannot receive it ({exc});"
            " define it at the top level of a module, or use start_method='fork'"
        ) from exc
