"""The live status line of ``aiospawn run``, in a real terminal.

The launcher runs on a pseudo-terminal (``os.openpty``) of a known size, as
the controlling terminal of a session of its own; what it writes there is
read back and fed to a terminal emulator (pyte), and the screen is checked:
the status line holds the last row while the ranks' lines scroll above it,
and gives way to the summary at the end.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Iterator

import pytest

from tests.cli_helpers import (
    LAUNCHER,
    REPO,
    TRIPWIRE,
    basetemp_first,
    environ,
    program,
    run,
    session_members,
)
from tests.helpers import is_gone

__all__ = ["basetemp_first"]  # a fixture

ROWS, COLUMNS = 20, 120


def _take_terminal() -> None:
    # In the new session: the pseudo-terminal on fd 0 becomes the controlling terminal.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A launcher on a pseudo-terminal, and what it has written there so far."""

    def __init__(self, *args: str) -> None:
        self.master, terminal = os.openpty()
        fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        self.proc = subprocess.Popen(
            [*LAUNCHER, *args],
            cwd=REPO,
            env=environ(TERM="xterm"),
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
        os.close(terminal)
        self.data = b""

    def read_until(self, done: Callable[[bytes], bool]) -> None:
        """Read until ``done(everything so far)``, or to the end of output."""
        deadline = time.monotonic() + TRIPWIRE
        while not done(self.data):
            left = deadline - time.monotonic()
            assert left > 0, f"the terminal showed: {self.data!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: every holder of the terminal has closed it
                    chunk = b""
                if not chunk:
                    return
                self.data += chunk

    def screen(self) -> list[str]:
        """The screen as a terminal shows it after everything read so far."""
        import pyte

        screen = pyte.Screen(COLUMNS, ROWS)
        pyte.ByteStream(screen).feed(self.data)
        return [line.rstrip() for line in screen.display]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in session_members(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.close(self.master)


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    opened: list[Terminal] = []
    yield opened
    for terminal in opened:
        terminal.close()


def test_status_line_stays_below_the_output_then_gives_way_to_the_summary(
    terminals: list[Terminal],
) -> None:
    pytest.importorskip("pyte", reason="the screen is read back with pyte")
    terminal = Terminal(
        "run",
        "-n",
        "2",
        "--status",
        "--max-restarts",
        "1",
        "--restart-backoff",
        "0",
        "--grace-period",
        "5",
        program("fail_then_wait.py"),
    )
    terminals.append(terminal)
    ready = re.compile(rb"ready (\d+) restart 1")

    def restarted_and_shown(data: bytes) -> bool:
        return len(ready.findall(data)) == 2 and "2/2 running" in terminal.screen()[-1]

    terminal.read_until(restarted_and_shown)
    screen = terminal.screen()
    status = screen[-1]
    assert re.fullmatch(
        r"aiospawn: 2/2 running, 1 restart, last failure: rank 1 exit code 3 at \d\d:\d\d:\d\d",
        status,
    ), screen
    # The ranks' lines are above it, in the scrolling part of the screen.
    above = "\n".join(screen[:-1])
    assert len(re.findall(r"\[rank\d\]: ready \d+ restart 1", above)) == 2, screen
    pids = [int(pid) for pid in ready.findall(terminal.data)]

    terminal.proc.send_signal(signal.SIGTERM)
    terminal.read_until(lambda data: False)  # to the end of output
    assert terminal.proc.wait(TRIPWIRE) == 143
    assert all(is_gone(pid) for pid in pids)
    screen = terminal.screen()
    text = "\n".join(screen)
    assert not any(line.startswith("aiospawn: 2/2 running") for line in screen), screen
    assert "aiospawn: summary of" in text
    assert terminal.data.count(b"\x1b[r") >= 1  # the scrolling region was given back
    # The summary's rows follow on from the output, not from the status row.
    rows = [line for line in screen if re.match(r"\s+[01]\s+\d+\s+SIGTERM", line)]
    assert len(rows) == 2, screen


def test_no_status_line_by_default_for_a_few_ranks(terminals: list[Terminal]) -> None:
    terminal = Terminal("run", "-n", "2", program("show_vars.py"), "RANK")
    terminals.append(terminal)
    terminal.read_until(lambda data: False)
    assert terminal.proc.wait(TRIPWIRE) == 0
    assert b"\x1b" not in terminal.data


def test_status_line_by_default_for_more_ranks(terminals: list[Terminal]) -> None:
    pytest.importorskip("pyte", reason="the screen is read back with pyte")
    terminal = Terminal("run", "-n", "5", "--start-method", "fork", program("show_vars.py"), "RANK")
    terminals.append(terminal)
    terminal.read_until(lambda data: False)
    assert terminal.proc.wait(TRIPWIRE) == 0
    assert b"\x1b[1;19r" in terminal.data  # every row but the last scrolls
    assert terminal.screen()[-1] == ""  # and the status row was cleared at the end


def test_never_a_status_line_when_stderr_is_not_a_terminal() -> None:
    result = run("run", "-n", "2", "--status", program("show_vars.py"), "RANK")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout + result.stderr
