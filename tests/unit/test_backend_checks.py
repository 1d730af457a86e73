"""Each backend's refusals (``Backend.check``) and the local start strategy; no process starts."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import pytest

from aiospawn._core._spec import LaunchSpec, make_output_spec, make_spec
from aiospawn._local._backend import LocalBackend
from aiospawn._local._limits import max_nprocs
from aiospawn._local._strategy import choose
from aiospawn.ray import check_group
from tests import ranks


def spec(nprocs: int = 2, start_method: str | None = "spawn", **options: Any) -> LaunchSpec:
    """A group of ``ranks.identity``, as the entry points make it."""
    streams = {key: options.pop(key) for key in ("stdout", "stderr", "tee") if key in options}
    output = make_output_spec(
        streams.get("stdout", "inherit"),
        streams.get("stderr", "inherit"),
        streams.get("tee", False),
        "[rank{rank}]: ",
    )
    fn = options.pop("fn", ranks.identity)
    return make_spec(fn, (), nprocs, start_method, False, output=output, **options)


@pytest.mark.parametrize(
    ("start_method", "preload", "strategy"),
    [
        ("spawn", None, "spawn"),
        ("forkserver", None, "forkserver"),
        ("fork", None, "fork"),
        (None, None, multiprocessing.get_start_method()),
        ("spawn", ["json"], "warm"),
        ("forkserver", ["json"], "warm"),
        (None, ["json"], "warm"),
    ],
)
def test_a_group_gets_the_strategy_of_its_start_method(
    start_method: str | None, preload: list[str] | None, strategy: str
) -> None:
    assert choose(spec(start_method=start_method, preload=preload)).name == strategy


def test_a_start_method_this_platform_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(
        ValueError,
        match=r"^start_method='fork' is not available on this platform; use one of 'spawn'$",
    ):
        LocalBackend().check(spec(start_method="fork"))


def test_a_fn_no_warm_rank_can_receive_is_refused_in_the_words_of_warm_starts() -> None:
    lock = threading.Lock()

    def holds_a_lock(rank: int) -> bool:
        return lock.locked()

    with pytest.raises(TypeError) as refused:
        LocalBackend().check(spec(fn=holds_a_lock, preload=["json"]))
    message = str(refused.value)
    assert "cannot be pickled, even by value, so a warm-start rank (preload=) cannot" in message
    assert message.endswith("or drop preload= and use start_method='fork'")
    assert "forkserver" not in message


def test_per_rank_options_are_not_read_for_a_group_too_large_to_hold() -> None:
    read: list[int] = []

    def stdout(rank: int) -> str:
        read.append(rank)
        return "inherit"

    too_many = max_nprocs() + 1
    with pytest.raises(ValueError, match=rf"^nprocs={too_many} is more than this process"):
        LocalBackend().check(spec(too_many, stdout=stdout))
    assert read == []


def test_per_rank_options_run_once_per_rank_however_often_they_are_read() -> None:
    read: list[int] = []

    def stdout(rank: int) -> str:
        read.append(rank)
        return "prefix"

    group = spec(3, stdout=stdout)
    backend = LocalBackend()
    backend.check(group)
    backend.check(group)
    assert group.output.for_rank(2)[0]["stdout"] == "prefix"
    assert not group.output.captures
    assert read == [0, 1, 2]


def test_ray_refuses_what_stays_on_one_machine_without_needing_ray() -> None:
    refusals = [
        (spec(preload=["json"]), "^preload= warm-starts local ranks from a template;"),
        (spec(devices=[0, 1]), r"^devices=\[0, 1\] names devices of this machine;"),
        (spec(stdout="prefix"), "^RayBackend runs ranks with stdout='inherit' only"),
        (spec(stdout=lambda rank: "devnull"), "^RayBackend runs ranks with stdout='inherit'"),
        (spec(heartbeats=True), "^heartbeat_timeout and startup_timeout are not available"),
    ]
    for group, message in refusals:
        with pytest.raises(ValueError, match=message):
            check_group(group)
    check_group(spec(devices_per_rank=1, start_method="no such method"))
