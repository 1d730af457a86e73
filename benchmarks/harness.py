"""What every scenario shares: peers run in alternation, samples, stamps, statistics.

A scenario measures one *case* (say ``spawn, N=8``) by running its peers in
alternation (A B C A B C ...), so that a drift of the machine's load touches
every peer alike. Each run of a peer returns ``{metric: value}``; the metric
name carries its unit in brackets (``"all running [ms]"``). The samples of a
scenario travel to the report as plain JSON.
"""

from __future__ import annotations

import gc
import inspect
import math
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

#: Stamps go to a tmpfs when there is one, so writing them costs no disk I/O.
STAMP_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else None

#: Seconds to wait for every rank's entry stamp before giving up.
STAMP_TIMEOUT = 300.0

#: Resident memory one rank that imports torch needs (measured: about 280 MB).
TORCH_RANK_BYTES = 400 * 1024 * 1024

Measure = dict[str, float]
PeerRun = Callable[[], Awaitable[Measure]] | Callable[[], Measure]


@dataclass
class Series:
    """The samples of one metric for one peer in one case of a scenario."""

    scenario: str
    case: str
    metric: str
    peer: str
    samples: list[float]

    @property
    def unit(self) -> str:
        """The unit written in brackets at the end of the metric name."""
        return self.metric.rpartition("[")[2].rstrip("]") if "[" in self.metric else ""

    @property
    def median(self) -> float:
        """The median sample."""
        return percentile(self.samples, 50)

    @property
    def p95(self) -> float:
        """The 95th percentile (linear interpolation between samples)."""
        return percentile(self.samples, 95)


@dataclass
class ScenarioResult:
    """What a scenario hands to the report."""

    name: str
    title: str
    series: list[Series] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seconds: float = 0.0
    skipped: str | None = None
    #: case -> the peer whose median the report divides by ("ratio to floor"), if any.
    floors: dict[str, str] = field(default_factory=dict)
    #: The directory of the ``aiospawn`` package the scenario ran (which checkout).
    library: str = ""

    def add(self, case: str, peer: str, measure: Measure) -> None:
        """Append one run's measure to the series of ``case`` and ``peer``."""
        for metric, value in measure.items():
            for series in self.series:
                if (series.case, series.metric, series.peer) == (case, metric, peer):
                    series.samples.append(value)
                    break
            else:
                self.series.append(Series(self.name, case, metric, peer, [value]))

    def note(self, text: str) -> None:
        """Add a sentence that the report prints under the scenario's table."""
        if text not in self.notes:
            self.notes.append(text)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ScenarioResult:
        """The inverse of :meth:`to_json`."""
        series = [Series(**item) for item in data.pop("series")]
        data["load_before"] = tuple(data["load_before"])
        data["load_after"] = tuple(data["load_after"])
        return cls(series=series, **data)


class Skipped(Exception):
    """Raised by a scenario that cannot run on this machine; the report gives the reason."""


@dataclass
class Peer:
    """One contender in a case: how to run it once, and how many times."""

    name: str
    run: PeerRun
    trials: int
    warmup: int = 0


async def alternate(
    result: ScenarioResult, case: str, peers: list[Peer], *, rotate: bool = False
) -> None:
    """Run ``peers`` in alternation, ``peer.trials`` times each, and record their measures.

    Warm-up runs (their results discarded) come first, one peer after the
    other. A peer with fewer trials drops out of the later rounds. With
    ``rotate``, each round starts one peer later than the one before (A B C,
    B C A, C A B), so that no peer always runs right after the same one. Blocking
    peers run right here, on the event-loop thread: nothing else runs on the
    loop meanwhile, so it is as if they ran in a plain thread.
    """
    for peer in peers:
        for _ in range(peer.warmup):
            await call(peer.run)
            progress(f"[{result.name}] {case} | {peer.name}: warm-up done")
    for index in range(max(peer.trials for peer in peers)):
        shift = index % len(peers) if rotate else 0
        for peer in peers[shift:] + peers[:shift]:
            if index >= peer.trials:
                continue
            gc.collect()
            measure = await call(peer.run)
            result.add(case, peer.name, measure)
            shown = ", ".join(f"{key} {value:.4g}" for key, value in measure.items())
            progress(f"[{result.name}] {case} | {peer.name} {index + 1}/{peer.trials}: {shown}")


async def call(run: PeerRun) -> Measure:
    """Run a peer once, awaiting it if it is async."""
    if inspect.iscoroutinefunction(run):
        return await run()
    value = run()
    assert isinstance(value, dict)
    return value


def progress(text: str) -> None:
    """Progress goes to stderr; stdout is for the table."""
    print(text, file=sys.stderr, flush=True)


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile of ``samples``, interpolated as numpy's default does."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ms(seconds: float) -> float:
    """Seconds to milliseconds."""
    return seconds * 1000.0


def start_plain(
    method: str, target: Callable[..., object], nprocs: int, *args: object
) -> list[Any]:
    """Start ``nprocs`` plain ``multiprocessing`` processes running ``target(rank, *args)``.

    The peer without a supervisor: every ``Process`` is made, then each is
    started in turn; nothing watches them.
    """
    context = multiprocessing.get_context(method)
    processes = [context.Process(target=target, args=(rank, *args)) for rank in range(nprocs)]
    for process in processes:
        process.start()
    return processes


def stop_plain(processes: list[Any]) -> None:
    """SIGTERM every process, then join each: the teardown of a peer without one."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()


@contextmanager
def stamp_dir() -> Iterator[str]:
    """A fresh directory for the ranks' entry stamps, removed afterwards."""
    path = tempfile.mkdtemp(prefix="aiospawn-bench-", dir=STAMP_ROOT)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def count_stamps(path: str) -> int:
    """How many ranks have recorded their entry in ``path``."""
    return sum(1 for name in os.listdir(path) if name.isdigit())


def read_stamps(path: str, nprocs: int) -> list[float]:
    """The entry times of ranks 0..nprocs-1, as recorded in ``path``."""
    stamps = []
    for rank in range(nprocs):
        with open(os.path.join(path, str(rank))) as file:
            stamps.append(float(file.read()))
    return stamps


def read_stamp(path: str, name: str) -> float:
    """A single stamp, such as the failing rank's exit time."""
    with open(os.path.join(path, name)) as file:
        return float(file.read())


async def wait_stamps(path: str, nprocs: int) -> None:
    """Wait, on the event loop, until every rank has recorded its entry."""
    with anyio.fail_after(STAMP_TIMEOUT):
        # A file appearing announces itself through no event: poll, every 5 ms.
        while count_stamps(path) < nprocs:  # noqa: ASYNC110
            await anyio.sleep(0.005)


def wait_stamps_blocking(path: str, nprocs: int) -> None:
    """Wait, blocking the calling thread, until every rank has recorded its entry."""
    deadline = time.monotonic() + STAMP_TIMEOUT
    while count_stamps(path) < nprocs:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {count_stamps(path)} of {nprocs} ranks started")
        time.sleep(0.005)


def cpu_seconds() -> float:
    """User plus system CPU time of this process, all its threads, dead ones included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def context_switches() -> int:
    """Voluntary plus involuntary context switches of this process's threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def available_memory() -> int:
    """Bytes of memory available for new processes (MemAvailable)."""
    with open("/proc/meminfo") as file:
        for line in file:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def torch_ranks_fit(nprocs: int) -> bool:
    """True if ``nprocs`` ranks that import torch fit in 70 % of the available memory."""
    return nprocs * TORCH_RANK_BYTES < 0.7 * available_memory()


def import_torch_mp() -> Any:
    """Import ``torch.multiprocessing`` (about 1.3 s) before any timing starts."""
    started = time.monotonic()
    import torch.multiprocessing

    progress(f"imported torch.multiprocessing in {time.monotonic() - started:.2f} s")
    return torch.multiprocessing


@contextmanager
def environ(name: str, value: str | None) -> Iterator[None]:
    """Set (or with ``None``, unset) an environment variable for the duration of a block."""
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


class UsageSampler:
    """Reads this process's CPU time and context switches at two instants, from a thread.

    The supervisor under test is never woken by the measurement: the sampler's
    own thread sleeps until each instant (two wake-ups, a few microseconds of
    CPU, counted in the figures).
    """

    def __init__(self) -> None:
        self._samples: list[tuple[float, float, int]] = []
        self._thread: threading.Thread | None = None

    def arm(self, start_at: float, end_at: float) -> None:
        """Sample at ``time.monotonic()`` instants ``start_at`` and ``end_at``."""
        self._thread = threading.Thread(target=self._run, args=(start_at, end_at), daemon=True)
        self._thread.start()

    def _run(self, start_at: float, end_at: float) -> None:
        for instant in (start_at, end_at):
            time.sleep(max(0.0, instant - time.monotonic()))
            self._samples.append((time.monotonic(), cpu_seconds(), context_switches()))

    def result(self) -> tuple[float, float, int]:
        """Wall seconds, CPU seconds and context switches between the two instants."""
        assert self._thread is not None
        self._thread.join()
        (wall0, cpu0, switches0), (wall1, cpu1, switches1) = self._samples
        return wall1 - wall0, cpu1 - cpu0, switches1 - switches0


#: glibc's malloc, held steady in every process of the scenario (``run.py`` sets
#: these for it). By default glibc serves a request of 128 KiB or more with a
#: fresh ``mmap``, and raises that threshold only once it frees such a block:
#: until then, a peer that allocates a large buffer per read (asyncio's streams
#: receive into a new 256 KiB object each time) pays an ``mmap``, page faults
#: and a ``munmap`` per message. Whether a process has raised its threshold
#: depends on what it did before, so the same floor measured 40 µs in one run
#: and 69 µs in another (64 B), and 0.6 against 1.7 ms (1 MB). Fixed, as a
#: long-running service's allocator settles, every peer is measured in that
#: settled state.
STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(128 * 1024 * 1024),
}


def hold_malloc_steady() -> None:
    """Run this script again with :data:`STEADY_MALLOC` set, unless it is set already."""
    if not STEADY_MALLOC.keys() <= os.environ.keys():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**STEADY_MALLOC, **os.environ})


def trial_environment(src: str | None = None) -> dict[str, str]:
    """The environment of a trial in a fresh interpreter started from ``benchmarks/``.

    ``src`` (a checkout's ``src``) first on ``PYTHONPATH``, then this
    directory; bytecode written and kept apart (``.cache/pycache``), so that
    no trial pays for compiling the modules it imports.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.path.join(here, ".cache", "pycache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, here, env.get("PYTHONPATH")]))
    return env


def run_trial(
    program: str,
    *args: str,
    src: str | None = None,
    prefix: Sequence[str] = (),
    timeout: float = 600,
) -> Any:
    """A fresh interpreter runs ``program`` (``python -c``) with ``args``; its last line, as JSON.

    In :func:`trial_environment` (``src`` first on ``PYTHONPATH``), from this
    directory; ``prefix`` goes before the interpreter (``nice -n 10``). With
    ``src``, the trial's JSON object names the aiospawn it imported
    (``"file"``: ``aiospawn.__file__``), which must be the checkout's.

    Raises:
        RuntimeError: The trial failed (its stderr is in the message), or
            imported another aiospawn than ``src``'s.
    """
    import json
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [*prefix, sys.executable, "-c", program, *args],
        cwd=here,
        env=trial_environment(src),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"trial {' '.join(args)} failed:\n{done.stderr}")
    result = json.loads(done.stdout.splitlines()[-1])
    if src is not None and not str(result["file"]).startswith(os.path.abspath(src)):
        raise RuntimeError(f"trial imported {result['file']}, not the checkout {src}")
    return result
