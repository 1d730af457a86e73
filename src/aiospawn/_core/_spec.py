"""What a group is asked to run, checked before anything starts.

A :class:`LaunchSpec` is the backend-independent description of a group: the
function and arguments every rank runs, how many ranks, the start method, the
environment and where output goes. :func:`make_spec` and
:func:`make_output_spec` check the user's arguments and say what to do instead;
nothing has started when they raise. :func:`check_seconds` is the one rule
for options that are a number of seconds.

A ``spawn`` or ``forkserver`` rank receives ``fn`` and ``args`` pickled. An
object it could import goes by reference (plain pickle, as multiprocessing
does); one it could not (a lambda, a local function or class, anything
defined in an interactive ``__main__``: a notebook cell, ``python -c``, a
script read from standard input, the REPL) goes by value, with cloudpickle.
:func:`needs_value` is the one rule that tells them apart; :func:`make_spec`
applies it to ``fn`` and :func:`dumps_payload` to ``fn`` and ``args`` together.
"""

from __future__ import annotations

import collections
import functools
import io
import multiprocessing
import os
import pickle
import resource
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, ClassVar

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
    #: ``fn`` must reach the ranks by value (see :func:`needs_value`).
    fn_by_value: bool = False


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
            ``forkserver`` child even by value (checked with
            ``check_importable`` only); ``args`` is not a sequence; ``env`` is
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
    # A fork rank inherits fn as it is: nothing is pickled.
    by_value = check_importable and method != "fork" and _check_importable(fn, method)
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
        fn_by_value=by_value,
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


def check_seconds(name: str, value: object, *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``value`` is a non-negative number of seconds (or None)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number of seconds or None, got {value!r}")


def _check_importable(fn: Callable[..., Any], method: str) -> bool:
    """Decide how ``fn`` reaches a ``spawn`` or ``forkserver`` rank: True means by value.

    Raises:
        TypeError: ``fn`` cannot be pickled even by value.
    """
    try:
        _FindValues(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception:  # _NeedsValue, or plain pickle failed: cloudpickle may still send it
        pass
    else:
        return False
    import cloudpickle  # type: ignore[import-untyped]

    try:
        cloudpickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn {fn!r} cannot be pickled, even by value, so a {method!r} rank cannot"
            f" receive it ({exc}); make fn and what it refers to picklable (define it at the"
            " top level of a module), or use start_method='fork'"
        ) from exc
    return True


def interactive_main() -> bool:
    """True if ``__main__`` cannot be imported again by a ``spawn`` or ``forkserver`` rank.

    That is a notebook or IPython session, ``python -c``, the REPL (no
    ``__file__``), or a script read from standard input (``__file__`` is
    ``"<stdin>"``, not a file). A main module run with ``-m`` is imported by name.
    """
    main = sys.modules.get("__main__")
    if main is None:
        return True
    if getattr(main, "__spec__", None) is not None:
        return False
    path = getattr(main, "__file__", None)
    return path is None or not os.path.isfile(path)


def needs_value(obj: object, interactive: bool | None = None) -> bool:
    """True if a rank could not import ``obj`` (a function or class) by its name.

    Lambdas, functions and classes defined inside a function, and those of an
    interactive ``__main__``; ``interactive`` is :func:`interactive_main`,
    computed here if not given.
    """
    if not isinstance(obj, type | types.FunctionType):
        return False
    qualname = getattr(obj, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        return True
    if getattr(obj, "__module__", None) != "__main__":
        return False
    return interactive_main() if interactive is None else interactive


class _NeedsValue(Exception):
    """Raised on meeting an object that must go by value."""


class _FindValues(pickle.Pickler):
    """Plain pickle that stops at the first object :func:`needs_value` picks out.

    ``reducer_override`` sees every object but the built-in containers and
    scalars, classes and functions included, before pickle looks them up by name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._interactive = interactive_main()  # once: it looks at the file system

    def reducer_override(self, obj: object) -> Any:
        if needs_value(obj, self._interactive):
            raise _NeedsValue
        return NotImplemented


class _ByReference(_FindValues, ForkingPickler):
    """:class:`_FindValues` with multiprocessing's reducers, as ``Process.start()`` pickles.

    They pass the pipes, connections and sockets among the arguments on to the
    rank as descriptors.
    """


@functools.cache
def _by_value() -> type[pickle.Pickler]:
    import cloudpickle  # only for what plain pickle cannot send

    class ByValue(cloudpickle.Pickler):  # type: ignore[misc]
        # Set on the class: the C pickler reads it when it is made. cloudpickle's
        # reducers first, then multiprocessing's (see _ByReference).
        dispatch_table: ClassVar[Mapping[type, Any]] = collections.ChainMap(
            cloudpickle.Pickler.dispatch_table, ForkingPickler(io.BytesIO()).dispatch_table
        )

    return ByValue


def dumps_payload(
    fn: Callable[..., Any], args: tuple[Any, ...], *, by_value: bool
) -> tuple[bool, bytes]:
    """Pickle ``(fn, args)`` for a rank: by reference, or with cloudpickle if anything needs it.

    ``by_value`` skips the plain attempt (``fn`` is known to need it). Call
    it while ``Process.start()`` pickles the rank, whose reducers then pass
    descriptors. The rank unpickles either kind with plain ``pickle.loads``:
    a cloudpickle payload imports cloudpickle there, and only then.

    Returns:
        ``(by_value, data)``: whether cloudpickle was needed, and the pickle.

    Raises:
        Exception: What pickling ``fn`` or ``args`` raised, unchanged.
    """
    if not by_value:
        buffer = io.BytesIO()
        try:
            _ByReference(buffer, pickle.HIGHEST_PROTOCOL).dump((fn, args))
        except _NeedsValue:
            pass
        else:
            return False, buffer.getvalue()
    buffer = io.BytesIO()
    _by_value()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args))
    return True, buffer.getvalue()
