"""What a group is asked to run, checked before anything starts.

A :class:`LaunchSpec` is the backend-independent description of a group: the
function and arguments every rank runs, how many ranks, the start method, the
environment and where output goes. :func:`make_spec` and
:func:`make_output_spec` check the user's arguments and say what to do instead;
nothing has started when they raise. :func:`check_seconds` is the one rule
for options that are a number of seconds.
"""

from __future__ import annotations

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
    #: Modules a warm-start template imports once; the ranks fork from it.
    #: Empty: ranks start with ``start_method``.
    preload: tuple[str, ...] = ()


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
    preload: object = None,
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
            or ``start_method`` is unknown; ``preload`` (see :func:`check_preload`).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {args!r}")
    if env is not None and not (isinstance(env, Mapping) or callable(env)):
        raise TypeError(f"env must be a mapping, a callable rank -> mapping, or None, got {env!r}")
    check_nprocs(nprocs)
    method = resolve_start_method(start_method)
    modules = check_preload(preload, start_method)
    if check_importable and (method != "fork" or modules):
        # A warm rank receives fn as a forkserver rank does: pickled.
        _check_importable(fn, "forkserver" if modules else method)
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
        preload=modules,
    )


def check_preload(preload: object, start_method: str | None) -> tuple[str, ...]:
    """Check the ``preload`` option; return the module names, in order, without repeats.

    Warm starts fork each rank from a template spawned for the purpose, so
    they go with ``spawn`` (the default), ``forkserver`` or ``None``; under
    ``fork`` the ranks are copies of the supervisor and have nothing to preload.

    Raises:
        TypeError: ``preload`` is not a list (or tuple) of module names.
        ValueError: A name is not a dotted module name, or ``start_method`` is ``"fork"``.
    """
    if preload is None:
        return ()
    if isinstance(preload, str | bytes) or not isinstance(preload, Sequence):
        raise TypeError(f"preload must be a list of module names, got {preload!r}")
    names: list[str] = []
    for name in preload:
        if not isinstance(name, str):
            raise TypeError(f"preload must be a list of module names, got {preload!r}")
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"preload names modules, like 'torch' or 'pkg.model'; got {name!r}")
        if name not in names:
            names.append(name)
    if names and start_method == "fork":
        raise ValueError(
            "preload= forks ranks from a spawned template; start_method='fork' copies"
            " the supervisor instead: use start_method='spawn' (or 'forkserver') with preload"
        )
    return tuple(names)


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


def check_seconds(name: str, value: object, *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``value`` is a non-negative number of seconds (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number of seconds or None, got {value!r}")


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
