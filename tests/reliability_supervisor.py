"""A supervising process for the reliability suite, run as a script by the tests.

``python tests/reliability_supervisor.py MODE ...`` (any working directory):

``family START_METHOD IGNORE_TERM_INT``
    Start two ranks (``ranks.rel_family``) that each start two grandchildren
    in their own process group, print one JSON line with every pid, then wait
    for the group forever. tests/test_parent_death.py SIGKILLs this process
    and checks that every rank and grandchild dies with it.
``main-fn``
    Run ``spawn()`` with a function defined in this script's ``__main__``
    (a spawn rank re-imports the script, so this works); print the results.
``read-only-tmp``
    With ``$TMPDIR`` (a read-only directory) as the temp dir, run a group
    that succeeds and one that fails under each start method; print what
    each did as JSON.

The module body only defines things: spawn and forkserver ranks import it again.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# With the repository root on sys.path, `tests.ranks` imports here and in every rank.
import anyio

import aiospawn
from tests import ranks


async def family(start_method: str, ignore_term_int: bool) -> None:
    reader, writer = multiprocessing.get_context(start_method).Pipe(duplex=False)
    # open_group: a rank that fails before it reports ends this script (and
    # the test's wait for the report) with the rank's exception.
    async with aiospawn.open_group(
        ranks.rel_family,
        (writer, ignore_term_int),
        nprocs=2,
        start_method=start_method,
        grace_period=1,
    ):
        reports = []
        for _ in range(2):
            await anyio.wait_readable(reader.fileno())
            reports.append(reader.recv())
        reports.sort(key=lambda report: report["rank"])
        print(json.dumps({"supervisor": os.getpid(), "ranks": reports}), flush=True)
        await anyio.sleep_forever()  # only our death ends this


def main_fn(rank: int, text: str) -> list[Any]:
    return [rank, text, __name__]


def read_only_tmp() -> None:
    # Set the temp dir explicitly: tempfile.gettempdir() would otherwise skip
    # an unwritable $TMPDIR and silently fall back to /tmp.
    tempfile.tempdir = os.environ["TMPDIR"]
    try:
        fd, path = tempfile.mkstemp()
    except OSError as exc:
        writable = f"no ({exc.strerror})"
    else:
        os.close(fd)
        os.unlink(path)
        writable = "yes"
    report: dict[str, Any] = {"temp dir writable": writable}
    for method in ("spawn", "fork", "forkserver"):
        succeed = partial(aiospawn.start_processes, start_method=method)
        try:
            report[method] = anyio.run(succeed, ranks.rank_times, (7,), 2)
        except Exception as exc:
            report[method] = f"{type(exc).__name__}: {exc}"
        fail = partial(aiospawn.start_processes, start_method=method)
        try:
            anyio.run(fail, ranks.raise_in, (1,), 2)
        except Exception as exc:
            index = getattr(exc, "error_index", None)
            report[f"{method} failing"] = f"{type(exc).__name__} (error_index {index})"
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "family":
        anyio.run(family, sys.argv[2], sys.argv[3] == "1")
    elif mode == "main-fn":
        print(json.dumps(anyio.run(aiospawn.spawn, main_fn, ("hi",), 2)), flush=True)
    elif mode == "read-only-tmp":
        read_only_tmp()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
