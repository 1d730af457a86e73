"""Rank functions for the tests: importable, so that spawn and forkserver ranks reach them.

Each is called as ``fn(rank, *args)``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from typing import Any


def identity(rank: int, value: Any = None) -> Any:
    return value


def rank_times(rank: int, factor: int) -> int:
    return rank * factor


def sleep_forever(rank: int) -> None:
    """Wait until a signal stops this rank: its default action, or its handler raising.

    Not ``time.sleep()``: a signal that lands after the interpreter's last
    check for signals and before the sleep's system call begins has its
    Python handler run only when the sleep ends (seen in CI: SIGINT sent right
    after a rank reported ready, and no ``KeyboardInterrupt`` before the
    test's tripwire). The wait is on Python's wakeup fd instead (see
    :func:`wakeup_pipe`).
    """
    wait_for_signals(wakeup_pipe())


def wakeup_pipe() -> int:
    """Make a pipe Python's wakeup fd; return its read end, for :func:`wait_for_signals`.

    A signal from then on leaves a byte in the pipe, so the wait returns and
    the handler runs. The byte written here sends the wait once round its
    loop's back edge first, where a handler already due runs (a signal that
    landed before the fd was installed). A rank that reports it is ready and
    then waits makes the pipe before its report: the signal a test sends on
    the report then finds it, and what the rank holds is the same whenever
    the test looks.
    """
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    os.write(woken, b"\0")
    return wake


def wait_for_signals(wake: int) -> None:
    """Wait on the read end of :func:`wakeup_pipe` until a signal ends the process."""
    while True:
        select.select([wake], [], [])
        os.read(wake, 4096)


def raise_in(rank: int, failing: int) -> None:
    if rank == failing:
        raise ValueError(f"legitimate exception from process {rank}")
    sleep_forever(rank)


def exit_with(rank: int, code: Any) -> None:
    sys.exit(code)


def hard_exit(rank: int, code: int) -> None:
    os._exit(code)


def kill_self(rank: int, signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(60)


def ignore_sigterm(rank: int, ready: Any = None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ready is not None:
        ready.put(rank)
    sleep_forever(rank)


def report_ready(rank: int, ready: Any) -> None:
    """Tell the test this rank is running, then wait until a signal stops it."""
    wake = wakeup_pipe()
    ready.put((rank, os.getpid()))
    wait_for_signals(wake)


# Ranks for test_api, test_context, test_shutdown and test_asyncio_native (prefix api_).
# ``events`` is the write end of a multiprocessing Pipe the test reads; ``release``
# and ``failed`` are multiprocessing Events of the group's start method.


def api_wait_for(rank: int, release: Any, factor: int = 1) -> int:
    """Return ``rank * factor`` once the test sets ``release``."""
    release.wait()
    return rank * factor


def api_record_sigterm(rank: int, events: Any, ignore_sigterm: bool = False) -> None:
    """Send ``("ready", rank, pid)``, then sleep; send ``("SIGTERM", rank)`` on each SIGTERM.

    After reporting a SIGTERM the rank dies of it, as it would have without
    a handler, or with ``ignore_sigterm`` keeps sleeping.
    """

    def on_sigterm(signum: int, frame: Any) -> None:
        events.send(("SIGTERM", rank))
        if not ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    wake = wakeup_pipe()
    events.send(("ready", rank, os.getpid()))
    wait_for_signals(wake)


def checkpoint_on_sigusr1(rank: int, events: Any, returning: int) -> str:
    """Report each SIGUSR1 and return once a child in the rank's process group died of one.

    The rank sends ``("ready", rank, pid)`` once its child runs, then
    ``("SIGUSR1", rank)`` from its handler and ``("child", rank, returncode)``.
    Rank ``returning`` returns at once.
    """
    import subprocess

    if rank == returning:
        return "returned"
    signal.signal(signal.SIGUSR1, lambda signum, frame: events.send(("SIGUSR1", rank)))
    # The child keeps SIGUSR1's default action: the signal ends it.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    events.send(("ready", rank, os.getpid()))
    events.send(("child", rank, child.wait()))
    return "checkpointed"


def api_fail_on_release(
    rank: int,
    failing: int,
    release: Any,
    events: Any,
    ignore_sigterm: bool = False,
    exit_code: int | None = None,
) -> None:
    """Rank ``failing`` fails once ``release`` is set; the others run :func:`api_record_sigterm`.

    It raises ValueError, or with ``exit_code`` calls ``sys.exit(exit_code)``.
    """
    if rank != failing:
        api_record_sigterm(rank, events, ignore_sigterm)
    release.wait()
    if exit_code is not None:
        sys.exit(exit_code)
    raise ValueError(f"rank {rank} failed on purpose")


def api_fail_or_follow(rank: int, failing: int, failed: Any) -> int:
    """Rank ``failing`` raises; the others notice, wind down for a moment, and return."""
    if rank == failing:
        failed.set()
        raise ValueError(f"rank {rank} failed on purpose")
    failed.wait()
    time.sleep(0.3)  # winding down, as a rank does after losing a peer
    return rank


class ApiHeldArg:
    """An argument that, unpickled in a rank, sends ``("unpickling", pid)`` and waits.

    It waits until ``release`` (the ``release`` fixture's first end) is
    readable: these ranks may be stopped while they wait, and a
    ``multiprocessing.Event`` would then block its ``set()`` for good. Put
    before more than a pipe buffer (64 KiB) of other arguments, it keeps the
    parent's ``Process.start()`` blocked, so the start stays in flight until
    the test releases it. It arrives in the rank as ``None``.
    """

    def __init__(self, events: Any, release: Any) -> None:
        self.events = events
        self.release = release

    def __reduce__(self) -> tuple[Any, ...]:
        return _api_hold_start, (self.events, self.release)


def _api_hold_start(events: Any, release: Any) -> None:
    events.send(("unpickling", os.getpid()))
    release.poll(None)  # readable once the test sends; nothing is consumed


def api_return_rank(rank: int, *ignored: Any) -> int:
    return rank


def api_frozen_objects(rank: int) -> int:
    """How many objects the collector ignores here (``gc.freeze``)."""
    import gc

    return gc.get_freeze_count()


def api_fork_server(rank: int) -> tuple[int, bool]:
    """The fork server that forked this rank (its parent); whether it preloaded the bootstrap."""
    return os.getppid(), "aiospawn._rank.forkserver" in sys.modules


def api_sleep_with(rank: int, *ignored: Any) -> None:
    sleep_forever(rank)


# Ranks for test_child, test_watch and test_launch (prefixes crash_, watch_, launch_).
# ``events`` is the write end of a multiprocessing Pipe the test reads.


class CrashLockedError(Exception):
    """An exception that cannot be pickled in the rank: it holds a lock."""

    def __init__(self, message: str) -> None:
        import threading

        super().__init__(message)
        self.lock = threading.Lock()


class CrashNeedsTwoArgsError(Exception):
    """Pickles in the rank but not back: ``__init__`` needs more than ``args`` holds."""

    def __init__(self, shard: int, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")
        self.shard = shard
        self.reason = reason


def crash_row(rank: int, behaviour: str, failing: int | None) -> Any:
    """Do ``behaviour`` (a row of the crash matrix in test_child); ranks other than
    ``failing`` sleep until stopped. ``failing=None``: every rank does it."""
    if failing is not None and rank != failing:
        sleep_forever(rank)
    if behaviour == "return":
        return ("value", rank)
    if behaviour == "sys.exit()":
        sys.exit()
    if behaviour == "sys.exit(0)":
        sys.exit(0)
    if behaviour == "os._exit(0)":
        os._exit(0)
    if behaviour == "sys.exit(3)":
        sys.exit(3)
    if behaviour == "sys.exit(text)":
        sys.exit("crash text")
    if behaviour == "sys.exit(256)":
        sys.exit(256)
    if behaviour == "closerange, return":
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        return ("lost", rank)
    if behaviour == "os._exit(7)":
        os._exit(7)
    if behaviour == "segfault":
        import faulthandler
        import resource

        faulthandler.disable()  # no traceback dump: the exit status is the point
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # and no core file
        faulthandler._sigsegv()
    if behaviour in ("SIGKILL", "SIGTERM"):
        os.kill(os.getpid(), signal.Signals[behaviour])
        time.sleep(60)
    if behaviour == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if behaviour == "raise ValueError":
        raise ValueError(f"bad shard {rank}")
    if behaviour == "return lock":
        import threading

        return threading.Lock()
    if behaviour == "return lambda":
        return lambda: rank
    if behaviour == "raise unpicklable":
        raise CrashLockedError(f"locked shard {rank}")
    if behaviour == "raise unloadable":
        raise CrashNeedsTwoArgsError(rank, "torn")
    raise AssertionError(f"unknown crash row {behaviour!r}")


def crash_report_group(rank: int, events: Any) -> None:
    """Send ``(rank, pid, process group id)``, then sleep until stopped."""
    events.send((rank, os.getpid(), os.getpgid(0)))
    sleep_forever(rank)


def crash_report_signals(rank: int, events: Any) -> None:
    """Send how signals are set up in this rank, then return."""
    events.send(
        {
            "SIGINT": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "SIGTERM": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "SIGUSR1": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
            "SIGPIPE": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
            "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())),
            "wakeup_fd": signal.set_wakeup_fd(-1),
        }
    )


def watch_fork_grandchild(rank: int, events: Any, supervisor: int, outcome: str) -> str:
    """Fork a grandchild that holds every inherited fd for 30 s, then return or exit.

    The grandchild sends nothing; it ends after 30 s, when ``supervisor`` (the
    test process) is gone, or when the test kills it. The rank sends its pid.
    It leaves the rank's process group and session, which ``os._exit`` then
    leaves running (a returning rank kills it before it reports).
    """
    import select

    # The rank goes on only once the grandchild has left its process group:
    # otherwise the rank's exit could come first, and the group kill with it.
    left, has_left = os.pipe()
    grandchild = os.fork()
    if grandchild == 0:
        try:
            os.setsid()
            os.write(has_left, b"!")
            poller = select.poll()
            poller.register(os.pidfd_open(supervisor), select.POLLIN)
            poller.poll(30_000)
        finally:
            os._exit(0)
    os.close(has_left)
    os.read(left, 1)
    os.close(left)
    events.send(grandchild)
    if outcome == "exit":
        os._exit(5)
    return "returned"


def watch_big_result(rank: int, size: int) -> bytes:
    return bytes(range(256)) * (size // 256)


def watch_exit_by_rank(rank: int) -> None:
    os._exit(rank % 7 + 1)


def launch_ping(rank: int, conns: Any) -> None:
    """Send ``("ready", pid, parent-death signal)`` on ``conns[rank]``, answer one ping, sleep."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pdeathsig = ctypes.c_int(-1)
    libc.prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG
    conn = conns[rank]
    conn.send(("ready", os.getpid(), pdeathsig.value))
    conn.send(("pong", conn.recv()))
    sleep_forever(rank)


def launch_report_ready(rank: int, events: Any) -> None:
    """Send ``(rank, pid)``, then sleep until stopped."""
    events.send((rank, os.getpid()))
    sleep_forever(rank)


# --- reliability suite (test_reliability.py, test_parent_death.py, test_state_machine.py) ---


def rel_ready_sleep(rank: int, conn: Any) -> None:
    """Send ``("ready", rank, pid)`` on ``conn``, then sleep until stopped."""
    wake = wakeup_pipe()
    conn.send(("ready", rank, os.getpid()))
    wait_for_signals(wake)


def rel_notice_term(rank: int, conn: Any) -> None:
    """Survive SIGTERM, sending ``("term", rank, pid)`` for each; report ready, sleep."""

    def on_term(signum: int, frame: Any) -> None:
        conn.send(("term", rank, os.getpid()))

    signal.signal(signal.SIGTERM, on_term)
    wake = wakeup_pipe()
    conn.send(("ready", rank, os.getpid()))
    wait_for_signals(wake)


def rel_family(rank: int, conn: Any, ignore_term_int: bool) -> None:
    """Start two grandchildren in this rank's process group, report all pids, sleep.

    One grandchild is a plain ``os.fork`` (it inherits every fd, the result pipe
    included), the other a ``subprocess.Popen`` without a new session. With
    ``ignore_term_int`` the rank (and so both grandchildren) ignore SIGTERM and
    SIGINT: only SIGKILL can stop them.
    """
    import subprocess

    if ignore_term_int:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    forked = os.fork()
    if forked == 0:
        try:
            while True:
                time.sleep(3600)
        finally:
            os._exit(0)
    popen = subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(3600)"],
        stdin=subprocess.DEVNULL,
    )
    conn.send({"rank": rank, "pid": os.getpid(), "grandchildren": [forked, popen.pid]})
    sleep_forever(rank)


def rel_obey(rank: int, commands: Any) -> Any:
    """Wait for one command on ``commands[rank]`` and do it.

    ``("return", value)`` returns ``value``; ``("exit", n)`` calls ``sys.exit(n)``;
    ``("raise", text)`` raises ``ValueError(text)``.
    """
    what, arg = commands[rank].recv()
    if what == "return":
        return arg
    if what == "exit":
        sys.exit(arg)
    raise ValueError(arg)


def rel_len(rank: int, data: bytes) -> int:
    return len(data)


def rel_fail_or_sleep(rank: int, failing: int, conn: Any = None) -> None:
    """Rank ``failing`` raises at once; the others report ready (if asked) and sleep."""
    if rank == failing:
        raise RuntimeError(f"rel: rank {rank} fails on purpose")
    if conn is not None:
        conn.send(("ready", rank, os.getpid()))
    sleep_forever(rank)


# Ranks for test_output (prefix out_): what a rank writes to its stdout and stderr.


def out_hello(rank: int, lines: int = 1) -> None:
    """Write ``lines`` numbered lines to stdout and to stderr."""
    for index in range(lines):
        print(f"out {rank} {index}")
        print(f"err {rank} {index}", file=sys.stderr)


def out_unicode(rank: int) -> int:
    """Write a line that only a Unicode stream can hold, then return 7."""
    print("r\u00e9sum\u00e9")
    return 7


def out_flood(rank: int, count: int) -> None:
    """Write ``count`` lines of 64 bytes (63 characters and a newline), in big writes."""
    fill = "x" * 52
    batch = 16384
    for start in range(0, count, batch):
        stop = min(start + batch, count)
        block = "".join(f"{index:010d}{fill}\n" for index in range(start, stop))
        sys.stdout.buffer.write(block.encode())
    sys.stdout.flush()


def out_last_words(rank: int, how: str) -> None:
    """Write output, then end abruptly (``how``: ``"no-newline"``, ``"os-exit"``, ``"sigkill"``)."""
    if how == "no-newline":
        sys.stdout.write(f"first {rank}\nunfinished {rank}")
        sys.stdout.flush()
        os._exit(0)
    if how == "os-exit":
        print(f"last line {rank}", flush=True)
        os._exit(3)
    print(f"before sigkill {rank}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def out_c_level(rank: int) -> None:
    """Write through C stdio (puts, fflush) and from a grandchild (os.system)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.puts(f"from C {rank}".encode())
    libc.fflush(None)
    os.system(f"echo from grandchild {rank}; echo grandchild stderr {rank} >&2")


def out_long_line(rank: int, length: int) -> None:
    sys.stdout.write("y" * length + "\n")
    sys.stdout.flush()


def out_stderr_then_fail(rank: int, lines: int, how: str) -> None:
    """Write ``lines`` numbered lines to stderr, then ``sys.exit(3)`` or raise."""
    for index in range(lines):
        print(f"stderr line {index}", file=sys.stderr)
    if how == "exit":
        sys.exit(3)
    raise ValueError("out: failing after stderr lines")


def out_environ(rank: int, *names: str) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def child_thread_signal_masks(rank: int) -> dict[str, int]:
    """The blocked-signal mask of each of this rank's threads but the main one."""
    masks = {}
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        if int(task) == os.getpid():
            continue
        with open(f"/proc/{os.getpid()}/task/{task}/status") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    masks[task] = int(line.split()[1], 16)
    return masks


def crash_print_then_raise(rank: int, megabytes: int) -> None:
    """Write ``megabytes`` MB to stdout, then fail as rank 1 of the crash matrix does."""
    if rank != 1:
        sleep_forever(rank)
    line = "x" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        sys.stdout.write(line)
    sys.stdout.flush()
    raise ValueError(f"bad shard {rank}")


def crash_stubborn_sibling(rank: int, behaviour: str, ready: Any, release: Any) -> None:
    """Rank 0 refuses SIGTERM (``behaviour``) and says so; rank 1 raises once released."""
    if rank == 0:
        if behaviour == "ignores SIGTERM":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:  # "hangs in C, SIGTERM blocked": the signal stays pending
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        ready.send("ready")
        time.sleep(3600)
    release.wait()
    raise ValueError(f"bad shard {rank}")
