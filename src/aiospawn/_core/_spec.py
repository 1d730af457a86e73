"""What a group is asked to run, checked before anything starts, on any backend.

A :class:`LaunchSpec` is the backend-independent description of a group: the
function and arguments every rank runs, how many ranks, the environment,
where output goes, and the options only some backends honour (the start
method, ``preload``, ``devices``), as the caller gave them.
:func:`make_spec` and :func:`make_output_spec` check what every backend
requires of them and say what to do instead; nothing has started when they
raise. :func:`check_seconds` is the one check of options that are a number of
seconds.

What a backend can or cannot run is its own to refuse, before anything
starts: ``Backend.check(spec)`` (``_backend``), called by the entry points
after :func:`make_spec`. The local backend refuses more ranks than this
process can hold, a start method it cannot use, devices that do not fit, and
a ``fn`` no rank could receive (``aiospawn._local``); Ray refuses the options
that stay on one machine (``aiospawn.ray``).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import signal
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from pathlib import Path

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
        assert self.choose is None, "per-rank options are resolved first (for_group)"
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
    :meth:`OutputSpec.for_group`, when ``LaunchSpec.output`` is first read.

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
    """What every rank of a group runs, and what the caller asked of its backend.

    Made by :func:`make_spec`. Per-rank output options are resolved, and
    checked, when :attr:`output` is first read: by the backend's check, after
    it has refused a group too large to resolve them for, or else by the
    entry point, still before anything starts.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    nprocs: int
    #: As the caller gave it: ``"spawn"``, ``"fork"``, ``"forkserver"`` or
    #: None (the platform default). The local backend checks and uses it;
    #: a backend that makes no local processes ignores it.
    start_method: str | None
    daemon: bool
    env: EnvSpec
    #: The output options as given (per-rank ones unresolved); see :attr:`output`.
    output_options: OutputSpec
    torchrun_env: bool = False
    heartbeats: bool = False
    #: The devices to share out, as given (local processes only); None: the
    #: devices the backend sees.
    devices: Sequence[int | str] | None = None
    devices_per_rank: int | None = None
    #: Modules a warm-start template imports once, the ranks forking from it
    #: (local processes only). Empty: no template.
    preload: tuple[str, ...] = ()
    #: The event loop an ``async def fn`` runs on in its rank.
    rank_loop: str = "asyncio"
    _output: list[OutputSpec] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def output(self) -> OutputSpec:
        """Where each rank's streams go, per-rank options resolved (on first use, once).

        Raises:
            ValueError: A per-rank option gave a bad mode for some rank (see
                :meth:`OutputSpec.for_group`).
        """
        if not self._output:
            # Once: the per-rank callables are the user's, and run once per rank.
            self._output.append(self.output_options.for_group(self.nprocs))
        return self._output[0]


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
    devices_per_rank: int | None = None,
    devices: Sequence[int | str] | None = None,
    rank_loop: object = "asyncio",
) -> LaunchSpec:
    """Check what every backend requires of a group's arguments, before anything starts.

    The backend's own refusals come next (``Backend.check``).

    Raises:
        TypeError: ``fn`` is not callable, or is a generator or async
            generator function; ``args`` is not a sequence; ``env`` is
            neither a mapping nor a callable; ``preload`` is not a list of
            module names.
        ValueError: ``nprocs`` is not a positive int; ``env`` holds a name or
            value no environment can (see :func:`check_environment`);
            ``devices_per_rank`` is not a non-negative int; ``devices`` is not
            a sequence; a ``preload`` name is not a module name; ``rank_loop``
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
    check_devices_per_rank(devices_per_rank)
    if devices is not None and (
        isinstance(devices, str | bytes) or not isinstance(devices, Sequence)
    ):
        raise ValueError(f"devices must be a sequence of device ids, got {devices!r}")
    return LaunchSpec(
        fn=fn,
        args=tuple(args),
        nprocs=nprocs,
        start_method=start_method,
        daemon=bool(daemon),
        env=env,
        output_options=output,
        torchrun_env=bool(torchrun_env),
        heartbeats=heartbeats,
        devices=devices,
        devices_per_rank=devices_per_rank,
        preload=check_preload(preload),
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


def check_preload(preload: object) -> tuple[str, ...]:
    """Check the ``preload`` option; return the module names, in order, without repeats.

    Raises:
        TypeError: ``preload`` is not a list (or tuple) of module names.
        ValueError: A name is not a dotted module name.
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
    return tuple(names)


def check_nprocs(nprocs: object) -> None:
    """Raise ValueError unless ``nprocs`` is a positive int.

    How many ranks a backend can hold is its own check (the local backend's:
    this process's descriptor and process limits).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")


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


#: The signals no process can catch, block or ignore: nothing there can act on them.
UNCATCHABLE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSTOP})


def check_signal(signum: object) -> None:
    """Raise unless ``signum`` is a signal the ranks could act on (``send_signal()``'s argument).

    Raises:
        TypeError: ``signum`` is not an ``int`` (a ``bool`` is refused).
        ValueError: ``signum`` is not a signal of this platform, or is one
            of :data:`UNCATCHABLE_SIGNALS`.
    """
    if isinstance(signum, bool) or not isinstance(signum, int):
        raise TypeError(f"signum must be a signal number (signal.SIGUSR1), got {signum!r}")
    if signum not in signal.valid_signals():
        raise ValueError(f"{signum!r} is not a signal number here; see signal.valid_signals()")
    if signum in UNCATCHABLE_SIGNALS:
        raise ValueError(
            f"send_signal() passes on signals the ranks can act on, not"
            f" {signal.Signals(signum).name}; to stop the ranks, use terminate()"
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
