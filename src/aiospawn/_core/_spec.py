"""What a group is asked to run, checked before anything starts.

A :class:`LaunchSpec` is the backend-independent description of a group: the
function and arguments every rank runs, how many ranks, the start method, the
environment and where output goes. :func:`make_spec` and
:func:`make_output_spec` check the user's arguments and say what to do instead;
nothing has started when they raise. :func:`check_seconds` is the one rule
for options that are a number of seconds.
"""

from __future__ import annotations

import inspect
import multiprocessing
import multiprocessing.process
import os
import pickle
import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_METHODS = ("spawn", "fork", "forkserver")

#: Descriptors the supervisor holds for a rank whatever its options: the two
#: ends of its result pipe until it starts, then the read end, the two ends of
#: ``multiprocessing``'s sentinel pipe and a pidfd.
FDS_PER_RANK = 4

#: What each stream mode adds: a pipe (both ends until the rank starts); a
#: directory adds the file, and with ``tee`` a pipe too.
_STREAM_FDS = {"inherit": 0, "devnull": 0, "prefix": 2, "capture": 2}

#: What heartbeats add: the memory file, the duplicate its mapping holds, and
#: the stack pipe's two ends.
_HEARTBEAT_FDS = 4

#: Kept for everything else the process holds, and for starts under way
#: (``multiprocessing`` opens a few descriptors while it starts a process).
_RESERVED_FDS = 64 + 32


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
        TypeError: ``fn`` is not callable, is a generator or async generator
            function, or cannot reach a ``spawn`` or ``forkserver`` child (a
            lambda, a local function, a function of an interactive
            ``__main__``; checked with ``check_importable`` only); ``args`` is
            not a sequence; ``env`` is neither a mapping nor a callable.
        ValueError: ``nprocs`` is not a positive int within :func:`max_nprocs`
            for these options; ``start_method`` is unknown; ``env`` holds a
            name or value no environment can (see :func:`check_environment`);
            the main module was not read from a file and the start method is
            ``spawn`` or ``forkserver`` (checked with ``check_importable`` only).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of positional arguments, got {args!r}")
    if env is not None and not (isinstance(env, Mapping) or callable(env)):
        raise TypeError(f"env must be a mapping, a callable rank -> mapping, or None, got {env!r}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"fn {fn!r} is a generator function: calling it runs none of its body, and a"
            " generator cannot be sent back; make fn a plain function that returns a value"
            " (a list, say)"
        )
    if isinstance(env, Mapping):
        check_environment(env, "env")
    check_nprocs(nprocs, fds_per_rank(output, heartbeats))
    method = resolve_start_method(start_method)
    if check_importable and method != "fork":
        _check_main_module(method)
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


def fds_per_rank(output: OutputSpec | None = None, heartbeats: bool = False) -> int:
    """The most descriptors the supervisor holds for one rank with these options."""
    count = FDS_PER_RANK + (_HEARTBEAT_FDS if heartbeats else 0)
    if output is not None:
        for mode in output.modes.values():
            if isinstance(mode, Path):
                count += 3 if output.tee else 1
            else:
                count += _STREAM_FDS[mode]
    return count


def max_nprocs(output: OutputSpec | None = None, heartbeats: bool = False) -> int:
    """The largest group this process can hold, from its process and file limits.

    Each rank needs one process (``RLIMIT_NPROC``) and :func:`fds_per_rank`
    descriptors here (``RLIMIT_NOFILE``, less a reserve for everything else).
    """
    return _limit(fds_per_rank(output, heartbeats))


def _limit(fds: int) -> int:
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    limits = [
        (nofile - _RESERVED_FDS) // fds if nofile != resource.RLIM_INFINITY else sys.maxsize,
        nproc if nproc != resource.RLIM_INFINITY else sys.maxsize,
    ]
    return max(1, min(limits))


def check_nprocs(nprocs: object, fds: int = FDS_PER_RANK) -> None:
    """Raise ValueError unless ``nprocs`` is a positive int this process can hold.

    ``fds`` is what one rank needs (:func:`fds_per_rank`).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    limit = _limit(fds)
    if nprocs > limit:
        raise ValueError(
            f"nprocs={nprocs} is more than this process can supervise ({limit}, from"
            f" RLIMIT_NOFILE and RLIMIT_NPROC, at {fds} descriptors per rank with these"
            " output and heartbeat options); raise the limits (ulimit -n, ulimit -u)"
            " or start fewer ranks"
        )


def check_environment(env: Mapping[Any, Any], source: str) -> None:
    """Raise ValueError unless every item of ``env`` can be an environment variable.

    Names and values are taken as ``str()`` of what is given, as a rank sets them.
    ``source`` names the mapping in the message (``"env"``, ``"env(3)"``).
    """
    for key, value in env.items():
        name, text = str(key), str(value)
        if not name:
            raise ValueError(f"{source} has an empty variable name (value {text!r})")
        if "=" in name or "\0" in name:
            bad = "'='" if "=" in name else "a NUL character"
            raise ValueError(f"{source} has the variable name {name!r}, which holds {bad}")
        if "\0" in text:
            raise ValueError(
                f"{source}[{name!r}] holds a NUL character, which no environment value can:"
                f" {text!r}"
            )


def check_seconds(name: str, value: object, *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``value`` is a non-negative number of seconds (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number of seconds or None, got {value!r}")


def _check_main_module(method: str) -> None:
    # A spawn or forkserver rank runs the main script again as __mp_main__,
    # found by its __file__ (multiprocessing.spawn's preparation data), whatever
    # fn is; a script read from standard input has the file name '<stdin>'.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return  # python -m: found by module name
    main_file = getattr(main, "__file__", None)
    if not isinstance(main_file, str):
        return  # interactive: nothing is imported again
    path = main_file
    original_dir = getattr(multiprocessing.process, "ORIGINAL_DIR", None)
    if not os.path.isabs(path) and original_dir is not None:
        path = os.path.join(original_dir, path)
    if not os.path.isfile(path):
        raise ValueError(
            f"the main module's file {main_file!r} is not a file (a script read from"
            f" standard input?), and each {method!r} rank imports the main module from its"
            " file; run the script from a file, put fn in a module, or use"
            " start_method='fork'"
        )


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
