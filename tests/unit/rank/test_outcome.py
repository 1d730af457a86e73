"""The outcome rule (``_rank.outcome.run_fn``): how ``fn`` ended -> the frame and status.

Called in this process, row by row of the table in the module's docstring;
what only a real rank shows (exit codes, the supervisor's exceptions) is in
``tests/test_child.py``.
"""

from __future__ import annotations

import array
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from aiospawn._rank import api
from aiospawn._rank.outcome import Ending, run_fn
from aiospawn._rank.payload import unpickle_in_rank
from aiospawn._rank.wire import Kind
from tests.helpers import first_frame


@pytest.fixture(autouse=True)
def _fresh_rank_api() -> Iterator[None]:
    # An async fn tells the rank API which loop it runs on: not for later tests.
    yield
    api.begin(restart=0, frames=None)


def returns(rank: int, value: object) -> object:
    return value


def exits(rank: int, code: object) -> None:
    sys.exit(code)


def raises(rank: int) -> None:
    raise LookupError(f"rank {rank} looked in vain")


def interrupted(rank: int) -> None:
    raise KeyboardInterrupt


async def returns_later(rank: int, value: object) -> object:
    return value


async def raises_later(rank: int) -> None:
    raise LookupError(f"rank {rank} awaited in vain")


async def stopped(rank: int) -> None:
    import asyncio

    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(60)  # cancelled by the SIGTERM


def frame_value(ending: Ending) -> object:
    return pickle.loads(ending.payload)


def raised(ending: Ending) -> tuple[BaseException | None, str, str]:
    exc_pickle, type_name, text = pickle.loads(ending.payload)
    return (None if exc_pickle is None else pickle.loads(exc_pickle)), type_name, text


def test_a_returned_value_is_the_frame_and_is_held_until_the_rank_ends() -> None:
    before = time.time()
    with tempfile.TemporaryDirectory() as parent:
        # Its finalizer would remove the directory: it must not run midway
        # through the rank's end.
        value = tempfile.TemporaryDirectory(dir=parent)
        ending = run_fn(returns, 3, (value,), "asyncio")
        del value
        assert os.path.isdir(ending.value.name)
        ending.value.cleanup()
    assert (ending.kind, ending.status, ending.text, ending.terminated) == (
        Kind.RETURNED,
        0,
        None,
        False,
    )
    assert before <= ending.ended_at <= time.time()
    assert ending.frame == (Kind.RETURNED, ending.payload, 0)


@pytest.mark.parametrize(
    ("code", "kind", "carried", "status", "text"),
    [
        (None, Kind.RETURNED, None, 0, None),
        (0, Kind.RETURNED, None, 0, None),
        (3, Kind.EXITED, (3, None), 3, None),
        (255, Kind.EXITED, (255, None), 255, None),
        (256, Kind.EXITED, (256, None), 1, None),
        (-2, Kind.EXITED, (-2, None), 1, None),
        ("bye", Kind.EXITED, (1, "sys.exit('bye')"), 1, "bye"),
    ],
)
def test_sys_exit(code: object, kind: int, carried: object, status: int, text: str | None) -> None:
    ending = run_fn(exits, 0, (code,), "asyncio")
    assert (ending.kind, frame_value(ending), ending.status, ending.text) == (
        kind,
        carried,
        status,
        text,
    )


def test_a_raise_is_the_frame_with_a_traceback_that_starts_in_fn() -> None:
    ending = run_fn(raises, 2, (), "asyncio")
    assert (ending.kind, ending.status) == (Kind.RAISED, 1)
    exc, type_name, text = raised(ending)
    assert isinstance(exc, LookupError)
    assert str(exc) == "rank 2 looked in vain"
    assert type_name == "builtins.LookupError"
    assert first_frame(text).endswith(", in raises")  # no frame of ours above fn's
    assert "run_fn" not in text


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_an_async_fns_raise_has_a_traceback_that_starts_in_fn(loop: str) -> None:
    # Below the event loop's own frames, which are not the user's either.
    ending = run_fn(raises_later, 1, (), loop)
    exc, _, text = raised(ending)
    assert isinstance(exc, LookupError)
    assert first_frame(text).endswith(", in raises_later"), text
    # Its own traceback, the last one (what the test process raised before may
    # be chained above it on Python 3.12), holds fn's frame alone.
    last = text.rpartition("Traceback (most recent call last):\n")[2]
    assert last.count('  File "') == 1, text


def test_a_fn_that_cannot_be_called_keeps_the_line_that_called_it() -> None:
    ending = run_fn(raises, 0, ("surplus",), "asyncio")
    exc, _, text = raised(ending)
    assert isinstance(exc, TypeError)
    assert text.startswith("Traceback (most recent call last):\n"), text
    assert first_frame(text).endswith(", in run_fn"), text


def test_a_keyboard_interrupt_is_raised_like_any_exception() -> None:
    ending = run_fn(interrupted, 0, (), "asyncio")
    assert (ending.kind, ending.status, raised(ending)[1]) == (
        Kind.RAISED,
        1,
        "builtins.KeyboardInterrupt",
    )


def test_a_value_that_cannot_be_pickled_raises_saying_so() -> None:
    ending = run_fn(returns, 0, (lambda: None,), "asyncio")
    assert (ending.kind, ending.status) == (Kind.RAISED, 1)
    exc, _, _ = raised(ending)
    assert isinstance(exc, TypeError)
    assert "the value returned by the rank cannot be pickled" in str(exc)


def test_a_returned_memoryview_is_a_view_of_the_same_format_and_shape() -> None:
    view = memoryview(bytes(range(16))).cast("h", (2, 4))
    ending = run_fn(returns, 0, ({"view": view},), "asyncio")
    assert (ending.kind, ending.status) == (Kind.RETURNED, 0)
    back = frame_value(ending)["view"]  # type: ignore[index]
    assert (back.format, back.shape, back.readonly, back.tobytes()) == (
        "h",
        (2, 4),
        True,
        view.tobytes(),
    )


def test_an_empty_memoryview_result_comes_back_empty() -> None:
    # A cast takes no shape with a zero in it: the receiver rebuilds it otherwise.
    for empty in (memoryview(array.array("i")), memoryview(bytes(8)).cast("i")[1:1]):
        back = frame_value(run_fn(returns, 0, (empty,), "asyncio"))
        assert (back.format, back.shape, back.tobytes()) == ("i", (0,), b"")  # type: ignore[attr-defined]


def test_a_result_that_cannot_be_pickled_is_pickled_once_and_its_error_stands_alone() -> None:
    calls = []

    class Counted:
        def __reduce__(self) -> tuple[object, ...]:
            calls.append(1)
            raise TypeError("cannot pickle Counted")

    ending = run_fn(returns, 0, (Counted(),), "asyncio")
    assert (ending.kind, ending.status, len(calls)) == (Kind.RAISED, 1, 1)
    exc, _, text = raised(ending)
    assert "cannot pickle Counted" in str(exc)
    # Once: a retry would have raised it again, chained to the first.
    assert text.count("TypeError: cannot pickle Counted") == 1, text


def test_a_payload_is_unpickled_as_part_of_fn() -> None:
    ending = run_fn(unpickle_in_rank(pickle.dumps((returns, (5,)))), 0, (), "asyncio")
    assert (ending.kind, frame_value(ending)) == (Kind.RETURNED, 5)
    broken = unpickle_in_rank(b"\x80\x05 not a pickle")
    ending = run_fn(broken, 0, (), "asyncio")
    assert (ending.kind, ending.status, raised(ending)[1]) == (
        Kind.RAISED,
        1,
        "_pickle.UnpicklingError",
    )


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_an_async_fn_runs_on_the_loop_named(loop: str) -> None:
    ending = run_fn(returns_later, 0, ("later",), loop)
    assert (ending.kind, frame_value(ending), ending.status) == (Kind.RETURNED, "later", 0)
    assert api._loop == loop  # its channel is awaited there


def test_an_async_fn_cancelled_by_sigterm_ends_terminated_without_a_frame() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ending = run_fn(stopped, 0, (), "asyncio")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert ending.terminated
    assert ending.payload == b""
