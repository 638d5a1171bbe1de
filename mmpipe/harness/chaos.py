"""Fault runs: real stage processes killed with SIGKILL mid-run, consumers added and removed,
the store locked; then every job's result is counted in the store and on the results topic.

Used by the fault tests (small N) and by `mmpipe chaos` (N >= 2,000) for the README's report.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from mmpipe.stages.decode import samples
from mmpipe.client import Publisher, follow_results, make_event
from mmpipe.schemas.settings import Settings
from mmpipe.stages.sink.store import StoreUnavailable, count_results, open_store
from mmpipe.streams.faults import fired
from mmpipe.streams.topology import STAGE_NAMES
from mmpipe.supervisor import Pipeline
from mmpipe.schemas import MediaEvent, ModelRef, to_json


@dataclass
class ChaosReport:
    jobs: int = 0
    bad_inputs: int = 0
    kills: list[str] = field(default_factory=list)
    rebalances: list[str] = field(default_factory=list)
    stored_results: int = 0
    missing: list[str] = field(default_factory=list)  # published, no stored result
    topic_records: int = 0  # records on the results topic (redeliveries included)
    topic_jobs: int = 0  # distinct job ids on the results topic
    jobs_with_conflicting_results: list[str] = field(default_factory=list)  # >1 distinct result
    topic_differs_from_store: list[str] = field(default_factory=list)  # a topic record != the stored row
    conflicts: int = 0  # rows in the store's conflicts table (replays that disagreed)
    fault_points_fired: list[str] = field(default_factory=list)  # named crash points (streams/faults.py)
    missing_on_topic: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    bad_input_reasons: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def lost(self) -> int:
        return len(self.missing) + len(self.missing_on_topic)

    @property
    def duplicated(self) -> int:
        return len(self.jobs_with_conflicting_results)

    def to_json(self) -> bytes:
        return orjson.dumps({**asdict(self), "lost": self.lost, "duplicated": self.duplicated},
                            option=orjson.OPT_INDENT_2)


def workload(jobs: int, seed: int = 0) -> list[MediaEvent]:
    """A mix of small real inputs: texts, inline PNG images, inline WAV snippets, and
    multi-part jobs beside them: 2 s videos (two sampled frames and an audio track: three
    parts, assembled from three inference answers)."""
    image = samples.encode_image(samples.synthetic_picture(96, 72, seed=seed))
    audio = samples.encode_audio(samples.tone_pcm(0.5))
    video = samples.encode_video(seconds=2.0, width=96, height=72, fps=10, audio=samples.tone_pcm(2.0), seed=seed)
    payloads = {"image": {"data": image}, "audio": {"data": audio}, "video": {"data": video}}
    events = []
    for i in range(jobs):
        kind = ("text", "image", "video", "text", "audio")[i % 5]
        job_id = f"chaos-{seed}-{i:06d}"
        if kind == "text":
            events.append(make_event("text", text=f"fault run sentence number {i}", job_id=job_id))
        else:
            events.append(make_event(kind, job_id=job_id, **payloads[kind]))
    return events


def bad_workload(count: int) -> list[tuple[bytes, bytes]]:
    """Inputs that must each end as a failed job with a reason, never stall anything."""
    corrupt_png = samples.corrupt(samples.encode_image(samples.synthetic_picture(64, 48)))
    kinds = [
        lambda j: b'{"job_id": "%s", "modality": ' % j.encode(),
        lambda j: to_json(make_event("image", data=corrupt_png, job_id=j)),
        lambda j: to_json(make_event("image", data=b"x", model=ModelRef("resnet18", "v0"), job_id=j)),
        lambda j: to_json(make_event("audio", uri="/etc/hostname", job_id=j)),
    ]
    return [(f"chaos-bad-{i:05d}".encode(), kinds[i % len(kinds)](f"chaos-bad-{i:05d}")) for i in range(count)]


class ChaosRun:
    """One pipeline, a publishing thread, and a list of disruptions applied as results arrive."""

    def __init__(self, pipeline: Pipeline, events: list[MediaEvent], bad: list[tuple[bytes, bytes]], rate: float) -> None:
        self.pipeline = pipeline
        self.settings = pipeline.settings
        self.events = events
        self.bad = bad
        self.rate = rate
        self.report = ChaosReport(jobs=len(events), bad_inputs=len(bad))
        self._publisher = threading.Thread(target=lambda: asyncio.run(self._publish()), daemon=True)

    async def _publish(self) -> None:
        async with Publisher(self.settings) as publisher:
            interval = 1.0 / self.rate if self.rate else 0.0
            bad = iter(self.bad)
            start = time.monotonic()
            for n, event in enumerate(self.events):
                await publisher.publish(event)
                if n % 10 == 5:  # bad inputs interleaved with good ones
                    item = next(bad, None)
                    if item is not None:
                        await publisher.publish_raw(*item)
                if interval:
                    await asyncio.sleep(max(start + (n + 1) * interval - time.monotonic(), 0))
            for item in bad:
                await publisher.publish_raw(*item)

    def stored(self) -> int:
        try:
            return count_results(self.settings.store_url)
        except StoreUnavailable:
            return 0  # locked or down: no progress to report yet

    def wait_progress(self, fraction: float, timeout_s: float = 600) -> None:
        target = int(fraction * (len(self.events) + len(self.bad)))
        deadline = time.monotonic() + timeout_s
        while self.stored() < target:
            self.restart_crashed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.stored()} of {target} results after {timeout_s}s")
            time.sleep(0.25)

    def restart_crashed(self) -> None:
        """Restart every stage process a fault point killed (SIGKILL by itself)."""
        for proc in list(self.pipeline.processes):
            if not proc.alive() and proc.process.returncode == -signal.SIGKILL:
                self.report.kills.append(f"{proc.name}@fault-point")
                self.pipeline.restart(proc.stage, proc.index)

    def kill_and_restart(self, stage: str, index: int = 0) -> None:
        self.pipeline.kill(stage, index, signal.SIGKILL)
        self.report.kills.append(f"{stage}-{index}")
        self.pipeline.restart(stage, index)

    def add_consumer(self, stage: str, index: int) -> None:
        proc = self.pipeline.spawn(stage, index)
        self.pipeline.wait_ready(120, [proc])
        self.report.rebalances.append(f"+{stage}-{index}")

    def remove_consumer(self, stage: str, index: int) -> None:
        self.pipeline.kill(stage, index, signal.SIGTERM)
        self.report.rebalances.append(f"-{stage}-{index}")

    def run(self, disruptions: list[tuple[float, Callable[[], None]]], timeout_s: float = 900) -> ChaosReport:
        """disruptions: (fraction of results stored, action) pairs, applied in order."""
        started = time.monotonic()
        self._publisher.start()
        for fraction, action in disruptions:
            self.wait_progress(fraction, timeout_s)
            action()
        self._publisher.join(timeout_s)
        try:
            self.wait_progress(1.0, timeout_s)
        except TimeoutError:
            pass  # counted as missing below
        self.report.duration_s = round(time.monotonic() - started, 1)
        self.report.fault_points_fired = fired(self.settings)
        self._verify()
        return self.report

    def _verify(self) -> None:
        store = open_store(self.settings.store_url)
        try:
            results = {r.job_id: r for r in store.iter_results()}
            self.report.stored_results = len(results)
            self.report.conflicts = len(store.conflicts())
        finally:
            store.close()
        good_ids = [e.job_id for e in self.events]
        bad_ids = [key.decode() for key, _ in self.bad]
        self.report.missing = [j for j in good_ids + bad_ids if j not in results]
        self.report.statuses = dict(Counter(results[j].status for j in good_ids if j in results))
        self.report.bad_input_reasons = dict(Counter(
            (results[j].error or {}).get("code", results[j].status) for j in bad_ids if j in results
        ))
        by_job: dict[str, set[bytes]] = {}
        records = asyncio.run(_read_topic(self.settings))
        for result in records:
            by_job.setdefault(result.job_id, set()).add(to_json(result))
        self.report.topic_records = len(records)
        self.report.topic_jobs = len(by_job)
        self.report.jobs_with_conflicting_results = sorted(j for j, bodies in by_job.items() if len(bodies) > 1)
        self.report.topic_differs_from_store = sorted(
            j for j, bodies in by_job.items() if j in results and bodies != {to_json(results[j])}
        )
        self.report.missing_on_topic = [j for j in good_ids + bad_ids if j not in by_job]


async def _read_topic(settings: Settings) -> list:
    return [r async for r in follow_results(settings, from_beginning=True, idle_timeout_s=3.0)]


def kill_every_stage_plan(run: ChaosRun) -> list[tuple[float, Callable[[], None]]]:
    """SIGKILL each stage in turn while traffic flows; each restarts and rejoins its group."""
    steps = len(STAGE_NAMES) + 1
    return [((i + 1) / steps, lambda stage=stage: run.kill_and_restart(stage)) for i, stage in enumerate(STAGE_NAMES)]


def run_chaos(settings: Settings, workdir: Path, jobs: int, bad: int, rate: float,
              embedded_broker: bool = True) -> ChaosReport:
    """The README's fault run: kill every stage in turn, then scale inference out and back in
    (and crash once at each named point in settings.fault_points, armed anew for this run)."""
    for marker in settings.state_path("faults").glob("*.fired"):
        marker.unlink()
    pipeline = Pipeline(settings, workdir=workdir, embedded_broker=embedded_broker)
    pipeline.start()
    try:
        run = ChaosRun(pipeline, workload(jobs), bad_workload(bad), rate)
        plan = kill_every_stage_plan(run)
        plan = [(f * 0.8, action) for f, action in plan]
        plan += [(0.82, lambda: run.add_consumer("inference", 1)), (0.9, lambda: run.remove_consumer("inference", 1))]
        return run.run(plan)
    finally:
        pipeline.stop()
