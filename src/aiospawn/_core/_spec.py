"""What a group is asked to run, checked before anything starts.

(About 650 lines, one idea: every check of a group's arguments, made before
anything starts, with the decision of how ``fn`` reaches a rank, so that the
entry points and both backends share one set of rules and messages.)

A :class:`LaunchSpec` is the backend-independent description of a group: the
function and arguments every rank runs, how many ranks, the start method, the
environment and where output goes. :func:`make_spec` and
:func:`make_output_spec` check the user's arguments and say what to do instead;
nothing has started when they raise. :func:`check_seconds` is the one check
of options that are a number of seconds.

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
import importlib.util
import inspect
import io
import math
import multiprocessing
import multiprocessing.process
import os
import pickle
import resource
import sys
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

if TYPE_CHECKING:
    from pathlib import Path

START_METHODS = ("spawn", "fork", "forkserver")

#: Descriptors the supervisor holds for a rank whatever its options: the two
#: ends of its result pipe and of its channel's socket pair until it starts,
#: then the result pipe's read end, our end of the channel, the two ends of
#: ``multiprocessing``'s sentinel pipe and a pidfd.
FDS_PER_RANK = 6

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


#: A stream's mode: one of :data:`MODES`, or a directory path.
Mode: TypeAlias = "str | Path"


def is_directory(mode: Mode) -> bool:
    """True if ``mode`` is a directory path (a ``Path``), not one of :data:`MODES`.

    (``pathlib`` is imported only when a directory is given: about 5 ms of a
    first call otherwise.)
    """
    return not isinstance(mode, str)


#: What a rank's streams become: ``(modes, teed)``, ``modes`` mapping each
#: stream to its mode, ``teed`` the streams also copied to the supervisor's.
RankStreams = tuple[dict[str, Mode], frozenset[str]]


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputSpec:
    """Where a group's streams go, for every rank.

    Attributes:
        modes: Stream name to mode or directory, when it is the same for every
            rank (for a per-rank option: rank 0's).
        tee: True if some stream of some rank is teed.
        prefix: The line prefix template.
        ranks: One :data:`RankStreams` per rank, once :meth:`for_group` has
            resolved per-rank options; empty before.
    """

    modes: dict[str, Mode]
    tee: bool
    prefix: str
    ranks: tuple[RankStreams, ...] = ()
    choose: Callable[[int], RankStreams] | None = None

    @property
    def captures(self) -> bool:
        """True if some stream of some rank is captured for ``ctx.output()``."""
        if self.ranks:
            return any("capture" in modes.values() for modes, _ in self.ranks)
        return "capture" in self.modes.values()

    def for_rank(self, rank: int) -> RankStreams:
        """The modes and teed streams of ``rank``."""
        if self.ranks:
            return self.ranks[rank]
        teed = {name for name, mode in self.modes.items() if self.tee and is_directory(mode)}
        return dict(self.modes), frozenset(teed)

    def for_group(self, nprocs: int) -> OutputSpec:
        """Resolve per-rank options for ranks ``0..nprocs-1``; ValueError if one is bad."""
        if self.choose is None:
            return self
        ranks = tuple(self.choose(rank) for rank in range(nprocs))
        return OutputSpec(
            modes=ranks[0][0],
            tee=any(teed for _, teed in ranks),
            prefix=self.prefix,
            ranks=ranks,
        )


def _check_mode(name: str, value: object) -> Mode:
    if isinstance(value, str) and value in MODES:
        return value
    if isinstance(value, str | os.PathLike):
        from pathlib import Path

        return Path(value)
    raise ValueError(
        f"{name} must be one of {', '.join(map(repr, MODES))} or a directory path, got {value!r}"
    )


def _rank_streams(stdout: object, stderr: object, tee: object, rank: int | None) -> RankStreams:
    """Check one rank's output options (``rank`` None: the same for every rank)."""
    where = "" if rank is None else f" for rank {rank}"
    modes: dict[str, Mode] = {}
    for name, value in zip(STREAMS, (stdout, stderr), strict=True):
        if rank is not None and callable(value):
            value = value(rank)
        modes[name] = _check_mode(name + where, value)
    if rank is not None and callable(tee):
        tee = tee(rank)
    if isinstance(tee, str):
        tee = (tee,)
    if isinstance(tee, bool) or tee is None:
        asked = set(STREAMS) if tee else set()
        strict = bool(tee)
    elif isinstance(tee, Collection) and set(tee) <= set(STREAMS):
        asked = set(tee)
        strict = True
    else:
        raise ValueError(f"tee{where} must be a bool or a collection of stream names, got {tee!r}")
    teed = {name for name in asked if is_directory(modes[name])}
    if strict and asked and not teed and rank is None:
        raise ValueError("tee=True needs stdout or stderr to be a directory path")
    if rank is not None and asked - teed and not isinstance(tee, bool):
        raise ValueError(
            f"tee{where} names {', '.join(sorted(asked - teed))}, which is not a directory path"
        )
    return modes, frozenset(teed)


def make_output_spec(stdout: object, stderr: object, tee: object, prefix: object) -> OutputSpec:
    """Check the output options of a group.

    ``stdout`` and ``stderr`` may be callables ``rank -> mode`` and ``tee`` a
    callable ``rank -> bool | streams``; those are checked per rank by
    :meth:`OutputSpec.for_group`, which :func:`make_spec` calls.

    Raises:
        ValueError: A mode is neither a known one nor a path; ``tee`` without a
            directory; a ``prefix`` template with an unknown field.
        TypeError: ``prefix`` is not a string.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str template, got {prefix!r}")
    try:
        prefix.format(rank=0, pid=0, restart=0)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"prefix may use {{rank}}, {{pid}} and {{restart}}, got {prefix!r}"
        ) from exc
    if any(callable(option) for option in (stdout, stderr, tee)):

        def choose(rank: int) -> RankStreams:
            return _rank_streams(stdout, stderr, tee, rank)

        return OutputSpec(modes={}, tee=False, prefix=prefix, choose=choose)
    modes, teed = _rank_streams(stdout, stderr, tee, None)
    return OutputSpec(modes=modes, tee=bool(teed), prefix=prefix)


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
    devices: tuple[tuple[str, ...], ...] | None = None
    devices_per_rank: int | None = None
    #: ``fn`` must reach the ranks by value (see :func:`needs_value`).
    fn_by_value: bool = False
    #: Modules a warm-start template imports once; the ranks fork from it.
    #: Empty: ranks start with ``start_method``.
    preload: tuple[str, ...] = ()
    #: The event loop an ``async def fn`` runs on in its rank.
    rank_loop: str = "asyncio"


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
    devices_per_rank: int | None = None,
    devices: Sequence[int | str] | None = None,
    local_devices: bool = True,
    rank_loop: object = "asyncio",
) -> LaunchSpec:
    """Check a group's arguments before anything starts, and resolve the start method.

    Raises:
        TypeError: ``fn`` is not callable, is a generator or async generator
            function, or cannot reach a ``spawn`` or ``forkserver`` child even
            by value (checked with ``check_importable`` only); ``args`` is not
            a sequence; ``env`` is neither a mapping nor a callable.
        ValueError: ``nprocs`` is not a positive int within :func:`max_nprocs`
            for these options; ``start_method`` is unknown; ``env`` holds a
            name or value no environment can (see :func:`check_environment`);
            a rank's output option is bad, or the devices asked for do not fit
            (see :func:`assign_devices`).
            ``preload`` is bad (see :func:`check_preload`); ``rank_loop``
            is unknown or not installed.
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
    check_rank_loop(rank_loop)
    check_nprocs(nprocs)
    method = resolve_start_method(start_method)
    output = output.for_group(nprocs)
    check_nprocs(nprocs, fds_per_rank(output, heartbeats))
    check_devices_per_rank(devices_per_rank)
    if local_devices:
        assigned = assign_devices(nprocs, devices_per_rank, devices)
    elif devices is not None:
        raise ValueError(
            f"devices={devices!r} names devices of this machine; on this backend ask for"
            " devices_per_rank=N instead, and each rank gets N of its node's"
        )
    else:
        assigned = None
    # A fork rank inherits fn as it is: nothing is pickled.
    modules = check_preload(preload, start_method)
    if modules and start_method is None:
        # The platform's default may be fork, which has nothing to preload; a
        # warm rank comes from a spawned template, the spawn way.
        method = "spawn"
    # A warm rank receives fn as a forkserver rank does: pickled.
    by_value = (
        check_importable
        and (method != "fork" or bool(modules))
        and _check_importable(fn, "forkserver" if modules else method)
    )
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
        devices=assigned,
        devices_per_rank=devices_per_rank,
        fn_by_value=by_value,
        preload=modules,
        rank_loop=str(rank_loop),
    )


RANK_LOOPS = ("asyncio", "trio", "uvloop")


def check_rank_loop(rank_loop: object) -> None:
    """Raise ValueError unless ``rank_loop`` names an event loop installed here."""
    if rank_loop not in RANK_LOOPS:
        raise ValueError(
            f"rank_loop must be one of {', '.join(map(repr, RANK_LOOPS))}, got {rank_loop!r}"
        )
    if rank_loop != "asyncio" and importlib.util.find_spec(str(rank_loop)) is None:
        raise ValueError(f"rank_loop={rank_loop!r}: {rank_loop} is not installed")


def check_devices_per_rank(value: object) -> None:
    """Raise ValueError unless ``value`` is None or a non-negative int."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"devices_per_rank must be a non-negative int or None, got {value!r}")


def assign_devices(
    nprocs: int, per_rank: int | None, devices: Sequence[int | str] | None
) -> tuple[tuple[str, ...], ...] | None:
    """Give each rank its own devices: rank ``r`` the ``r``-th run of ``per_rank`` of them.

    ``devices`` is the pool, by default the devices visible here (see
    :func:`~aiospawn._core._env.visible_devices`); without ``per_rank`` the pool
    is split evenly. ``None`` when neither is given: the ranks see what we see.

    Raises:
        ValueError: The pool has fewer than ``nprocs * per_rank`` devices, or
            does not split evenly over the ranks, or names a device twice.
    """
    check_devices_per_rank(per_rank)
    if per_rank is None and devices is None:
        return None
    if devices is None:
        from ._env import visible_devices

        pool, where = visible_devices(), "visible (CUDA_VISIBLE_DEVICES, or the NVIDIA driver)"
    else:
        if isinstance(devices, str | bytes) or not isinstance(devices, Sequence):
            raise ValueError(f"devices must be a sequence of device ids, got {devices!r}")
        pool, where = [str(device).strip() for device in devices], "given"
        if any(not device or "," in device for device in pool):
            raise ValueError(f"devices must be device ids such as 0 or 'GPU-...', got {devices!r}")
        if len(set(pool)) != len(pool):
            raise ValueError(f"devices names a device twice: {devices!r}")
    if per_rank is None:
        per_rank, left = divmod(len(pool), nprocs)
        if per_rank == 0 or left:
            raise ValueError(
                f"{len(pool)} devices do not split evenly over {nprocs} ranks ({pool!r});"
                " say how many each rank gets with devices_per_rank"
            )
    needed = nprocs * per_rank
    if needed > len(pool):
        raise ValueError(
            f"{nprocs} ranks of {per_rank} device{'s' if per_rank != 1 else ''} each need"
            f" {needed}, but {len(pool)} {'is' if len(pool) == 1 else 'are'} {where}"
            f" ({','.join(pool) or 'none'}); start fewer ranks, give each fewer devices,"
            " or name the devices to use"
        )
    return tuple(tuple(pool[rank * per_rank : (rank + 1) * per_rank]) for rank in range(nprocs))


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


def fds_per_rank(output: OutputSpec | None = None, heartbeats: bool = False) -> int:
    """The most descriptors the supervisor holds for one rank with these options."""
    count = FDS_PER_RANK + (_HEARTBEAT_FDS if heartbeats else 0)
    if output is None:
        return count
    # The busiest rank counts: with per-rank modes the ranks differ.
    ranks = output.ranks or (output.for_rank(0),)
    return count + max(
        sum(
            _STREAM_FDS[mode] if isinstance(mode, str) else (3 if name in teed else 1)
            for name, mode in modes.items()
        )
        for modes, teed in ranks
    )


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
