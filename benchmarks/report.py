"""The report: machine, per-scenario tables, target checks, and the bar chart."""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from harness import ScenarioResult, Series


@dataclass(frozen=True, slots=True, kw_only=True)
class Check:
    """One target, checked against one row of figures."""

    target: str
    row: str
    figure: str
    verdict: str  # "pass", "fail" or "n/a"


def machine(*, ray: bool = False, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """What the figures depend on: cores, CPU, Python, kernel, versions (Ray's, ``extra``), date."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = []
    names = ("aiospawn", "anyio", "torch", *(("ray",) if ray else ()), *extra)
    for name in dict.fromkeys(names):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": str(os.cpu_count()),
        "cpu": model,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "kernel": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "versions": ", ".join(versions),
    }


def fmt(value: float) -> str:
    """Three significant figures, without scientific notation for everyday sizes."""
    if math.isnan(value):
        return "-"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, 2 - magnitude)
    return f"{value:,.{decimals}f}"


def higher_is_better(unit: str) -> bool:
    """Rates (``MB/s``) are better higher; every other figure is better lower."""
    return unit.endswith("/s")


def _best_medians(series: Iterable[Series]) -> dict[tuple[str, str], float]:
    best: dict[tuple[str, str], float] = {}
    for item in series:
        key = (item.case, item.metric)
        if higher_is_better(item.unit):
            best[key] = max(best.get(key, 0.0), item.median)
        else:
            best[key] = min(best.get(key, math.inf), item.median)
    return best


def _floor_median(result: ScenarioResult, case: str, metric: str) -> float | None:
    """The median of the case's floor peer (``result.floors``) for ``metric``, if measured."""
    floor = result.floors.get(case)
    for item in result.series:
        if (item.case, item.metric, item.peer) == (case, metric, floor):
            return item.median
    return None


def _ratio_to_floor(result: ScenarioResult, item: Series) -> str:
    reference = _floor_median(result, item.case, item.metric)
    if reference is None or reference <= 0 or higher_is_better(item.unit):
        return "-"
    return f"{item.median / reference:.2f}x"


def scenario_table(result: ScenarioResult) -> str:
    """The Markdown table of one scenario: a row per case, metric and peer.

    A scenario that names a floor per case (``result.floors``) gets a column
    more: each median divided by the floor's.
    """
    floors = bool(result.floors)
    lines = [
        "| case | metric | peer | median | p95 | ratio to best |"
        + (" ratio to floor |" if floors else "")
        + " n |",
        "|---|---|---|---:|---:|---:|" + ("---:|" if floors else "") + "---:|",
    ]
    best = _best_medians(result.series)
    order = {peer: index for index, peer in enumerate(dict.fromkeys(s.peer for s in result.series))}
    cases = list(dict.fromkeys(s.case for s in result.series))
    metrics = list(dict.fromkeys(s.metric for s in result.series))
    rows = sorted(
        result.series,
        key=lambda s: (cases.index(s.case), metrics.index(s.metric), order[s.peer]),
    )
    for item in rows:
        reference = best[(item.case, item.metric)]
        if higher_is_better(item.unit):
            ratio = f"{reference / item.median:.2f}x" if item.median > 0 else "-"
        else:
            ratio = f"{item.median / reference:.2f}x" if reference > 0 else "-"
        to_floor = f" {_ratio_to_floor(result, item)} |" if floors else ""
        lines.append(
            f"| {item.case} | {item.metric} | {item.peer} | {fmt(item.median)} | {fmt(item.p95)}"
            f" | {ratio} |{to_floor} {len(item.samples)} |"
        )
    return "\n".join(lines)


def floor_matrix(result: ScenarioResult) -> str:
    """Peers down, cases across: each case's first metric, with its ratio to the case's floor.

    Then, for the cases that measured it, the event loop's worst gap. Only for a
    scenario that names its floors (``result.floors``); else the empty string.
    """
    if not result.floors:
        return ""
    cases = list(dict.fromkeys(s.case for s in result.series))
    peers = list(dict.fromkeys(s.peer for s in result.series))
    found = {(s.case, s.metric, s.peer): s for s in result.series}
    first = {case: next(s.metric for s in result.series if s.case == case) for case in cases}
    out = []
    for title, columns in (
        ("Medians, and their ratio to the floor (the floor's own row reads 1.00x)", first),
        (
            "The event loop's worst gap during each request [ms] (1 ms ticker)",
            {
                case: "worst loop gap [ms]"
                for case in cases
                if any(key[:2] == (case, "worst loop gap [ms]") for key in found)
            },
        ),
    ):
        if not columns:
            continue
        out += [
            f"{title}:",
            "",
            "| peer | "
            + " | ".join(f"{case} [{columns[case].rpartition('[')[2]}" for case in columns)
            + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for peer in peers:
            cells = []
            for case, metric in columns.items():
                item = found.get((case, metric, peer))
                if item is None:
                    cells.append("-")
                    continue
                ratio = _ratio_to_floor(result, item)
                cells.append(
                    fmt(item.median)
                    if ratio == "-" or "gap" in metric
                    else f"{fmt(item.median)} ({ratio})"
                )
            out.append(f"| {peer} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _median(
    results: dict[str, ScenarioResult], scenario: str, case: str, metric: str, peer: str
) -> float | None:
    result = results.get(scenario)
    if result is None:
        return None
    for item in result.series:
        if (item.case, item.metric, item.peer) == (case, metric, peer):
            return item.median
    return None


def _ratio_check(
    target: str,
    row: str,
    ours: float | None,
    theirs: float | None,
    passes: Callable[[float, float], bool],
    label: str,
) -> Check:
    if ours is None or theirs is None:
        return Check(target=target, row=row, figure="no data", verdict="n/a")
    figure = f"aiospawn {fmt(ours)} vs {label} {fmt(theirs)} ({ours / theirs:.2f}x)"
    return Check(
        target=target, row=row, figure=figure, verdict="pass" if passes(ours, theirs) else "fail"
    )


def _bound_check(target: str, row: str, value: float | None, bound: float, unit: str) -> Check:
    if value is None:
        return Check(target=target, row=row, figure="no data", verdict="n/a")
    return Check(
        target=target,
        row=row,
        figure=f"{fmt(value)} {unit} (bound {fmt(bound)})",
        verdict="pass" if value < bound else "fail",
    )


def _against_peers(
    results: dict[str, ScenarioResult],
    scenario: str,
    metrics: tuple[str, ...],
    targets: list[tuple[str, str, Callable[[float, float], bool]]],
) -> list[Check]:
    """aiospawn's median against each ``(target, peer, passes)``, for every case and metric.

    A row names the case, and the metric too when there are several.
    """
    found: list[Check] = []
    if scenario not in results:
        return found
    for case in dict.fromkeys(s.case for s in results[scenario].series):
        for metric in metrics:
            row = case if len(metrics) == 1 else f"{case}, {metric}"
            ours = _median(results, scenario, case, metric, "aiospawn")
            for target, peer, passes in targets:
                theirs = _median(results, scenario, case, metric, peer)
                found.append(_ratio_check(target, row, ours, theirs, passes, peer))
    return found


def checks(results: dict[str, ScenarioResult]) -> list[Check]:
    """Every target of the brief, checked on the medians."""
    found: list[Check] = []
    found += _against_peers(
        results,
        "startup",
        ("all running [ms]", "joined [ms]"),
        [
            (
                "start-up within 1.2x of multiprocessing",
                "multiprocessing",
                lambda a, b: a <= 1.2 * b,
            ),
            ("start-up faster than torch", "torch", lambda a, b: a < b),
        ],
    )
    found += _against_peers(
        results,
        "small_parent",
        ("later group [ms]",),
        [
            (
                "small parent: a later group within 1.2x of multiprocessing",
                "multiprocessing",
                lambda a, b: a <= 1.2 * b,
            )
        ],
    )
    found += _against_peers(
        results,
        "small_parent",
        ("first group [ms]",),
        [
            (
                "small parent: the first group within 1.5x of multiprocessing",
                "multiprocessing",
                lambda a, b: a <= 1.5 * b,
            )
        ],
    )
    found += _against_peers(
        results,
        "large_arg",
        ("all running [ms]",),
        [
            (
                "large-arg start >= 3x faster than torch sequential",
                "torch sequential",
                lambda a, b: 3 * a <= b,
            ),
            (
                "large-arg start no slower than torch parallel",
                "torch parallel",
                lambda a, b: a <= b,
            ),
        ],
    )
    if "failure" in results:
        for case in dict.fromkeys(s.case for s in results["failure"].series):
            join = _median(results, "failure", case, "raised [ms]", "aiospawn join")
            torch = _median(results, "failure", case, "raised [ms]", "torch join")
            if torch is None:
                # The < 2 ms bound is for aiospawn's own setting: a parent without torch,
                # whose forked ranks the kernel ends in about 0.5 ms (see the scenario's notes).
                group = _median(results, "failure", case, "detected [ms]", "aiospawn open_group")
                found.append(
                    _bound_check("failure detection < 2 ms (join raised)", case, join, 2.0, "ms")
                )
                found.append(
                    _bound_check(
                        "failure detection < 2 ms (open_group body cancelled)",
                        case,
                        group,
                        2.0,
                        "ms",
                    )
                )
            else:
                found.append(
                    _ratio_check(
                        "failure detection within 1.5x of torch's blocking join",
                        case,
                        join,
                        torch,
                        lambda a, b: a <= 1.5 * b,
                        "torch join",
                    )
                )
    if "lag" in results:
        for case in dict.fromkeys(s.case for s in results["lag"].series):
            value = _median(results, "lag", case, "max lag [ms]", "aiospawn")
            found.append(_bound_check("event-loop max lag < 20 ms", case, value, 20.0, "ms"))
    if "teardown" in results:
        for case in dict.fromkeys(s.case for s in results["teardown"].series):
            if "all honour" in case:
                value = _median(results, "teardown", case, "teardown [ms]", "aiospawn")
                found.append(
                    _bound_check("teardown of cooperative ranks < 200 ms", case, value, 200.0, "ms")
                )
    if "idle" in results:
        for case in dict.fromkeys(s.case for s in results["idle"].series):
            value = _median(results, "idle", case, "CPU while asleep [% of a core]", "aiospawn")
            found.append(
                _bound_check("idle supervisor CPU < 0.5 % of a core", case, value, 0.5, "%")
            )
    found += _against_peers(
        results,
        "cli",
        ("start to exit [ms]",),
        [
            (
                "launcher within 1.5x of two plain python runs",
                "python x2",
                lambda a, b: a <= 1.5 * b,
            ),
            ("launcher >= 5x faster than torchrun", "torchrun", lambda a, b: 5 * a <= b),
        ],
    )
    if "warm" in results:
        case, metric = "8 torch ranks", "all running [ms]"
        ours = _median(results, "warm", case, metric, "aiospawn")
        for target, peer, passes in (
            ("warm start >= 30x faster than torch spawn", "torch", lambda a, b: 30 * a <= b),
            (
                "warm start within 1.2x of a preloaded multiprocessing forkserver",
                "multiprocessing forkserver + preload",
                lambda a, b: a <= 1.2 * b,
            ),
        ):
            theirs = _median(results, "warm", case, metric, peer)
            found.append(_ratio_check(target, case, ours, theirs, passes, peer))
        restart = _median(
            results, "warm", "restart", "failure to restarted run's first line [ms]", "aiospawn"
        )
        found.append(
            _bound_check("warm restart of a torch rank < 100 ms", "restart", restart, 100.0, "ms")
        )
    found += _live_checks(results)
    found += _dataplane_checks(results)
    return found


def _live_checks(results: dict[str, ScenarioResult]) -> list[Check]:
    """The live-ranks targets (issue 14); case names carry the trial sizes, so match a prefix."""
    if "live" not in results:
        return []

    def case(prefix: str) -> str:
        for item in results["live"].series:
            if item.case.startswith(prefix):
                return item.case
        return prefix

    def median(row: str, metric: str, peer: str) -> float | None:
        return _median(results, "live", row, metric, peer)

    floor = "raw Pipe, loop in a thread"
    small, stream, call = case("round trip, 64 B"), case("throughput"), case("collective call")
    found = [
        _ratio_check(
            "64 B round trip p50 within 1.5x of the raw pipe",
            small,
            median(small, "p50 [µs]", "aiospawn"),
            median(small, "p50 [µs]", floor),
            lambda a, b: a <= 1.5 * b,
            floor,
        )
    ]
    for metric in ("to rank [MB/s]", "from rank [MB/s]"):
        found.append(
            _ratio_check(
                "1 MB throughput >= 0.7x the raw pipe",
                f"{stream}, {metric}",
                median(stream, metric, "aiospawn"),
                median(stream, metric, floor),
                lambda a, b: a >= 0.7 * b,
                floor,
            )
        )
    found.append(
        _ratio_check(
            "8-rank call p50 within 2x one round trip (64 B channel p50)",
            call,
            median(call, "p50 [µs]", "aiospawn"),
            median(small, "p50 [µs]", "aiospawn"),
            lambda a, b: a <= 2 * b,
            "aiospawn 64 B round trip",
        )
    )
    lag = case("1 GB streaming")
    found.append(
        _bound_check(
            "event-loop max lag < 20 ms while 1 GB streams",
            lag,
            median(lag, "max lag [ms]", "aiospawn"),
            20.0,
            "ms",
        )
    )
    return found


def _dataplane_checks(results: dict[str, ScenarioResult]) -> list[Check]:
    """Issue 26's targets: aiospawn against the floors, measured in the same run."""
    result = results.get("dataplane")
    if result is None:
        return []

    def median(case: str, metric: str, peer: str) -> float | None:
        return _median(results, "dataplane", case, metric, peer)

    found = []
    small = [case for case in result.floors if case.startswith("64 B round trip")]
    for case, peer, metric, bound in (
        *((case, "aiospawn channel", "p50 [µs]", 1.5) for case in small[:1]),
        *((case, "aiospawn ctx.call", "p50 [µs]", 2.0) for case in small[:1]),
        *((case, "aiospawn ctx.call", "p50 [µs]", 1.3) for case in small[1:2]),
        *(
            (case, "aiospawn channel", "p50 [ms]", 1.5)
            for case in result.floors
            if case.startswith("1 MB")
        ),
        *(
            (case, peer, "time [ms]", 0.35 if case.endswith(" 1 rank") else 0.25)
            for case in result.floors
            if case.startswith("100 MB") and " to " in case
            for peer in ("aiospawn channel", "aiospawn ctx.call")
        ),
    ):
        floor = result.floors[case]
        found.append(
            _ratio_check(
                f"{peer} within {bound}x of the {floor}",
                f"{case}, {metric}",
                median(case, metric, peer),
                median(case, metric, floor),
                lambda a, b, bound=bound: a <= bound * b,
                floor,
            )
        )
    for case in result.floors:
        for peer in ("aiospawn channel", "aiospawn ctx.call"):
            gap = median(case, "worst loop gap [ms]", peer)
            if gap is not None:
                found.append(
                    _bound_check(f"{peer}: the loop's worst gap < 20 ms", case, gap, 20.0, "ms")
                )
    return found


def markdown(
    results: list[ScenarioResult],
    host: dict[str, str],
    *,
    mode: str,
    failures: list[str],
    chart: str | None,
) -> str:
    """The whole report as Markdown."""
    by_name = {result.name: result for result in results}
    out = [
        "# aiospawn benchmarks",
        "",
        f"- Date: {host['date']}",
        f"- Machine: {host['cores']} cores, {host['cpu']}",
        f"- Python: {host['python']}; kernel: {host['kernel']}",
        f"- Versions: {host['versions']}",
        f"- Mode: {mode}",
        "- Bytecode: cached, as for an installed package (the workers unset"
        " PYTHONDONTWRITEBYTECODE and write .pyc files under benchmarks/.cache/pycache).",
        "- Load average (1, 5, 15 min) before and after each scenario is listed with it;"
        " above about 1.0 on this machine the figures are noisy.",
        "",
        "Figures are medians and 95th percentiles over the trials (n); 'ratio to best' divides"
        " a peer's median by the best median of the same case and metric. Peers run in"
        " alternation within each case. Lower is better everywhere but for rates (MB/s), where"
        " 'ratio to best' divides the best median by the peer's.",
        "",
    ]
    if chart:
        out += [f"![bar chart]({chart})", ""]
    found = checks(by_name)
    if found:
        passed = sum(check.verdict == "pass" for check in found)
        failed = sum(check.verdict == "fail" for check in found)
        out += [
            f"## Targets: {passed} pass, {failed} fail",
            "",
            "| target | row | figures (medians) | verdict |",
            "|---|---|---|---|",
        ]
        out += [
            f"| {check.target} | {check.row} | {check.figure} | **{check.verdict.upper()}** |"
            for check in found
        ]
        out.append("")
    for failure in failures:
        out += [f"**{failure}**", ""]
    for number, result in enumerate(results, 1):
        before = ", ".join(f"{value:.2f}" for value in result.load_before)
        after = ", ".join(f"{value:.2f}" for value in result.load_after)
        out += [f"## {number}. {result.title} (`--only {result.name}`)", ""]
        if result.skipped:
            out += [f"Skipped: {result.skipped}", ""]
            continue
        out += [
            f"Load average before: {before}; after: {after}; took {result.seconds:.0f} s.",
            "",
        ]
        matrix = floor_matrix(result)
        if matrix:
            out += [matrix, ""]
        out += [scenario_table(result), ""]
        out += [f"- {note}" for note in result.notes]
        out.append("")
    return "\n".join(out)


#: One color per peer, the same in every panel: aiospawn blue, torch warm, baselines grey-green.
_COLORS = {
    "aiospawn": "#1f77b4",
    "aiospawn join": "#1f77b4",
    "aiospawn open_group": "#6baed6",
    "torch": "#ff7f0e",
    "torch join": "#ff7f0e",
    "torch in thread": "#ff7f0e",
    "torch sequential": "#d62728",
    "torch parallel": "#ff7f0e",
    "torch-style loop": "#ff7f0e",
    "multiprocessing": "#2ca02c",
    "multiprocessing in thread": "#2ca02c",
    "floor: join the failing rank": "#2ca02c",
    "polling 0.1 s": "#9467bd",
    "idle loop": "#7f7f7f",
    "torchrun": "#ff7f0e",
    "python x2": "#2ca02c",
    "ray": "#1f77b4",
    "local (spawn)": "#2ca02c",
}


def _color(peer: str) -> str:
    return _COLORS.get(peer, "#8c564b")


def plot(results: list[ScenarioResult], path: str) -> bool:
    """A grouped bar chart per scenario and unit: medians, with the p95 as an error bar.

    Returns False, writing nothing, when no scenario has figures (all skipped or failed).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[Series]]] = []
    for result in results:
        units = dict.fromkeys(s.unit for s in result.series)
        for unit in units:
            chosen = [s for s in result.series if s.unit == unit]
            panels.append((f"{result.title} [{unit}]", chosen))
    if not panels:
        return False
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(16, 4.2 * rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, (title, chosen) in zip(axes.flat, panels, strict=False):
        groups = list(dict.fromkeys((s.case, s.metric) for s in chosen))
        peers = list(dict.fromkeys(s.peer for s in chosen))
        width = 0.8 / len(peers)
        for index, peer in enumerate(peers):
            color = _color(peer)
            xs, heights, errors = [], [], []
            for position, (case, metric) in enumerate(groups):
                for item in chosen:
                    if (item.case, item.metric, item.peer) == (case, metric, peer):
                        xs.append(position + (index - (len(peers) - 1) / 2) * width)
                        heights.append(item.median)
                        errors.append(max(0.0, item.p95 - item.median))
            axis.bar(
                xs,
                heights,
                width,
                label=peer,
                color=color,
                yerr=[[0] * len(errors), errors],
                capsize=2,
            )
        labels = [f"{case}\n{metric.rpartition(' [')[0]}" for case, metric in groups]
        axis.set_xticks(range(len(groups)), labels, fontsize=7, rotation=25, ha="right")
        positive = [s.median for s in chosen if s.median > 0]
        if positive and max(positive) / min(positive) > 30:
            axis.set_yscale("log")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=7)
        axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
