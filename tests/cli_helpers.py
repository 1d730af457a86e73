"""Helpers of the command-line tests: run the launcher, read its ranks' lines, clean up.

Each test starts ``python -m aiospawn run ...`` from the repository root, with
the small programs of ``tests/cli_programs`` as targets. A :class:`Launcher`
runs in a session of its own, so that whatever is left of it after a test can
be found and killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "cli_programs"
LAUNCHER = [sys.executable, "-m", "aiospawn"]

#: Seconds a launcher may take for anything these tests ask of it (a tripwire).
TRIPWIRE = 60.0

PREFIXED = re.compile(r"^\[rank(\d+)\]: (.*)$")


@pytest.fixture(scope="module", autouse=True)
def basetemp_first(tmp_path_factory: pytest.TempPathFactory) -> None:
    # pytest makes its base temp dir on first use, inside our temp dir; made
    # before the leak check's baseline, it is not a leak of the first test.
    tmp_path_factory.getbasetemp()


def program(name: str) -> str:
    return str(PROGRAMS / name)


def environ(**changes: str | None) -> dict[str, str]:
    """The launcher's environment: ours, OMP_NUM_THREADS set (no note), then ``changes``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the launcher to its end and return its status, stdout and stderr."""
    return subprocess.run(
        [*LAUNCHER, *args],
        cwd=REPO,
        env=environ() if env is None else env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TRIPWIRE,
        check=False,
    )


def by_rank(stdout: str) -> dict[int, list[str]]:
    """The ``[rankN]: line`` lines of an output, grouped by rank, prefixes removed."""
    lines: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        match = PREFIXED.match(line)
        assert match, f"a line without a rank prefix: {line!r}"
        lines.setdefault(int(match[1]), []).append(match[2])
    return lines


def json_by_rank(stdout: str) -> dict[int, Any]:
    return {rank: json.loads(lines[0]) for rank, lines in by_rank(stdout).items()}


def session_members(sid: int) -> list[int]:
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.getsid(process.pid) == sid and process.pid != os.getpid():
                members.append(process.pid)
    return members


#: Runs the rest of its command line with SIGHUP's default action, as a shell
#: starts a program: a test run under ``nohup`` would hand the launcher SIGHUP
#: ignored (a disposition an exec keeps).
HANGUP_DEFAULT = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL);"
    " os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
)


class Launcher:
    """A launcher running in the background, in a session of its own.

    With ``hangup_default``, SIGHUP has its default action in the launcher
    whatever this process has.
    """

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, hangup_default: bool = False
    ) -> None:
        command = [*LAUNCHER, *args]
        if hangup_default:
            assert command[0] == sys.executable, command
            command = [*HANGUP_DEFAULT, *command[1:]]
        self.proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=environ() if env is None else env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.out = b""
        self.err = b""

    def wait_for_lines(self, pattern: str, count: int) -> list[re.Match[str]]:
        """Read stdout until ``count`` lines match ``pattern``; return the matches."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + TRIPWIRE
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        while True:
            found = [m for line in self.out.decode().splitlines() if (m := regex.search(line))]
            if len(found) >= count:
                return found
            left = deadline - time.monotonic()
            assert left > 0, f"no {count} lines {pattern!r} in time: {self.out!r} {self.err!r}"
            ready, _, _ = select.select([self.proc.stdout, self.proc.stderr], [], [], left)
            for stream in ready:
                data = os.read(stream.fileno(), 65536)
                assert data, f"the launcher ended early: {self.out!r} {self.err!r}"
                if stream is self.proc.stdout:
                    self.out += data
                else:
                    self.err += data

    def ready_pids(self, count: int) -> list[int]:
        return [int(match[1]) for match in self.wait_for_lines(r"ready (\d+)$", count)]

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self) -> tuple[int, str, str]:
        """Wait for the launcher to exit; return its status and whole stdout and stderr."""
        out, err = self.proc.communicate(timeout=TRIPWIRE)
        return self.proc.returncode, (self.out + out).decode(), (self.err + err).decode()

    def cleanup(self) -> None:
        """After the test: nothing of this session may be left, whatever happened."""
        running = self.proc.returncode is None
        if running:
            self.proc.kill()  # which reaps it if it is dead already: still read its pipes
        # First what is left of the session: ranks that outlived their
        # launcher (a test that failed) hold its pipes, and reading them to
        # their end would wait for those ranks forever.
        for pid in session_members(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if running:
            self.proc.communicate()


@pytest.fixture
def launchers() -> Iterator[list[Launcher]]:
    started: list[Launcher] = []
    yield started
    for launcher in started:
        launcher.cleanup()


def start(
    launchers: list[Launcher],
    *args: str,
    env: dict[str, str] | None = None,
    hangup_default: bool = False,
) -> Launcher:
    launcher = Launcher(*args, env=env, hangup_default=hangup_default)
    launchers.append(launcher)
    return launcher
