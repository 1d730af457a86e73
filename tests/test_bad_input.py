"""Bad input that used to fail late or vaguely is refused, clearly, before any rank starts.

Covered: a main script read from standard input under ``spawn`` and
``forkserver``; generator and async generator functions as ``fn``; ``env``
names and values no environment can hold (from a mapping or a callable); more
ranks than the file limit allows for the group's options; a failure part-way
through making a rank (no descriptor is left open); ``aiospawn run --env KEY``.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import aiospawn
from aiospawn._core._spec import make_output_spec
from aiospawn._local._limits import fds_per_rank, max_nprocs
from tests import hostile_ranks, ranks
from tests.cli_helpers import environ, run

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _pytest_basetemp(tmp_path_factory: pytest.TempPathFactory) -> None:
    # Made before the leak check's first baseline: not a leak of the first test.
    tmp_path_factory.getbasetemp()


STDIN_SCRIPT = """\
import anyio, aiospawn
from tests import hostile_ranks

async def main():
    try:
        await aiospawn.start_processes(hostile_ranks.returns_rank, start_method={method!r})
    except Exception as exc:
        print(type(exc).__name__, exc)
    else:
        print("started")

anyio.run(main)
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_a_script_read_from_stdin_runs_under_every_start_method(start_method: str) -> None:
    # Under spawn and forkserver a rank would import the main script again
    # from its __file__, '<stdin>' (FileNotFoundError in every rank): it does not.
    completed = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_SCRIPT.format(method=start_method),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.stdout == "started\n", completed.stderr


@pytest.mark.usefixtures("no_process_start")
@pytest.mark.parametrize("start_method", ["spawn", "fork"])
@pytest.mark.parametrize(
    "fn",
    [
        hostile_ranks.generator_rank,
        hostile_ranks.async_generator_rank,
        functools.partial(hostile_ranks.generator_rank),
    ],
    ids=["generator", "async-generator", "partial-of-a-generator"],
)
async def test_a_generator_function_is_refused(fn: Callable[..., Any], start_method: str) -> None:
    with pytest.raises(TypeError, match="is a generator function: calling it runs none"):
        await aiospawn.start_processes(fn, nprocs=2, start_method=start_method)


def env_of(env: dict[str, str]) -> Callable[[int], dict[str, str]]:
    return functools.partial(_env_for_rank_1, env)


def _env_for_rank_1(env: dict[str, str], rank: int) -> dict[str, str]:
    return env if rank == 1 else {}


BAD_ENVS = [
    pytest.param(
        {"TOKEN": "a\0b"}, r"env(\(1\))?\['TOKEN'\] holds a NUL character", id="nul-value"
    ),
    pytest.param({"A=B": "1"}, r"the variable name 'A=B', which holds '='", id="equals-in-name"),
    pytest.param({"": "1"}, r"has an empty variable name", id="empty-name"),
    pytest.param({"A\0": "1"}, r"which holds a NUL character", id="nul-in-name"),
]


@pytest.mark.usefixtures("no_process_start")
@pytest.mark.parametrize("how", ["mapping", "callable"])
@pytest.mark.parametrize(("env", "match"), BAD_ENVS)
async def test_an_environment_no_process_can_have_is_refused(
    env: dict[str, str], match: str, how: str
) -> None:
    given: Any = env if how == "mapping" else env_of(env)
    with pytest.raises(ValueError, match=match):
        await aiospawn.start_processes(ranks.identity, nprocs=2, start_method="fork", env=given)


@pytest.mark.usefixtures("no_process_start")
async def test_an_env_callable_that_returns_no_mapping_is_refused() -> None:
    with pytest.raises(TypeError, match=r"env\(0\) must return a mapping, got 5"):
        await aiospawn.start_processes(
            ranks.identity, nprocs=1, start_method="fork", env=lambda rank: 5
        )


def test_the_descriptors_counted_per_rank_follow_the_options() -> None:
    def per_rank(stdout: object, stderr: object, tee: bool = False, beats: bool = False) -> int:
        return fds_per_rank(make_output_spec(stdout, stderr, tee, "[{rank}] "), beats)

    assert per_rank("inherit", "devnull") == 6
    assert per_rank("prefix", "capture") == 10
    assert per_rank("/logs", "/logs") == 8
    assert per_rank("/logs", "/logs", tee=True) == 12
    assert per_rank("prefix", "prefix", beats=True) == 14
    assert max_nprocs() >= max_nprocs(make_output_spec("prefix", "prefix", False, ""), True)


@pytest.fixture
def few_descriptors() -> Iterator[int]:
    """Lower RLIMIT_NOFILE to what is open now plus 200; yield the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 200
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_as_many_ranks_as_max_nprocs_allows_start_with_every_pipe(
    few_descriptors: int,
) -> None:
    output = make_output_spec("prefix", "capture", False, "[{rank}] ")
    limit = max_nprocs(output, heartbeats=True)
    assert 1 < limit < 50
    with pytest.raises(ValueError, match=rf"nprocs={limit + 1} .*\({limit}, from RLIMIT_NOFILE"):
        await aiospawn.start_processes(
            ranks.identity,
            nprocs=limit + 1,
            start_method="fork",
            stdout="prefix",
            stderr="capture",
            join=False,
            heartbeat_timeout=600,
        )
    ctx = await aiospawn.start_processes(
        hostile_ranks.returns_rank,
        nprocs=limit,
        start_method="fork",
        stdout="prefix",
        stderr="capture",
        join=False,
        heartbeat_timeout=600,
    )
    async with ctx:
        async for _line in ctx.output():
            pass
    assert ctx.results == list(range(limit))


def failing_nth_pipe(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    """Make the ``n``-th ``os.pipe()`` from now fail with EMFILE; return the call count."""
    real = os.pipe
    calls = [0]

    def pipe() -> tuple[int, int]:
        calls[0] += 1
        if calls[0] == n:
            raise OSError(24, "Too many open files")
        return real()

    monkeypatch.setattr(os, "pipe", pipe)
    return calls


def all_fds() -> set[str]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.add(f"{name}:{os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:
            continue
    return fds


# Per rank here: the result pipe, one pipe per stream, the stack pipe: 8 pipes
# for 2 ranks, all made before the first start; the 9th is the first of
# multiprocessing's own at that start. (If its second fails, popen_fork leaks
# the first: CPython's, not ours to test.)
@pytest.mark.parametrize("n", range(1, 10))
async def test_a_pipe_failing_part_way_through_making_ranks_leaks_nothing(
    n: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    before = all_fds()
    calls = failing_nth_pipe(monkeypatch, n)
    with pytest.raises(OSError, match="Too many open files"):
        await aiospawn.start_processes(
            ranks.identity,
            nprocs=2,
            start_method="fork",
            stdout="prefix",
            stderr=tmp_path,
            tee=True,
            heartbeat_timeout=600,
        )
    assert calls[0] >= n
    monkeypatch.undo()
    assert all_fds() == before  # memfds and files too, which the leak check does not see


@pytest.mark.parametrize(
    ("args", "master_addr"),
    [(["--env", "MASTER_ADDR"], "10.0.0.9"), ([], "127.0.0.1")],
    ids=["env-key-alone", "without"],
)
def test_the_launcher_takes_env_key_alone_from_its_own_environment(
    args: list[str], master_addr: str
) -> None:
    completed = run(
        "run",
        "--env",
        "AIOSPAWN_TEST_SECRET",
        *args,
        "tests/cli_programs/show_env.py",
        env=environ(AIOSPAWN_TEST_SECRET="from-the-launcher", MASTER_ADDR="10.0.0.9"),
    )
    assert completed.returncode == 0, completed.stderr
    shown = json.loads(completed.stdout)
    assert shown["AIOSPAWN_TEST_SECRET"] == "from-the-launcher"
    assert shown["MASTER_ADDR"] == master_addr  # --env KEY wins over torchrun's variables


def test_the_launcher_refuses_env_key_alone_when_it_is_unset() -> None:
    env = dict(os.environ)
    env.pop("AIOSPAWN_TEST_UNSET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "aiospawn", "run", "--env", "AIOSPAWN_TEST_UNSET", "x.py"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 2
    assert "AIOSPAWN_TEST_UNSET is not set in the launcher's environment" in completed.stderr
