"""Fault runs: real stage processes killed with SIGKILL mid-run, consumers added and removed,
the store locked; then every job's result is counted in the store and on the results topic.

Used by the fault tests (small N) and by `mmpipe chaos` (10,000 jobs for the README's report).
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

import numpy as np
import orjson

from mmpipe.stages.decode import samples
from mmpipe.client import Publisher, follow_results, make_event
from mmpipe.schemas.settings import Settings
from mmpipe.stages.sink.store import StoreUnavailable, count_results, open_store
from mmpipe.streams.faults import fired
from mmpipe.streams.topology import stage_names
from mmpipe.supervisor import Pipeline
from mmpipe.schemas import MediaEvent, ModelRef, to_json
from mmpipe.schemas.events import HIGH_PRIORITY, NORMAL_PRIORITY


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
    workload: dict[str, int] = field(default_factory=dict)  # good jobs per workload kind (WORKLOAD_KINDS)
    statuses_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    statuses_by_priority: dict[str, dict[str, int]] = field(default_factory=dict)  # good jobs: 0 = the high lanes
    parts: dict[str, int] = field(default_factory=dict)  # stored good results by their part count
    bad_input_reasons: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def lost(self) -> int:
        return len(self.missing) + len(self.missing_on_topic)

    @property
    def duplicated(self) -> int:
        return len(self.jobs_with_conflicting_results)

    def as_dict(self) -> dict:
        return {**asdict(self), "lost": self.lost, "duplicated": self.duplicated}

    def checks(self) -> dict[str, bool]:
        """The fault run's claims, each checked (what tests/test_faults.py asserts)."""
        return {
            "nothing_lost": self.lost == 0,
            "nothing_duplicated": self.duplicated == 0,
            "topic_equals_store": not self.topic_differs_from_store,
            "no_conflicts": self.conflicts == 0,
            "one_row_per_job": self.stored_results == self.jobs + self.bad_inputs,
            "every_good_job_ok": self.statuses == {"ok": self.jobs},
        }

    def to_json(self) -> bytes:
        return orjson.dumps(self.as_dict(), option=orjson.OPT_INDENT_2)


# The mix, one slot per job: i % 5 picks the kind, and every LONG_AUDIO_EVERY-th job (at
# offset LONG_AUDIO_AT, so even a 40-job CI run has one) is a multi-window spoken clip instead.
MIX = ("text", "image", "video", "text", "audio")
LONG_AUDIO_EVERY = 100
LONG_AUDIO_AT = 14  # a short-audio slot (14 % 5 == 4)
HIGH_PRIORITY_EVERY = 7  # one job in 7 at priority 0, so faults hit the high lanes too (7 is prime to 5 and 100)
WORKLOAD_KINDS = {
    "text": "a sentence (1 part)",
    "image": "inline 96x72 PNG (1 part)",
    "audio": "inline 0.5 s WAV tone (1 part, Whisper's VAD finds no speech: answered without decoding)",
    "video": "inline 2 s 96x72 MP4 at 10 fps with a tone track (3 parts: 2 sampled frames + 1 audio window)",
    "long_audio": "inline 34.4 s FLAC, a spoken sentence in each 30 s window (2 parts, both transcribed by Whisper)",
}


def workload_kind(i: int) -> str:
    return "long_audio" if i % LONG_AUDIO_EVERY == LONG_AUDIO_AT else MIX[i % len(MIX)]


def long_speech_clip(rate: int = 16_000) -> bytes:
    """A spoken clip a little over 30 s that the decode stage cuts into two Whisper windows, a
    sentence in each (as in tests/test_transcribe_e2e.py): FLAC, ~100 KB, the silence is free.
    Needs espeak-ng (./dev installs it)."""
    first = samples.speech_pcm("Good morning everyone, the meeting starts now.", rate=rate, lead_s=1.0, tail_s=0.0)
    second = samples.speech_pcm("Please close the door when you leave.", rate=rate, lead_s=0.0, tail_s=1.0)
    gap = np.zeros(31 * rate - first.size, dtype=np.float32)  # the second sentence starts at 31 s
    return samples.encode_audio(np.concatenate([first, gap, second]), rate=rate, fmt="flac")


def workload(jobs: int, seed: int = 0) -> list[MediaEvent]:
    """A mix of small real inputs: texts, inline PNG images, inline WAV snippets, and
    multi-part jobs beside them: 2 s videos (two sampled frames and an audio track: three
    parts, assembled from three inference answers) and, one job in LONG_AUDIO_EVERY, a 34 s
    spoken clip (two 30 s windows, each transcribed by Whisper: two parts). One job in
    HIGH_PRIORITY_EVERY, of every kind, is high priority and travels the high lanes. Each event's
    attributes["chaos_kind"] names its kind (see WORKLOAD_KINDS)."""
    image = samples.encode_image(samples.synthetic_picture(96, 72, seed=seed))
    audio = samples.encode_audio(samples.tone_pcm(0.5))
    video = samples.encode_video(seconds=2.0, width=96, height=72, fps=10, audio=samples.tone_pcm(2.0), seed=seed)
    payloads = {"image": ("image", image), "audio": ("audio", audio), "video": ("video", video)}
    if any(workload_kind(i) == "long_audio" for i in range(jobs)):
        payloads["long_audio"] = ("audio", long_speech_clip())
    events = []
    for i in range(jobs):
        kind = workload_kind(i)
        job_id = f"chaos-{seed}-{i:06d}"
        common = dict(job_id=job_id, attributes={"chaos_kind": kind},
                      priority=HIGH_PRIORITY if i % HIGH_PRIORITY_EVERY == 0 else NORMAL_PRIORITY)
        if kind == "text":
            events.append(make_event("text", text=f"fault run sentence number {i}", **common))
        else:
            modality, data = payloads[kind]
            events.append(make_event(modality, data=data, **common))
    return events


def chaos_settings(base: Settings) -> Settings:
    """What a fault run changes: no job may end other than by being processed. Jobs wait in
    Kafka instead of being rejected by admission control (`defer`), and none expires: the
    events are made before the run, and at 10,000 jobs the last ones wait in the backlog
    longer than the default 300 s deadline (each would end `expired`, the cheap path)."""
    return base.model_copy(update=dict(admission_policy="defer", default_deadline_s=7 * 24 * 3600.0))


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
        kinds = {e.job_id: e.attributes.get("chaos_kind", e.modality) for e in self.events}
        self.report.workload = dict(Counter(kinds.values()))
        by_kind: dict[str, Counter] = {}
        for j in good_ids:
            if j in results:
                by_kind.setdefault(kinds[j], Counter())[results[j].status] += 1
        self.report.statuses_by_kind = {kind: dict(counts) for kind, counts in sorted(by_kind.items())}
        by_priority: dict[str, Counter] = {}
        for event in self.events:
            if event.job_id in results:
                by_priority.setdefault(str(event.priority), Counter())[results[event.job_id].status] += 1
        self.report.statuses_by_priority = {p: dict(counts) for p, counts in sorted(by_priority.items())}
        self.report.parts = {str(n): c for n, c in sorted(Counter(results[j].parts for j in good_ids if j in results).items())}
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
    stages = stage_names(run.settings)
    return [((i + 1) / (len(stages) + 1), lambda stage=stage: run.kill_and_restart(stage)) for i, stage in enumerate(stages)]


def run_chaos(settings: Settings, workdir: Path, jobs: int, bad: int, rate: float,
              embedded_broker: bool = True, seed: int = 0) -> ChaosReport:
    """The README's fault run: kill every stage in turn, then scale inference out and back in
    (and crash once at each named point in settings.fault_points, armed anew for this run).
    Runs under chaos_settings(settings): nothing rejected by admission, nothing expired."""
    settings = chaos_settings(settings)
    for marker in settings.state_path("faults").glob("*.fired"):
        marker.unlink()
    pipeline = Pipeline(settings, workdir=workdir, embedded_broker=embedded_broker)
    pipeline.start()
    try:
        run = ChaosRun(pipeline, workload(jobs, seed=seed), bad_workload(bad), rate)
        plan = kill_every_stage_plan(run)
        plan = [(f * 0.8, action) for f, action in plan]
        plan += [(0.82, lambda: run.add_consumer("inference", 1)), (0.9, lambda: run.remove_consumer("inference", 1))]
        return run.run(plan)
    finally:
        pipeline.stop()
