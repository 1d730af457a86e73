"""Ctrl-C deferral alone: ``aiospawn._sync._interrupts``, with no loop and no process.

While a blocking call of ``aiospawn.sync`` runs in the main thread, the first
Ctrl-C is counted instead of raised wherever the thread happens to be; it is
raised at one point (by the wait that notices it, or as the call returns). A
second one is raised at once. A handler the program installed is left alone.
``signal.raise_signal`` in the main thread runs the handler before the next
line, so each test knows exactly where its Ctrl-C landed.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TypeVar

import pytest

from aiospawn._sync._interrupts import CtrlC, with_ctrl_c_deferred

T = TypeVar("T")


@pytest.fixture(autouse=True)
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, even where pytest runs with SIGINT ignored."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)


def deferred(body: Callable[[], T]) -> T:
    """``with_ctrl_c_deferred(body)``, where a KeyboardInterrupt fails the test, not the run."""
    try:
        return with_ctrl_c_deferred(body)
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt was raised where none was due")


def test_a_first_ctrl_c_is_raised_as_the_call_returns_not_where_it_lands() -> None:
    steps: list[str] = []

    def body() -> str:
        steps.append("before")
        ctrl_c()
        steps.append("after")  # the bookkeeping that must not be cut short
        return "result"

    with pytest.raises(KeyboardInterrupt):
        with_ctrl_c_deferred(body)
    assert steps == ["before", "after"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_wait_sees_the_pending_ctrl_c_and_once_it_delivered_it_it_is_not_raised_again() -> None:
    seen: list[tuple[int, bool]] = []

    def body() -> str:
        ctrl_c()
        handler = CtrlC.current()
        assert handler is not None
        seen.append((handler.count, handler.pending))
        # What the portal's wait does as it raises the KeyboardInterrupt itself.
        handler.delivered = True
        seen.append((handler.count, handler.pending))
        return "result"

    assert deferred(body) == "result"
    assert seen == [(1, True), (1, False)]


def test_a_second_ctrl_c_is_raised_where_it_lands() -> None:
    steps: list[str] = []

    def body() -> None:
        ctrl_c()
        steps.append("after the first")
        ctrl_c()
        steps.append("after the second")

    with pytest.raises(KeyboardInterrupt):
        with_ctrl_c_deferred(body)
    assert steps == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_ctrl_c_the_call_returns_and_pythons_handler_is_back() -> None:
    def body() -> str:
        assert isinstance(signal.getsignal(signal.SIGINT), CtrlC)
        return "result"

    assert with_ctrl_c_deferred(body) == "result"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(ValueError, match="boom"):
        with_ctrl_c_deferred(_raise_value_error)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _raise_value_error() -> None:
    raise ValueError("boom")


def test_nested_calls_defer_too() -> None:
    steps: list[str] = []

    def inner() -> None:
        ctrl_c()
        steps.append("inner went on")

    def outer() -> None:
        with_ctrl_c_deferred(inner)
        steps.append("never")

    with pytest.raises(KeyboardInterrupt):
        with_ctrl_c_deferred(outer)
    assert steps == ["inner went on"]


def test_a_handler_the_program_installed_is_left_alone() -> None:
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    signal.signal(signal.SIGINT, handler)

    def body() -> str:
        assert signal.getsignal(signal.SIGINT) is handler
        ctrl_c()
        return "result"

    assert deferred(body) == "result"
    assert received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is handler


def test_outside_the_main_thread_nothing_is_deferred() -> None:
    outcome: list[object] = []

    def body() -> str:
        outcome.append(CtrlC.current())
        outcome.append(signal.getsignal(signal.SIGINT))
        return "result"

    thread = threading.Thread(target=lambda: outcome.append(with_ctrl_c_deferred(body)))
    thread.start()
    thread.join(30)
    assert outcome == [None, signal.default_int_handler, "result"]


def test_a_handler_left_behind_by_a_cut_short_call_acts_as_pythons_and_puts_it_back() -> None:
    # A call interrupted before it put Python's handler back left its own.
    signal.signal(signal.SIGINT, CtrlC())
    with pytest.raises(KeyboardInterrupt):
        ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
