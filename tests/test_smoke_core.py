from __future__ import annotations

import pytest

import aiospawn
from tests import ranks

pytestmark = pytest.mark.anyio


async def test_results_come_back_in_rank_order() -> None:
    assert await aiospawn.start_processes(ranks.rank_times, (10,), nprocs=3) == [0, 10, 20]


async def test_a_raising_rank_is_reported_with_its_exception() -> None:
    with pytest.raises(aiospawn.ProcessRaisedException) as info:
        await aiospawn.start_processes(ranks.raise_in, (1,), nprocs=2, grace_period=5)
    assert info.value.error_index == 1
    assert isinstance(info.value.__cause__, ValueError)
