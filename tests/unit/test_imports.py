"""aiospawn._imports: the switch interval a first call's import lowers, and puts back."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from aiospawn._imports import HANDOVER, _quick_handover


@pytest.fixture(autouse=True)
def interval() -> Iterator[float]:
    """The program's own switch interval (5 ms), whatever a test leaves behind."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_the_interval_is_lowered_while_the_import_runs_and_put_back_after(interval: float) -> None:
    with _quick_handover():
        assert sys.getswitchinterval() == pytest.approx(HANDOVER)
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_overlapping_imports_put_it_back_once_the_last_one_ends(interval: float) -> None:
    first, second = _quick_handover(), _quick_handover()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(HANDOVER)  # the second still imports
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_an_interval_set_meanwhile_by_somebody_else_is_kept() -> None:
    with _quick_handover():
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_shorter_interval_than_ours_is_never_raised() -> None:
    sys.setswitchinterval(0.0005)
    with _quick_handover():
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_an_error_in_the_import_still_puts_it_back(interval: float) -> None:
    with pytest.raises(ImportError), _quick_handover():
        raise ImportError("no such module")
    assert sys.getswitchinterval() == pytest.approx(interval)
