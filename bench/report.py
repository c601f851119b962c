"""What the hop benchmark reports: medians over rounds, ratios of paired runs, the markdown table,
the plot of the concurrency sweep, and the top functions of a py-spy profile."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.wrk import WrkResult

MIB = 1 << 20


@dataclass
class Run:
    """One wrk run against one path, and what the measured processes spent on it."""

    result: WrkResult
    cpu_s: float
    peak_rss: int
    counters: dict[str, float] = field(default_factory=dict)  # e.g. encoder cache hits during the run

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_s / self.result.requests * 1e6 if self.result.requests else float("nan")


@dataclass
class Series:
    """The runs of one path in one scenario, one per round, in round order."""

    scenario: str
    connections: int
    path: str
    measured: str  # which processes the CPU and RSS columns are of
    runs: list[Run] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Summary:
    scenario: str
    connections: int
    path: str
    measured: str
    rounds: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    rss_mib: float
    ratio: float | None  # req/s over the reference path's, median of the rounds' ratios
    reference: str | None
    added_p50_ms: float | None  # p50 minus the direct path's p50, median of the rounds' differences
    requests: int
    non_2xx: int
    socket_errors: int
    counters: dict[str, float]


def median(values: Iterable[float]) -> float:
    items = [v for v in values if v == v]  # NaN (a run with no requests) says nothing
    return statistics.median(items) if items else float("nan")


def paired_ratios(runs: Sequence[Run], reference: Sequence[Run]) -> list[float]:
    """req/s of each round over the reference's in the same round: drift over a run hits both alike."""
    return [a.result.rps / b.result.rps for a, b in zip(runs, reference, strict=True) if b.result.rps]


def summarize(group: Sequence[Series], *, reference: str | None, direct: str | None) -> list[Summary]:
    """One summary per path of a scenario; ratios against ``reference``, added p50 against ``direct``."""
    by_path = {s.path: s for s in group}
    ref = by_path.get(reference) if reference else None
    base = by_path.get(direct) if direct else None
    out = []
    for s in group:
        results = [r.result for r in s.runs]
        ratio = median(paired_ratios(s.runs, ref.runs)) if ref is not None else None
        added = (
            median(a.result.p50_ms - b.result.p50_ms for a, b in zip(s.runs, base.runs, strict=True))
            if base is not None and s is not base
            else None
        )
        counters: Counter[str] = Counter()
        for run in s.runs:
            counters.update(run.counters)
        out.append(
            Summary(
                scenario=s.scenario,
                connections=s.connections,
                path=s.path,
                measured=s.measured,
                rounds=len(s.runs),
                rps=median(r.rps for r in results),
                p50_ms=median(r.p50_ms for r in results),
                p99_ms=median(r.p99_ms for r in results),
                cpu_us=median(r.cpu_us_per_request for r in s.runs),
                rss_mib=median(r.peak_rss / MIB for r in s.runs),
                ratio=ratio,
                reference=reference if ref is not None else None,
                added_p50_ms=added,
                requests=sum(r.requests for r in results),
                non_2xx=sum(r.non_2xx for r in results),
                socket_errors=sum(r.socket_errors for r in results),
                counters=dict(counters),
            )
        )
    return out


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def markdown_table(rows: Sequence[Summary]) -> str:
    lines = [
        "| scenario | c | path | req/s | p50 ms | p99 ms | +p50 ms vs direct | CPU µs/req | peak RSS MiB | x ref |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = "ref" if r.reference == r.path else _num(r.ratio, ".2f")
        cpu = "-" if r.measured == "-" else _num(r.cpu_us, ",.0f")
        rss = "-" if r.measured == "-" else _num(r.rss_mib, ".0f")
        lines.append(
            f"| {r.scenario} | {r.connections} | {r.path} | {_num(r.rps, ',.0f')} | {_num(r.p50_ms, '.2f')} | "
            f"{_num(r.p99_ms, '.2f')} | {_num(r.added_p50_ms, '+.2f')} | {cpu} | {rss} | {ratio} |"
        )
    return "\n".join(lines)


def plot_sweep(rows: Sequence[Summary], out: Path, *, title: str = "") -> None:
    """Throughput, p99 and throughput over the reference path's against concurrency, one line per
    path, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    levels = sorted({r.connections for r in rows})
    for i, path in enumerate(dict.fromkeys(r.path for r in rows)):
        points = sorted((r.connections, r.rps, r.p99_ms, r.ratio) for r in rows if r.path == path)
        cs, style = [p[0] for p in points], {"marker": "o", "label": path, "color": f"C{i}"}
        axes[0].plot(cs, [p[1] for p in points], **style)
        axes[1].plot(cs, [p[2] for p in points], **style)
        if path != "direct":  # several times the others: it would flatten them
            axes[2].plot(cs, [p[3] for p in points], **style)
    panels = (("throughput", "requests/s"), ("p99 latency", "ms (log)"), ("throughput / minimal proxy's", "ratio"))
    for ax, (name, unit) in zip(axes, panels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, labels=[str(c) for c in levels])
        ax.set_xlabel("concurrency (wrk connections)")
        ax.set_ylabel(unit)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[1].set_yscale("log")
    axes[2].set_ylim(0, 1.1)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=100)
    plt.close(fig)


_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>.*?)(?::\d+)?\)$")
_STDLIB = re.compile(r"^.*/lib/python3\.\d+/")


def _frame_key(frame: str) -> str:
    """``handle (/x/gateway/handlers.py:88)`` -> ``handle (gateway/handlers.py)``: one key per function."""
    match = _FRAME.match(frame)
    if not match:
        return frame
    file = match["file"]
    if "site-packages/" in file:
        file = file.rsplit("site-packages/", 1)[1]
    elif _STDLIB.match(file):
        file = _STDLIB.sub("stdlib/", file)
    elif file.startswith(str(Path.cwd()) + "/"):
        file = file[len(str(Path.cwd())) + 1 :]
    return f"{match['name']} ({file})"


@dataclass(frozen=True, slots=True)
class ProfileLine:
    function: str
    own: float  # share of the samples with this function at the top of the stack
    total: float  # share of the samples with this function anywhere on the stack


@dataclass(frozen=True, slots=True)
class Profile:
    samples: int
    areas: list[tuple[str, float]]  # own time by package (``gateway``, ``aiohttp``, ``asyncio``, ...)
    own: list[ProfileLine]
    total: list[ProfileLine]  # frames on every stack (``main``, the loop's ``run``) left out


def summarize_profile(raw: str, *, top: int = 15) -> Profile:
    """From py-spy's ``--format raw`` (``frame;frame;... count`` a line): own time by package, and
    the top functions by own time (the leaf frame) and by total time (on the stack at all). A
    frame's own time includes the C code it calls: ``Runner.run``'s is the event loop's (uvloop)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = [_frame_key(f) for f in stack.split(";")]
        own[frames[-1]] += n
        areas[_area(frames[-1])] += n
        for frame in set(frames):
            total[frame] += n
    if not samples:
        return Profile(0, [], [], [])

    def lines(counter: Counter[str], *, below: float = 1.0) -> list[ProfileLine]:
        ranked = [(f, n) for f, n in counter.most_common() if n / samples < below][:top]
        return [ProfileLine(f, own[f] / samples, total[f] / samples) for f, _ in ranked]

    shares = [(area, n / samples) for area, n in areas.most_common()]
    return Profile(samples, shares, lines(own), lines(total, below=0.99))


def _area(key: str) -> str:
    """``handle (gateway/handlers.py)`` -> ``gateway``; the event loop's own C code is its own area."""
    if key.startswith("Runner.run ("):
        return "event loop (uvloop, C)"
    file = key.rsplit(" (", 1)[-1].rstrip(")")
    return file.split("/", 1)[0] if "/" in file else file


def area_table(areas: Sequence[tuple[str, float]], *, top: int = 8) -> str:
    out = ["| package | own time |", "|---|---:|"]
    out += [f"| {area} | {share:.1%} |" for area, share in areas[:top]]
    return "\n".join(out)


def profile_table(lines: Sequence[ProfileLine]) -> str:
    out = ["| function | own | total |", "|---|---:|---:|"]
    out += [f"| `{p.function}` | {p.own:.1%} | {p.total:.1%} |" for p in lines]
    return "\n".join(out)
