"""`mmpipe top`: the operator's first screen, refreshed live.

Per stage: consumer-group members, arrivals and completions per second, lag, queue wait
p50/p99, batch sizes, restarts (from `up`'s own metrics), dead letters, and the replicas the
capacity model says are needed; above it the jobs finished per second and their end-to-end
p50/p99 (observed once per job, by the sink). Rates and percentiles cover a sliding window of
snapshots; the snapshots, scrapes and the capacity hint are report.py's, as `mmpipe lag` uses.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mmpipe.capacity import UTILISATION_TARGET
from mmpipe.report import (
    MetricsEndpoint,
    Snapshot,
    fitted,
    hints_between,
    replica_endpoints,
    scrape,
    stage_members,
    take_snapshot,
    up_endpoints,
)
from mmpipe.schemas.settings import Settings
from mmpipe.streams.kafka import LagReader
from mmpipe.supervisor import supervisor_metrics_port

Parsed = dict[str, list[Sample]]  # by URL


@dataclass(frozen=True)
class Percentiles:
    p50_ms: float | None
    p99_ms: float | None
    count: float  # observations they come from
    recent: bool  # False: none in the window, so since the processes started

    def cell(self, digits: int = 0) -> str:
        if self.p50_ms is None or self.p99_ms is None:
            return "-"
        return f"{self.p50_ms:.{digits}f}/{self.p99_ms:.{digits}f}{'' if self.recent else '*'}"


@dataclass(frozen=True)
class StageView:
    stage: str
    members: int | None
    in_per_s: float
    done_per_s: float
    lag: int
    queue_wait: Percentiles
    batch: Percentiles | None  # inference only (items per batch, not ms)
    restarts: int | None  # None: `up`'s metrics not reached
    dead_letters: int
    needed: int | None
    advice: str


@dataclass(frozen=True)
class TopFrame:
    bootstrap: str
    window_s: float
    jobs_per_s: float
    end_to_end: Percentiles
    stages: list[StageView]
    endpoints_answered: int
    supervisor_reached: bool


# --- Prometheus pages -------------------------------------------------------------------------
def parse_pages(texts: dict[str, str]) -> Parsed:
    return {url: [s for family in text_string_to_metric_families(text) for s in family.samples] for url, text in texts.items()}


def _matching(samples: Iterable[Sample], name: str, labels: dict[str, str]) -> Iterable[Sample]:
    return (s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def counter_total(pages: Parsed, name: str, **labels: str) -> float:
    return sum(s.value for samples in pages.values() for s in _matching(samples, name, labels))


def buckets(samples: Iterable[Sample], histogram: str, labels: dict[str, str]) -> dict[float, float]:
    """Cumulative bucket counts by upper bound, summed over the series matching `labels`."""
    counts: dict[float, float] = {}
    for s in _matching(samples, f"{histogram}_bucket", labels):
        le = float(s.labels["le"])
        counts[le] = counts.get(le, 0.0) + s.value
    return counts


def window_buckets(before: Parsed, after: Parsed, histogram: str, **labels: str) -> tuple[dict[float, float], bool]:
    """The bucket counts observed between two scrapes, summed over processes, and whether that
    window saw anything; if not, the counts since the processes started (recent=False)."""
    window: dict[float, float] = {}
    lifetime: dict[float, float] = {}
    for url, samples in after.items():
        now = buckets(samples, histogram, labels)
        then = buckets(before.get(url, []), histogram, labels)
        if any(now.get(le, 0.0) < count for le, count in then.items()):
            then = {}  # counters went down: the process restarted, all it counted is new
        for le, count in now.items():
            window[le] = window.get(le, 0.0) + count - then.get(le, 0.0)
            lifetime[le] = lifetime.get(le, 0.0) + count
    if window.get(math.inf, 0.0) > 0:
        return window, True
    return lifetime, False


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket holding rank q."""
    total = cumulative.get(math.inf, 0.0)
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in sorted(cumulative):
        count = cumulative[le]
        if count >= rank:
            if math.isinf(le):
                return lower  # past the last finite bound: that bound is all we know
            return lower + (le - lower) * (rank - below) / (count - below) if count > below else le
        lower, below = le, count
    return lower


def percentiles(before: Parsed, after: Parsed, histogram: str, scale: float = 1000.0, **labels: str) -> Percentiles:
    counts, recent = window_buckets(before, after, histogram, **labels)
    p50, p99 = (histogram_quantile(q, counts) for q in (0.5, 0.99))
    return Percentiles(
        None if p50 is None else p50 * scale, None if p99 is None else p99 * scale, counts.get(math.inf, 0.0), recent,
    )


# Short headers keep the table within 80 columns; the legend under it spells them out.
COLUMNS = ("stage", "mem", "in/s", "done/s", "lag", "queue", "batch", "rst", "dlq", "need")
LEGEND = (
    "mem: group members; queue: p50/p99 ms waited in the input topic; batch: p50/p99 items per inference "
    "batch; rst: restarts "
    "by `up`; dlq: dead letters; need: replicas the capacity model needs; *: nothing in the window, so since "
    "the processes started"
)


# --- One frame ---------------------------------------------------------------------------------
def build_frame(
    settings: Settings,
    before: Snapshot,
    after: Snapshot,
    members: dict[str, int | None],
    supervisor: Parsed | None,
    target: float = UTILISATION_TARGET,
) -> TopFrame:
    old, new = parse_pages(before.texts), parse_pages(after.texts)
    window = max(after.at - before.at, 1e-9)
    e2e = percentiles(old, new, "mm_end_to_end_seconds")
    jobs = e2e.count if e2e.recent else 0.0
    views = []
    for hint in hints_between(settings, before, after, members, target):
        stage = hint.stage
        restarts = None if supervisor is None else int(counter_total(supervisor, "mm_supervisor_restarts_total", stage=stage))
        views.append(StageView(
            stage=stage,
            members=hint.members,
            in_per_s=hint.arrival_per_s,
            done_per_s=hint.done_per_s,
            lag=hint.lag,
            queue_wait=percentiles(old, new, "mm_queue_wait_seconds", stage=stage),
            batch=percentiles(old, new, "mm_batch_size", scale=1.0) if stage == "inference" else None,
            restarts=restarts,
            dead_letters=int(counter_total(new, "mm_dead_letters_total", stage=stage)),
            needed=hint.needed,
            advice=hint.advice,
        ))
    return TopFrame(settings.bootstrap, window, jobs / window, e2e, views, len(after.pages), supervisor is not None)


def render(frame: TopFrame, console: Console) -> RenderableType:
    e2e = frame.end_to_end
    header = Text.assemble(
        ("mmpipe top  ", "bold"), f"{frame.bootstrap}  {frame.window_s:.0f}s window  ",
        ("jobs/s ", "dim"), f"{frame.jobs_per_s:.1f}  ",
        ("e2e p50/p99 ms ", "dim"), e2e.cell(),
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "stage" else "right")
    for v in frame.stages:
        table.add_row(
            v.stage,
            "?" if v.members is None else str(v.members),
            f"{v.in_per_s:.1f}",
            f"{v.done_per_s:.1f}",
            str(v.lag),
            v.queue_wait.cell(),
            "-" if v.batch is None else v.batch.cell(1),
            "-" if v.restarts is None else str(v.restarts),
            str(v.dead_letters),
            "-" if v.needed is None else str(v.needed),
        )
    notes = [Text(f"{v.stage}: {v.advice}") for v in frame.stages]
    footer = LEGEND + (
        "" if frame.supervisor_reached else "; restarts: `up`'s metrics not reached"
    ) + ("" if frame.endpoints_answered else "; no stage metrics reached (start with `mmpipe up`, or pass --metrics)")
    return Group(header, fitted(console, table), *notes, Text(footer, style="dim"))


# --- The loop ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopSources:
    endpoints: list[MetricsEndpoint]
    supervisor_url: str | None

    @classmethod
    def of(cls, metrics_urls: list[str] | None, metrics_base_port: int) -> TopSources:
        if metrics_urls:
            endpoints = [e for url in metrics_urls for e in replica_endpoints(url)]
        else:
            endpoints = up_endpoints(metrics_base_port) if metrics_base_port else []
        supervisor = (
            f"http://127.0.0.1:{supervisor_metrics_port(metrics_base_port)}/metrics" if metrics_base_port else None
        )
        return cls(endpoints, supervisor)


async def frames(
    settings: Settings, sources: TopSources, window_s: float, interval_s: float, target: float
) -> AsyncIterator[TopFrame]:
    """Endless frames, one per `interval_s`, each over the last `window_s` of snapshots."""
    reader = LagReader(settings)
    history: deque[Snapshot] = deque()
    try:
        history.append(await take_snapshot(reader, settings, sources.endpoints))
        while True:
            await asyncio.sleep(max(interval_s - (time.monotonic() - history[-1].at), 0.0))
            history.append(await take_snapshot(reader, settings, sources.endpoints))
            while len(history) > 2 and history[-1].at - history[1].at >= window_s:
                history.popleft()
            supervisor_text = await asyncio.to_thread(scrape, sources.supervisor_url) if sources.supervisor_url else None
            supervisor = parse_pages({"up": supervisor_text}) if supervisor_text else None
            members = await stage_members(reader, settings)
            yield build_frame(settings, history[0], history[-1], members, supervisor, target)
    finally:
        await reader.close()


async def run_top(
    settings: Settings,
    console: Console,
    sources: TopSources,
    window_s: float = 10.0,
    interval_s: float = 2.0,
    target: float = UTILISATION_TARGET,
    once: bool = False,
    on_frame: Callable[[TopFrame], None] | None = None,
) -> None:
    """Live until interrupted; with `once`, one frame over `interval_s` handed to on_frame."""
    stream = frames(settings, sources, window_s, interval_s, target)
    try:
        if once:
            frame = await anext(stream)
            (on_frame or (lambda f: console.print(render(f, console))))(frame)
            return
        with Live(Text("mmpipe top: first sample..."), console=console, auto_refresh=False) as live:
            async for frame in stream:
                live.update(render(frame, console), refresh=True)
    finally:
        await stream.aclose()

