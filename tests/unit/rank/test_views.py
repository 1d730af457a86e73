"""A memoryview through a channel's pickling (``aiospawn._rank.views``), on every path."""

from __future__ import annotations

import array
import pickle
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest

from aiospawn._rank import buffers, channel

MiB = 1 << 20


def through_pickle_body(obj: Any) -> Any:
    return buffers.loads(buffers.pickle_body(obj, None))


def through_shared_buffers(obj: Any) -> Any:
    large: list[memoryview] = []
    body = buffers.pickle_body(obj, large)
    # What the receiver gets for the buffers that went out of band: views of them.
    return pickle.loads(body, buffers=large)


def through_channel_encode(obj: Any) -> Any:
    return pickle.loads(channel.encode(obj))


PATHS = [through_pickle_body, through_shared_buffers, through_channel_encode]

VIEWS = {
    "bytes": memoryview(bytearray(b"ab" * 50)),
    "read-only": memoryview(b"cd" * 50),
    "ints, 2-d": memoryview(bytearray(range(24))).cast("i", (2, 3)),
    "doubles, 0-d": memoryview(bytes(8)).cast("d", ()),
    "strided": memoryview(bytearray(range(200)))[::3],
    "large": memoryview(bytearray(b"\x05") * (2 * MiB)),
    "large, read-only": memoryview(bytes(2 * MiB)),
    "empty": memoryview(bytearray()),
    "empty ints": memoryview(array.array("i")),
    "empty, strided": memoryview(bytearray(range(10)))[5:5:2],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(VIEWS))
def test_a_view_comes_back_with_its_format_shape_flag_and_bytes(
    path: Callable[[Any], Any], name: str
) -> None:
    sent = VIEWS[name]
    got = path({"view": sent})["view"]
    assert isinstance(got, memoryview)
    assert (got.format, got.shape, got.readonly) == (sent.format, sent.shape, sent.readonly)
    assert got.tobytes() == sent.tobytes()


def test_a_large_view_goes_out_of_band() -> None:
    large: list[memoryview] = []
    body = buffers.pickle_body(VIEWS["large"], large)
    assert [view.nbytes for view in large] == [2 * MiB]
    assert len(body) < 1024


def test_a_view_of_a_format_the_receiver_could_not_rebuild_is_refused() -> None:
    np = pytest.importorskip("numpy", reason="numpy (the test extra) makes such views")
    assert through_pickle_body(memoryview(bytearray(8)).cast("c")).format == "c"
    for made in (np.zeros(4, dtype=np.float16), np.zeros(2, dtype=[("a", "i4")])):
        view = memoryview(made)
        wanted = re.escape(f"cannot pickle a memoryview of format {view.format!r}")
        with pytest.raises(TypeError, match=wanted):
            buffers.pickle_body(view, None)


def test_an_empty_view_of_several_dimensions_is_refused() -> None:
    np = pytest.importorskip("numpy", reason="numpy (the test extra) makes such views")
    view = memoryview(np.zeros((0, 3), dtype=np.int32))
    with pytest.raises(TypeError, match=re.escape("empty memoryview of shape (0, 3)")):
        buffers.pickle_body(view, None)


def test_an_object_pickle_refuses_fails_with_pickles_own_error() -> None:
    with pytest.raises(TypeError, match=r"cannot pickle '_thread\.lock' object"):
        buffers.pickle_body(threading.Lock(), None)
    with pytest.raises(TypeError, match="cannot send lock over the channel"):
        channel.encode(threading.Lock())
