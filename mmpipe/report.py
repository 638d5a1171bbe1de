"""Terminal output: results, the stage breakdown of their latency, consumer lag and the
replica hint of `mmpipe lag`."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import socket
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
from rich.columns import Columns
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from mmpipe.capacity import (
    SHUTDOWN_MARGIN_S,
    UTILISATION_TARGET,
    CapacityHint,
    MetricsPage,
    StageLoad,
    capacity_hint,
    combine_service,
    ScalingBounds,
    parse_metrics,
    scaling_bounds,
    stage_budget_s,
    stage_workers,
)
from mmpipe.schemas.settings import Settings
from mmpipe.streams.topology import PORTS_PER_STAGE, STAGE_NAMES, metrics_port, stage_names
from mmpipe.schemas import JobResult
from mmpipe.streams.kafka import LagReader, PartitionLag, group_id

BREAKDOWN = (
    ("queue", ("queue_decode_ms", "queue_preprocess_ms", "queue_inference_ms", "queue_sink_ms")),
    ("decode", ("decode_ms",)),
    ("prep", ("preprocess_ms",)),
    ("batch wait", ("batch_wait_ms",)),
    ("execute", ("execute_ms",)),
    ("sink", ("sink_ms",)),
)


def summarize(result: JobResult) -> str:
    """One line a person can read: the top label, the speech found and what was said, the
    embedding's size."""
    p = result.prediction
    if result.status != "ok":
        return f"{(result.error or {}).get('code', result.status)}: {(result.error or {}).get('message', '')[:80]}"
    if result.modality == "image":
        top = p["labels"][0]
        return f"{top['label']} ({top['p']:.2f})"
    if result.modality == "text":
        return f"{p['dim']}-d embedding of {p['tokens']} tokens, first {p['embedding'][:3]}"
    if result.modality == "audio":
        return _speech(p)
    frames = p["frames"]
    labels = ", ".join(f"{f['t_s']:.0f}s:{f['labels'][0]['label']}" for f in frames[:3])
    audio = _speech(p["audio"]) if p.get("audio") else "no audio track"
    return f"{len(frames)} frames [{labels}{'...' if len(frames) > 3 else ''}]; {audio}"


def _speech(p: dict[str, Any]) -> str:
    segs = " ".join(f"{s['start_s']:.1f}-{s['end_s']:.1f}s" for s in p["segments"][:4])
    more = "..." if len(p["segments"]) > 4 else ""
    said = f' "{_clip(p["transcript"]["text"])}"' if p.get("transcript") else ""
    return f"speech {p['speech_s']:.1f}s of {p['duration_s']:.1f}s: {segs}{more}{said}"


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def results_table(results: list[JobResult]) -> Table:
    table = Table(title="results (times in ms)")
    for col in ("job", "status", "model", "weights", "prediction", "e2e"):
        table.add_column(col, overflow="fold")
    for name, _ in BREAKDOWN:
        table.add_column(name, justify="right")
    table.add_column("batch", justify="right")
    for r in results:
        t = r.timings
        model = f"{r.model.name}:{r.model.version}" if r.model else "-"
        row = [r.job_id, r.status, model, r.weights, summarize(r), f"{t.end_to_end_ms:.0f}"]
        row += [f"{sum(getattr(t, f) for f in fields):.0f}" for _, fields in BREAKDOWN]
        row.append(str(t.batch_size or "-"))
        table.add_row(*row)
    return table


def print_result(console: Console, result: JobResult) -> None:
    console.print(fitted(console, results_table([result])))


# --- Layout for the terminal's width, and JSON for scripts ------------------------------------
UNBOUNDED_WIDTH = 10_000
STACKED_FIELD_MAX = 36  # "column value" pairs up to this long share lines in the stacked form  # measuring a table at this width gives its natural, unwrapped width


def fitted(console: Console, table: Table) -> RenderableType:
    """The table if it fits the console unwrapped, else the same rows stacked: one block per
    row, its first cell as the heading and every other cell as "column value" beneath. A piped
    console is 80 columns wide (rich's default), so files and pipes get the stacked form too."""
    natural = Measurement.get(console, console.options.update(max_width=UNBOUNDED_WIDTH), table).maximum
    if natural <= console.width:
        return table
    return stacked(table)


def stacked(table: Table) -> Group:
    """A narrow rendering of a table's rows that keeps each value whole."""
    columns = table.columns
    parts: list[RenderableType] = []
    if table.title:
        parts.append(Text(str(table.title), style="bold"))
    for row in zip(*(column.cells for column in columns)):
        head, *cells = row
        fields = [
            Text.assemble((f"{column.header} ", "dim"), cell if isinstance(cell, Text) else str(cell))
            for column, cell in zip(columns[1:], cells)
        ]
        # Long values get a line each: one of them in the grid would force it down to one column.
        short = [f for f in fields if len(f) <= STACKED_FIELD_MAX]
        parts.append(Text(str(head), style="bold"))
        parts.append(Padding(Columns(short, padding=(0, 3)), (0, 0, 0, 2)))
        parts.extend(Padding(f, (0, 0, 0, 2)) for f in fields if len(f) > STACKED_FIELD_MAX)
    if table.caption:
        parts.append(Text(str(table.caption), style="dim"))
    return Group(*parts)


def to_jsonable(value: Any) -> Any:
    """Dataclasses and msgspec structs as plain JSON types (paths as strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def partition_json(row: PartitionLag) -> dict[str, Any]:
    return {**to_jsonable(row), "lag": row.lag, "end_behind_commit": row.lag < 0}


async def stage_lag_rows(settings: Settings) -> list[PartitionLag]:
    """Every stage group's lag on its input partitions, in topology order."""
    reader = LagReader(settings)
    try:
        return [row for stage in stage_names(settings) for row in await reader.read_stage(stage)]
    finally:
        await reader.close()


async def lag_table(settings: Settings) -> Table:
    return partition_lag_table(await stage_lag_rows(settings), settings.bootstrap)


# Why a committed offset can be past the end offset: not a bug, and nothing waits.
END_BEHIND_COMMIT_NOTE = (
    "† end offset behind the committed offset: nothing waits (lag 0). The embedded broker reports "
    "the last record batch's base offset + 1 as the end, so a producer's multi-record batches read "
    "short by the records after the first (librdkafka reads the same numbers)."
)


def partition_lag_table(rows: list[PartitionLag], bootstrap: str) -> Table:
    """Per group and partition, like kafka-consumer-groups --describe."""
    behind = any(row.lag < 0 for row in rows)
    table = Table(title=f"consumer lag on {bootstrap}", caption=END_BEHIND_COMMIT_NOTE if behind else None)
    for col in ("group", "topic", "partition", "end offset", "committed", "lag"):
        table.add_column(col, justify="right" if col in ("partition", "end offset", "committed", "lag") else "left")
    for row in rows:
        committed = "-" if row.committed is None else str(row.committed)
        table.add_row(row.group, row.topic, str(row.partition), str(row.end_offset), committed, lag_cell(row.lag))
    return table


def lag_cell(lag: int) -> str:
    return f"0 ({lag}†)" if lag < 0 else str(lag)


def waiting(rows: list[PartitionLag]) -> int:
    """Messages waiting over these partitions (an end offset behind the commit counts as 0)."""
    return sum(max(row.lag, 0) for row in rows)


# --- The replica hint ------------------------------------------------------------------------
SCRAPE_TIMEOUT_S = 1.0

ENABLE_METRICS_HINT = (
    "no stage metrics reached, so no service times: run stages with MMPIPE_METRICS_PORT set "
    "(`mmpipe up` gives each its own port from 9100) and pass --metrics http://HOST:PORT/metrics per stage"
)


@dataclass(frozen=True)
class MetricsEndpoint:
    url: str
    stage: str | None = None  # known from where it was found (up's port layout); else read from the page


def up_endpoints(base_port: int, host: str = "127.0.0.1") -> list[MetricsEndpoint]:
    """Every port `up` may have given a stage replica (those not listening cost a refused connect)."""
    return [
        MetricsEndpoint(f"http://{host}:{metrics_port(base_port, stage, j)}/metrics", stage)
        for stage in STAGE_NAMES
        for j in range(PORTS_PER_STAGE)
    ]


def replica_endpoints(url: str) -> list[MetricsEndpoint]:
    """One endpoint per IPv4 address of the URL's host: in compose a service name resolves to
    every replica of the service (as Prometheus's dns_sd_configs sees it)."""
    parts = urlsplit(url)
    if not parts.hostname:
        return [MetricsEndpoint(url)]
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return [MetricsEndpoint(url)]  # unresolvable now: scraping it reports it as unreachable
    addresses = sorted({info[4][0] for info in infos})
    if len(addresses) <= 1:
        return [MetricsEndpoint(url)]
    port = f":{parts.port}" if parts.port else ""
    return [MetricsEndpoint(urlunsplit(parts._replace(netloc=f"{address}{port}"))) for address in addresses]


def scrape(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", errors="replace")
    except (OSError, ValueError, http.client.HTTPException):
        return None


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.monotonic()
    partitions: dict[str, list[PartitionLag]]  # by stage
    pages: dict[str, MetricsPage]  # by URL, the endpoints that answered
    texts: dict[str, str] = field(default_factory=dict)  # by URL, the pages as scraped


async def take_snapshot(reader: LagReader, settings: Settings, endpoints: list[MetricsEndpoint]) -> Snapshot:
    scrapes = asyncio.gather(*(asyncio.to_thread(scrape, e.url) for e in endpoints))
    at = time.monotonic()
    partitions = {stage: await reader.read_stage(stage) for stage in stage_names(settings)}
    texts = {e.url: text for e, text in zip(endpoints, await scrapes) if text is not None}
    pages = {e.url: parse_metrics(texts[e.url], e.stage) for e in endpoints if e.url in texts}
    return Snapshot(at, partitions, pages, texts)


def stage_load(
    stage: str, before: Snapshot, after: Snapshot, workers: int, members: int | None
) -> StageLoad:
    start = {(p.topic, p.partition): p for p in before.partitions[stage]}
    rows = after.partitions[stage]
    arrived = consumed = 0
    for row in rows:
        earlier = start.get((row.topic, row.partition))
        if earlier is not None:
            arrived += max(row.end_offset - earlier.end_offset, 0)
            consumed += max((row.committed or 0) - (earlier.committed or 0), 0)
    service, recent = combine_service(before.pages, after.pages, stage)
    if members is None:
        # The broker did not say: count the processes whose metrics answered, if any.
        members = sum(1 for page in after.pages.values() if page.stage == stage) or None
    return StageLoad(
        stage=stage,
        window_s=after.at - before.at,
        arrived=arrived,
        consumed=consumed,
        lag=waiting(rows),
        partitions=max(Counter(row.topic for row in rows).values(), default=0),
        service=service,
        service_recent=recent,
        workers=workers,
        members=members,
    )


@dataclass(frozen=True)
class CapacityReport:
    bootstrap: str
    window_s: float
    target: float
    hints: list[CapacityHint]
    partitions: list[PartitionLag]  # at the end of the window
    endpoints_answered: int


async def capacity_report(
    settings: Settings,
    window_s: float,
    metrics_urls: list[str] | None = None,
    metrics_base_port: int = 0,
    target: float = UTILISATION_TARGET,
) -> CapacityReport:
    """Sample offsets (and scrape stage metrics) twice, `window_s` apart; one hint per stage."""
    if metrics_urls:
        endpoints = [e for url in metrics_urls for e in replica_endpoints(url)]
    else:
        endpoints = up_endpoints(metrics_base_port) if metrics_base_port else []
    reader = LagReader(settings)
    try:
        before = await take_snapshot(reader, settings, endpoints)
        await asyncio.sleep(max(window_s - (time.monotonic() - before.at), 0.0))
        after = await take_snapshot(reader, settings, endpoints)
        members = await stage_members(reader, settings)
    finally:
        await reader.close()
    hints = hints_between(settings, before, after, members, target)
    rows = [row for stage in stage_names(settings) for row in after.partitions[stage]]
    return CapacityReport(settings.bootstrap, after.at - before.at, target, hints, rows, len(after.pages))


async def stage_members(reader: LagReader, settings: Settings) -> dict[str, int | None]:
    return {stage: await reader.group_members(group_id(settings, stage)) for stage in stage_names(settings)}


def hints_between(
    settings: Settings, before: Snapshot, after: Snapshot, members: dict[str, int | None], target: float
) -> list[CapacityHint]:
    """One replica hint per stage from two snapshots."""
    workers = stage_workers(settings)
    return [
        capacity_hint(stage_load(stage, before, after, workers[stage], members[stage]), target)
        for stage in stage_names(settings)
    ]


def capacity_json(report: CapacityReport) -> dict[str, Any]:
    return {**to_jsonable(report), "partitions": [partition_json(row) for row in report.partitions]}


def capacity_table(report: CapacityReport) -> Table:
    table = Table(
        title=f"replica hint on {report.bootstrap} ({report.window_s:.1f} s window, target utilisation {report.target:.0%})",
        caption=(
            "needed = ceil(in/s x s/item / (workers x target));  ms/item*: mean since process start "
            "(no item in the window)" + ("" if report.endpoints_answered else "\n" + ENABLE_METRICS_HINT)
        ),
    )
    for col in ("stage", "in/s", "done/s", "lag", "ms/item", "batch", "workers", "needed", "members", "partitions", "advice"):
        table.add_column(col, justify="left" if col in ("stage", "advice") else "right")
    for h in report.hints:
        table.add_row(
            h.stage,
            f"{h.arrival_per_s:.1f}",
            f"{h.done_per_s:.1f}",
            str(h.lag),
            "-" if h.per_item_s is None else f"{h.per_item_s * 1000:.1f}{'' if h.service_recent else '*'}",
            "-" if h.mean_batch is None else f"{h.mean_batch:.1f}",
            str(h.workers),
            "-" if h.needed is None else str(h.needed),
            "?" if h.members is None else str(h.members),
            str(h.partitions),
            h.advice,
        )
    return table


# --- KEDA's numbers (`mmpipe keda`) --------------------------------------------------------------


def live_scaling_bounds(report: CapacityReport, settings: Settings, latency_budget_s: float) -> list[ScalingBounds]:
    """The bounds from what `mmpipe lag` measured: service times, arrival rates, partitions."""
    return [
        scaling_bounds(
            h.stage, h.per_item_s, h.workers, h.partitions or settings.partitions,
            latency_budget_s=latency_budget_s, arrival_per_s=h.arrival_per_s,
            max_inflight=settings.max_inflight, target=report.target,
        )
        for h in report.hints
    ]


def scaling_json(bounds: list[ScalingBounds], latency_budget_s: float, source: str) -> dict[str, Any]:
    return {"source": source, "latency_budget_s": latency_budget_s, "stage_budget_s": stage_budget_s(latency_budget_s),
            "stages": to_jsonable(bounds)}


def scaling_table(bounds: list[ScalingBounds], latency_budget_s: float, source: str) -> Table:
    share_ms = stage_budget_s(latency_budget_s) * 1000
    table = Table(
        title=f"KEDA Kafka scaler per stage ({source}; latency budget {latency_budget_s:g} s, {share_ms:.0f} ms per stage)",
        caption="lagThreshold = floor(stage budget x workers / s per item): the lag one replica clears within its "
        "share of the budget; maxReplicaCount = partitions; grace = in-flight cap x s/item / workers + "
        f"{SHUTDOWN_MARGIN_S:.0f} s",
    )
    for col in ("stage", "ms/item", "workers", "items/s per replica", "lagThreshold", "min", "max", "grace s", "note"):
        table.add_column(col, justify="left" if col in ("stage", "note") else "right")
    for b in bounds:
        measured = b.per_item_s is not None
        table.add_row(
            b.stage,
            f"{b.per_item_s * 1000:.1f}" if measured else "-",
            str(b.workers),
            f"{b.workers / b.per_item_s:.1f}" if measured else "-",
            str(b.lag_threshold) if measured else "-",
            str(b.min_replicas),
            str(b.max_replicas),
            str(b.grace_period_s) if measured else "-",
            b.note,
        )
    return table
