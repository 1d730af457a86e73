"""Where operational events are logged: the ``aiospawn`` logger, or a stand-in's.

``aiospawn.sync`` logs its groups' events on ``torch.multiprocessing.spawn``,
as torch does (see ``_core._log``); these check the routing without processes.
"""

from __future__ import annotations

import contextvars
import logging

import pytest

from aiospawn._core._log import log_as, logger
from tests.helpers import recorders

TORCH = "torch.multiprocessing.spawn"


def warn_as(stand_in: str | None, message: str, *args: object) -> None:
    """``logger.warning(...)`` from a context where ``stand_in`` (if any) was named."""

    def warn() -> None:
        if stand_in is not None:
            log_as(stand_in)
        logger.warning(message, *args)

    contextvars.copy_context().run(warn)


def test_events_go_to_the_aiospawn_logger_by_default() -> None:
    with recorders("", "aiospawn", "torch") as seen:
        warn_as(None, "Terminating process %s via signal SIGTERM (rank %d)", 42, 1)
    assert seen["torch"].records == []
    [record] = seen["aiospawn"].records
    assert seen[""].records == [record]
    assert record.name == "aiospawn"
    assert record.getMessage() == "Terminating process 42 via signal SIGTERM (rank 1)"
    assert record.funcName == "warn"  # the caller, not the logger's own code


def test_a_stand_in_logs_on_its_logger_and_the_root_sees_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once torch is imported (by another test of this process), its own
    # set-up keeps the "torch" loggers' records from the root: not ours to check.
    monkeypatch.setattr(logging.getLogger("torch"), "propagate", True)
    with recorders("", "aiospawn", "torch") as seen:
        warn_as(TORCH, "Terminating process %s via signal SIGTERM (rank %d)", 42, 1)
    [record] = seen["torch"].records  # as torch's own logging set-up would see it
    assert record.name == TORCH
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "Terminating process 42 via signal SIGTERM (rank 1)"
    assert record.funcName == "warn"
    assert seen[""].records == [record]
    assert seen["aiospawn"].records == [record]  # handlers of aiospawn's own get it too


def test_a_stand_in_logs_even_when_the_aiospawn_logger_is_quiet() -> None:
    quiet = logging.getLogger("aiospawn")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with recorders("aiospawn", "torch") as seen:
            warn_as(TORCH, "Terminating process %s via signal SIGTERM", 42)
    finally:
        quiet.setLevel(level)
    assert [record.name for record in seen["torch"].records] == [TORCH]
    assert seen["aiospawn"].records == []


@pytest.mark.parametrize("stand_in", [None, TORCH])
def test_a_disabled_level_makes_no_record(stand_in: str | None) -> None:
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    aiospawn_logger = logging.getLogger("aiospawn")
    aiospawn_level = aiospawn_logger.level
    aiospawn_logger.setLevel(logging.ERROR)
    try:
        with recorders("", "aiospawn", "torch") as seen:
            warn_as(stand_in, "Terminating process %s via signal SIGTERM", 42)
    finally:
        torch_logger.setLevel(level)
        aiospawn_logger.setLevel(aiospawn_level)
    assert all(handler.records == [] for handler in seen.values())
