"""Terminal output: results, the stage breakdown of their latency, consumer lag and the
replica hint of `mmpipe lag`."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rich.console import Console
from rich.table import Table

from mmpipe.capacity import (
    UTILISATION_TARGET,
    CapacityHint,
    MetricsPage,
    StageLoad,
    capacity_hint,
    combine_service,
    parse_metrics,
)
from mmpipe.schemas.settings import Settings
from mmpipe.streams.topology import PORTS_PER_STAGE, STAGE_NAMES, metrics_port
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
    console.print(results_table([result]))


async def lag_table(settings: Settings) -> Table:
    reader = LagReader(settings)
    try:
        rows = [row for stage in STAGE_NAMES for row in await reader.read_stage(stage)]
    finally:
        await reader.close()
    return partition_lag_table(rows, settings.bootstrap)


def partition_lag_table(rows: list[PartitionLag], bootstrap: str) -> Table:
    """Per group and partition, like kafka-consumer-groups --describe."""
    table = Table(title=f"consumer lag on {bootstrap}")
    for col in ("group", "topic", "partition", "end offset", "committed", "lag"):
        table.add_column(col, justify="right" if col in ("partition", "end offset", "committed", "lag") else "left")
    for row in rows:
        committed = "-" if row.committed is None else str(row.committed)
        table.add_row(row.group, row.topic, str(row.partition), str(row.end_offset), committed, str(row.lag))
    return table


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


async def take_snapshot(reader: LagReader, settings: Settings, endpoints: list[MetricsEndpoint]) -> Snapshot:
    scrapes = asyncio.gather(*(asyncio.to_thread(scrape, e.url) for e in endpoints))
    at = time.monotonic()
    partitions = {stage: await reader.read_stage(stage) for stage in STAGE_NAMES}
    pages = {
        e.url: parse_metrics(text, e.stage)
        for e, text in zip(endpoints, await scrapes)
        if text is not None
    }
    return Snapshot(at, partitions, pages)


def stage_workers(settings: Settings) -> dict[str, int]:
    """Items one replica works on at once: decode and preprocess run thread pools; inference's
    concurrency is its batch (already in the per-item time); the sink writes on one thread."""
    return {"decode": settings.decode_workers, "preprocess": settings.inference_workers, "inference": 1, "sink": 1}


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
        lag=sum(row.lag for row in rows),
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
        members = {stage: await reader.group_members(group_id(settings, stage)) for stage in STAGE_NAMES}
    finally:
        await reader.close()
    workers = stage_workers(settings)
    hints = [
        capacity_hint(stage_load(stage, before, after, workers[stage], members[stage]), target)
        for stage in STAGE_NAMES
    ]
    rows = [row for stage in STAGE_NAMES for row in after.partitions[stage]]
    return CapacityReport(settings.bootstrap, after.at - before.at, target, hints, rows, len(after.pages))


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
