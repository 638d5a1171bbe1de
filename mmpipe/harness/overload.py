"""Overload run: 10x the sustainable arrival rate for a while, then back to nothing.

Checks the overload contract: every stage's peak RSS stays within the memory budget, admitted
jobs (not rejected by admission control) meet their deadline at p99, and all consumer lag
returns to zero afterwards. Used by the overload test (short) and `mmpipe overload` (60 s).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import orjson

from mmpipe.harness.bench.resources import ResourceSampler
from mmpipe.client import Publisher, make_event
from mmpipe.schemas.settings import BatchingSettings, Settings
from mmpipe.stages.sink.store import count_results, open_store
from mmpipe.streams.topology import stage_names
from mmpipe.supervisor import Pipeline
from mmpipe.streams.kafka import LagReader


@dataclass
class OverloadReport:
    sustainable_rate: float
    arrival_rate: float
    seconds: float
    deadline_s: float
    published: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    admitted: int = 0
    admitted_p50_ms: float = 0.0
    admitted_p99_ms: float = 0.0
    admitted_within_deadline: float = 0.0  # fraction of admitted jobs that finished ok in time
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    memory_budget_mb: float = 0.0
    recovered_s: float | None = None  # seconds from the end of arrivals to zero lag everywhere

    def as_dict(self) -> dict:
        return asdict(self)

    def checks(self) -> dict[str, bool]:
        """The overload contract, each part checked (what `mmpipe overload` exits on)."""
        return {
            "admitted_p99_within_deadline": self.admitted > 0 and self.admitted_p99_ms <= self.deadline_s * 1000,
            "rss_within_budget": all(mb <= self.memory_budget_mb for mb in self.peak_rss_mb.values()),
            "lag_back_to_zero": self.recovered_s is not None,
            "every_job_answered": sum(self.statuses.values()) == self.published,
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.as_dict(), option=orjson.OPT_INDENT_2)


def overload_settings(base: Settings, service_ms: float) -> Settings:
    """Small bounds in front of the model, so what is queued there is well under one deadline
    of work; the model is the bottleneck (service_ms per item, no batching)."""
    return base.model_copy(update=dict(
        models=["all-minilm-l6-v2"],
        default_batching=BatchingSettings(mode="off"),
        inject_execute_delay_ms=service_ms,
        admission_policy="reject",
        # What may wait in front of the model (decode backlog + the two topics between the
        # stages + in-flight items) is ~16 jobs: ~3 s at the model's rate, under the deadline.
        # The low mark must cover the next stage's in-flight items (taken but not yet
        # committed, so still counted as its lag), or the upstream stage never resumes.
        partitions=1,
        max_backlog=4,
        downstream_lag_high=4, downstream_lag_low=2,
        inflight_high_per_partition=2, inflight_low_per_partition=0, max_inflight=2,
        stream_buffer_maxsize=2, max_poll_records=2,
        # Bounds this small are only as good as the control loop that enforces them: read lag
        # and commit offsets often, or the model starves between pauses.
        lag_interval_s=0.1, commit_interval_s=0.1,
    ))


# The admission point and the sink see every job, admitted or not: they get room to keep up
# with the full arrival rate (their memory per job is a few KB). Inference must not wait on
# the sink's backlog, which holds the rejections too.
FAST_LANE = dict(inflight_high_per_partition=64, inflight_low_per_partition=16, max_inflight=128,
                 stream_buffer_maxsize=64, max_poll_records=64)
OVERLOAD_OVERRIDES = {
    ("decode", 0): FAST_LANE,
    ("sink", 0): FAST_LANE,
    ("inference", 0): {"downstream_lag_high": 100_000, "downstream_lag_low": 0},
}


async def _publish_at(settings: Settings, rate: float, seconds: float, deadline_s: float) -> list[str]:
    ids = []
    async with Publisher(settings) as publisher:
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < seconds:
            event = make_event("text", text=f"overload job {n}", deadline_s=deadline_s)
            await publisher.publish(event)
            ids.append(event.job_id)
            n += 1
            await asyncio.sleep(max(start + n / rate - time.monotonic(), 0))
    return ids


async def _await_recovery(settings: Settings, published: int, timeout_s: float) -> float | None:
    """Seconds until every published job is stored and no stage group lags; None if that
    takes longer than `timeout_s`. One lag reader serves every poll."""
    start = time.monotonic()
    reader = LagReader(settings)
    try:
        while time.monotonic() - start < timeout_s:
            if await asyncio.to_thread(count_results, settings.store_url) >= published:
                lag = [row.lag for stage in stage_names(settings) for row in await reader.read_stage(stage)]
                if sum(max(value, 0) for value in lag) == 0:
                    return round(time.monotonic() - start, 1)
            await asyncio.sleep(0.5)
        return None
    finally:
        await reader.close()


def run_overload(pipeline: Pipeline, sustainable_rate: float, factor: float, seconds: float,
                 deadline_s: float, recover_timeout_s: float = 180) -> OverloadReport:
    settings = pipeline.settings
    report = OverloadReport(sustainable_rate, sustainable_rate * factor, seconds, deadline_s,
                            memory_budget_mb=settings.memory_budget_bytes / 2**20)
    sampler = ResourceSampler(interval_s=0.25)
    for proc in pipeline.processes:
        sampler.watch(proc.name, proc.process.pid)
    sampler.start()
    try:
        ids = asyncio.run(_publish_at(settings, report.arrival_rate, seconds, deadline_s))
        report.published = len(ids)
        report.recovered_s = asyncio.run(_await_recovery(settings, len(ids), recover_timeout_s))
    finally:
        sampler.stop()
    report.peak_rss_mb = {name: round(rss / 2**20, 1) for name, rss in sorted(sampler.peak_rss.items())}
    _summarise_results(report, settings, ids)
    return report


def _summarise_results(report: OverloadReport, settings: Settings, ids: list[str]) -> None:
    store = open_store(settings.store_url)
    try:
        results = [r for r in (store.get_result(job_id) for job_id in ids) if r is not None]
    finally:
        store.close()
    report.statuses = dict(Counter(r.status for r in results))
    admitted = [r for r in results if r.status != "rejected"]
    report.admitted = len(admitted)
    if not admitted:
        return
    # An admitted job that expired missed its deadline: count it at the deadline or later.
    latencies = np.array([
        r.timings.end_to_end_ms if r.status == "ok" else max(r.timings.end_to_end_ms, report.deadline_s * 1000)
        for r in admitted
    ])
    report.admitted_p50_ms = round(float(np.percentile(latencies, 50)), 1)
    report.admitted_p99_ms = round(float(np.percentile(latencies, 99)), 1)
    in_time = sum(1 for r in admitted if r.status == "ok" and r.timings.end_to_end_ms <= report.deadline_s * 1000)
    report.admitted_within_deadline = round(in_time / len(admitted), 4)
