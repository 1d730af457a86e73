"""Where the supervisor unpickles: on the loop only what is mostly copying (``_pickles``)."""

from __future__ import annotations

import pickle
import time
from typing import Any

import pytest

from aiospawn._core import _pickles
from aiospawn._core._pickles import LOAD_BYTES, THREAD_BYTES, _mostly_bytes, decode, encode

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "obj",
    [
        ("echo", b"x" * 1_000_000),
        {"a": [b"y" * 70_000, "z" * 100_000]},
        bytearray(1_000_000),
        (1, 2, 3),
    ],
    ids=["a tuple holding 1 MB of bytes", "blobs in containers", "a bytearray", "small"],
)
def test_a_pickle_of_large_blobs_and_few_objects_is_loaded_on_the_loop(obj: Any) -> None:
    assert _mostly_bytes(pickle.dumps(obj, protocol=5))


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(list(range(100_000)), protocol=5),
        pickle.dumps(([str(i) for i in range(20_000)], b"x" * 500_000), protocol=5),
        pickle.dumps(b"x" * (LOAD_BYTES + 1), protocol=5),
        pickle.dumps(("echo", b"x" * 1_000_000), protocol=5)[:-3],
        pickle.dumps(("echo", b"x" * 1_000_000), protocol=2),
        b"",
    ],
    ids=[
        "many objects",
        "many objects and a blob",
        "too large",
        "cut short",
        "protocol 2",
        "empty",
    ],
)
def test_a_pickle_that_builds_many_objects_or_is_not_understood_goes_to_a_thread(
    data: bytes,
) -> None:
    assert not _mostly_bytes(data)


@pytest.fixture
def hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions ``_pickles`` sends to a worker thread, in order."""
    sent: list[str] = []
    off_loop = _pickles._off_loop

    async def counted(fn: Any, *args: Any) -> Any:
        sent.append(fn.__name__)
        return await off_loop(fn, *args)

    monkeypatch.setattr(_pickles, "_off_loop", counted)
    return sent


async def test_decode_keeps_a_large_bytes_message_on_the_loop_and_sends_many_objects_off_it(
    hops: list[str],
) -> None:
    blob = pickle.dumps(("echo", b"x" * 1_000_000), protocol=5)
    objects = pickle.dumps(list(range(THREAD_BYTES)), protocol=5)
    assert await decode(blob, "a blob") == ("echo", b"x" * 1_000_000)
    assert hops == []
    assert await decode(objects, "objects") == list(range(THREAD_BYTES))
    assert hops == ["_loads"]


async def test_encode_gives_up_on_the_loop_once_pickling_takes_too_long(hops: list[str]) -> None:
    class Slow:
        def __reduce__(self) -> tuple[Any, ...]:
            time.sleep(0.001)  # a reduce that takes time: the loop's budget runs out
            return (bytes, (b"z" * 70_000,))

    quick = await encode(("echo", b"x" * 1_000_000))
    assert hops == []  # 1 MB of bytes: a copy, on the loop
    slow = await encode([Slow() for _ in range(5)])
    assert hops == ["_dumps"]
    assert pickle.loads(quick.body) == ("echo", b"x" * 1_000_000)
    assert pickle.loads(slow.body) == [b"z" * 70_000] * 5
