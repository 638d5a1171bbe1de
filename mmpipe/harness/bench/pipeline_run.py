"""The real pipeline under a schedule: embedded broker, one OS process per stage replica.

One Pipeline serves the whole benchmark. A batching policy lives in the inference stage, so
changing policy restarts only the inference replicas (model load + group join, seconds) rather
than every stage. Each run publishes its schedule with a Publisher at the scheduled times
(events are built at send time, so created_at is the real start of each job), then waits until
the store holds a result for every published job.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mmpipe.harness.bench import stats
from mmpipe.harness.bench.resources import LagSampler, ResourceSampler
from mmpipe.harness.bench.simulate import SimPolicy
from mmpipe.harness.bench.traffic import Arrival
from mmpipe.harness.bench.workload import Workload
from mmpipe.client import Publisher
from mmpipe.schemas.settings import BatchingSettings, Settings
from mmpipe.stages.sink.store.base import load_result
from mmpipe.stages.sink.store.sqlite import sqlite_path
from mmpipe.report import scrape
from mmpipe.streams import affinity
from mmpipe.streams.kafka import ensure_topics
from mmpipe.streams.topology import metrics_port, pipeline_of, places_onto_ready
from mmpipe.supervisor import Pipeline, tail
from mmpipe.schemas import JobResult
from mmpipe.schemas.events import HIGH_PRIORITY


# No new result for this long, with every stage group fully committed: the missing jobs are lost.
STALL_S = 15.0
# How often the closed loop (saturation run) looks for completions; short against a batch.
CLOSED_LOOP_POLL_S = 0.02
SCRAPE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Policy:
    mode: str  # off | static | dynamic
    max_batch: int = 1
    max_wait_ms: float = 0.0
    static_timeout_ms: float = 1000.0
    expedite: bool = True  # high-priority items run at once in batches of their own (BatchingSettings)
    urgent_slot: bool = True  # ... and beside a running batch (streams/batching.py: the urgent slot)
    precedence: bool = True  # ... which takes the shared model core first (urgent_precedence_nice)

    @property
    def label(self) -> str:
        if not self.expedite:
            return self._base_label + " no-expedite"
        if not self.urgent_slot:
            return self._base_label + " no-slot"
        return self._base_label + ("" if self.precedence else " even-split")

    @property
    def _base_label(self) -> str:
        if self.mode == "off":
            return "off"
        if self.mode == "static":
            return f"static b={self.max_batch}"
        return f"dynamic b={self.max_batch} w={self.max_wait_ms:g}ms"

    def batching(self) -> BatchingSettings:
        return BatchingSettings(
            mode=self.mode,  # type: ignore[arg-type]
            max_batch_size=self.max_batch,
            max_wait_ms=self.max_wait_ms,
            static_timeout_ms=self.static_timeout_ms,
            expedite_priority=HIGH_PRIORITY if self.expedite else None,
            urgent_slot=self.urgent_slot,
            **({} if self.precedence else {"urgent_precedence_nice": 0}),
        )

    def sim(self) -> SimPolicy:
        return SimPolicy(self.mode, 1 if self.mode == "off" else self.max_batch, self.max_wait_ms / 1000.0, self.static_timeout_ms / 1000.0)


@dataclass(frozen=True)
class Topology:
    """How many inference replicas, how much slower each is (0 = healthy), whether preprocess
    routes work onto them by expected wait (streams/routing.py) or by hash, and whether
    high-priority work travels in its own topics (streams/topics.py: lanes)."""

    inference_delays_ms: tuple[float, ...] = (0.0,)
    routing: bool = False
    lanes: bool = True

    @property
    def replicas(self) -> int:
        return len(self.inference_delays_ms)


@dataclass
class RunData:
    results: list[JobResult]
    published: int
    offsets_s: list[float]  # scheduled offsets, for the simulation
    send_lag_ms: dict[str, float]  # how late the publisher was against the schedule
    lag_peak: dict[str, int]
    resources: dict[str, Any]
    inference_metrics: dict[str, Any] = field(default_factory=dict)


class BenchPipeline:
    def __init__(
        self,
        settings: Settings,
        workdir: Path,
        model: str,
        replicas: dict[str, int],
        sampler: ResourceSampler,
        metrics_base_port: int,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.metrics_base_port = metrics_base_port
        self.pipeline = Pipeline(settings, workdir=workdir, replicas=replicas, metrics_base_port=metrics_base_port)
        self.policy: Policy | None = None
        self.topology = Topology()

    @property
    def settings(self) -> Settings:
        return self.pipeline.settings

    @property
    def db_path(self) -> str:
        return sqlite_path(self.settings.store_url)

    def start(self, policy: Policy, timeout_s: float = 300.0) -> None:
        """Start every stage, the inference stage already with `policy` (saves a restart)."""
        self._apply(policy, Topology())
        self.pipeline.start(timeout_s)
        self.policy, self.topology = policy, Topology()
        if self.pipeline.broker is not None and self.pipeline.broker.process is not None:
            self.sampler.watch("broker", self.pipeline.broker.process.pid)
        self._watch_all()

    def stop(self) -> None:
        self.pipeline.stop()

    def set_policy(self, policy: Policy, topology: Topology = Topology(), timeout_s: float = 300.0) -> bool:
        """Restart the inference replicas with this policy (and preprocess too when routing
        changes: it runs the router; decode and preprocess when the lanes change: they publish
        into them); False if it was already in force."""
        if policy == self.policy and topology == self.topology:
            return False
        restart = {"inference"}
        if topology.routing != self.topology.routing:
            restart.add("preprocess")  # it runs the router
        if topology.lanes != self.topology.lanes:
            restart |= {"decode", "preprocess"}  # they publish into the lanes
        if "preprocess" in restart and places_onto_ready(self.pipeline.settings, "decode"):
            restart.add("decode")  # preprocess's placement runs inside decode (fused, bypass)
        kept = {stage: sum(1 for p in self.pipeline.processes if p.stage == stage) for stage in ("decode", "preprocess")}
        for proc in [p for p in self.pipeline.processes if p.stage in restart]:
            if proc.alive():
                self.pipeline.kill(proc.stage, proc.index, signal.SIGTERM)  # leave the group cleanly
            self.pipeline.processes.remove(proc)
            self.sampler.unwatch(proc.name)
        self._apply(policy, topology)
        new = [self.pipeline.spawn("inference", i) for i in range(topology.replicas)]
        new += [self.pipeline.spawn(stage, i) for stage, count in kept.items() if stage in restart for i in range(count)]
        self.pipeline.wait_ready(timeout_s, new)
        self.policy, self.topology = policy, topology
        self._watch_all()
        return True

    def restart_stages(self, overrides: dict[str, Any], timeout_s: float = 300.0,
                       inference_replicas: int | None = None) -> None:
        """Restart every stage process (not the broker) with these settings changed, and with
        `inference_replicas` inference processes when given."""
        for proc in list(self.pipeline.processes):
            if proc.alive():
                self.pipeline.kill(proc.stage, proc.index, signal.SIGTERM)
            self.sampler.unwatch(proc.name)
        self.pipeline.settings = self.settings.model_copy(update=overrides)
        self._pin_broker()
        # The stages these settings run (decode and preprocess may be fused), each with the
        # replicas it had, or as many as the pipeline starts it with if it did not run before.
        slots = []
        for spec in pipeline_of(self.pipeline.settings):
            count = sum(1 for p in self.pipeline.processes if p.stage == spec.name)
            if spec.name == "inference" and inference_replicas is not None:
                count = inference_replicas
            slots += [(spec.name, i) for i in range(count or self.pipeline.replica_count(spec))]
        self.pipeline.processes = [p for p in self.pipeline.processes if (p.stage, p.index) in slots]
        new = [self.pipeline.spawn(stage, index) for stage, index in slots]
        self.pipeline.wait_ready(timeout_s, new)
        self._watch_all()

    def fresh_topics(self, policy: Policy, topology: Topology = Topology(), timeout_s: float = 300.0,
                     overrides: dict[str, Any] | None = None) -> None:
        """Restart every stage on a new topic prefix (new topics, new groups), inference with
        `policy` and `topology`, and with `overrides` of the settings: one restart of everything
        rather than set_policy's and then this one's. The embedded broker's cost per request
        grows with the records a partition already holds (benchmarks/broker_log_growth.py), so
        runs that are compared start on empty topics."""
        prefix = f"{self.settings.topic_prefix.split('-')[0]}-{uuid.uuid4().hex[:6]}"
        asyncio.run(ensure_topics(self.settings.model_copy(update={"topic_prefix": prefix})))
        self._apply(policy, topology)
        self.restart_stages({**(overrides or {}), "topic_prefix": prefix}, timeout_s, inference_replicas=topology.replicas)
        self.policy, self.topology = policy, topology

    def _pin_broker(self) -> None:
        """The broker outlives stage restarts: give it the cores the new settings leave it."""
        broker = self.pipeline.broker
        if broker is None or broker.process is None:
            return
        model_cpus = self.settings.model_cpus
        cpus = affinity.pipeline_cpus(model_cpus) if model_cpus else affinity.pipeline_cpus(())
        affinity.pin_threads(broker.process.pid, cpus, "the embedded broker")

    def _apply(self, policy: Policy, topology: Topology) -> None:
        """Settings the next restarted processes start with (inference; preprocess and decode
        too when routing or the lanes change)."""
        scheduling = self.settings.scheduling.model_copy(update={"routing": topology.routing, "priority_lanes": topology.lanes})
        self.pipeline.settings = self.settings.model_copy(
            update={"batching": {self.model: policy.batching()}, "scheduling": scheduling})
        for index, delay in enumerate(topology.inference_delays_ms):
            self.pipeline.replica_overrides[("inference", index)] = {"inject_execute_delay_ms": delay}

    def _watch_all(self) -> None:
        for proc in self.pipeline.processes:
            if proc.alive():
                self.sampler.watch(proc.name, proc.process.pid, with_children=True)  # decode's workers

    # Runs ----------------------------------------------------------------------------------
    def run(self, schedule: list[Arrival], workload: Workload, tag: str, timeout_s: float, outstanding: int = 0) -> RunData:
        """Publish at the scheduled offsets; or, with `outstanding`, closed loop: the schedule's
        offsets are ignored and a job is sent whenever fewer than `outstanding` are unanswered."""
        flushes_before = self._flushes()
        self.sampler.begin()
        published, sent_at, send_lag, lag_peak = asyncio.run(self._publish(schedule, workload, tag, timeout_s, outstanding))
        resources = self.sampler.end()
        results = self.fetch(tag)
        return RunData(
            results=results,
            published=published,
            offsets_s=sent_at if outstanding else [a.offset_s for a in schedule],
            send_lag_ms=send_lag,
            lag_peak=lag_peak,
            resources=resources,
            inference_metrics=self._inference_metrics(flushes_before),
        )

    async def _publish(
        self, schedule: list[Arrival], workload: Workload, tag: str, timeout_s: float, outstanding: int
    ) -> tuple[int, list[float], dict[str, float], dict[str, int]]:
        loop = asyncio.get_running_loop()
        late: list[float] = []
        sent_at: list[float] = []
        deadline = time.monotonic() + timeout_s
        async with Publisher(self.settings) as publisher, LagSampler(self.settings) as lag:
            sends = []
            answered = 0
            start = loop.time() + 0.05
            for arrival in schedule:
                if outstanding:
                    answered = await self._until_fewer_unanswered(tag, len(sends), answered, outstanding, deadline)
                else:
                    delay = start + arrival.offset_s - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    late.append(max(loop.time() - start - arrival.offset_s, 0.0) * 1000.0)
                sent_at.append(loop.time() - start)
                sends.append(asyncio.ensure_future(publisher.publish(workload.event(arrival.modality, tag, arrival.priority))))
            await asyncio.gather(*sends)
            # Lag keeps being sampled while the pipeline drains what was just published.
            await self._drain(tag, len(sends), lag, max(deadline - time.monotonic(), 0.0))
            peaks = dict(lag.peaks)
        lag_ms = stats.percentiles(late)
        return len(sends), sent_at, {"p99": lag_ms["p99"], "max": lag_ms["max"]}, peaks

    async def _until_fewer_unanswered(self, tag: str, sent: int, answered: int, outstanding: int, deadline: float) -> int:
        """Closed loop: wait until fewer than `outstanding` of the `sent` jobs lack a result (or
        the run's deadline passed; the drain then reports what is missing). `answered` is the
        last count seen: counts only grow, so while it leaves room the store is not asked.
        Returns the count the decision was made on."""
        while sent - answered >= outstanding and time.monotonic() < deadline:
            answered = await asyncio.to_thread(self._count, tag)
            if sent - answered < outstanding:
                break
            self._check_alive()
            await asyncio.sleep(CLOSED_LOOP_POLL_S)
        return answered

    async def _drain(self, tag: str, count: int, lag: LagSampler, timeout_s: float) -> None:
        """Until every job has a result; or the timeout; or no result came for STALL_S while
        every stage group had committed everything (nothing in flight): those jobs are lost,
        and waiting out the timeout would only hide it (seen before faust's drop of records
        fetched for a partition paused mid-batch was fixed in streams/transport.py)."""
        deadline = time.monotonic() + timeout_s
        done, progress_at = 0, time.monotonic()
        while time.monotonic() < deadline:
            now_done = await asyncio.to_thread(self._count, tag)
            if now_done >= count:
                break
            if now_done > done:
                done, progress_at = now_done, time.monotonic()
            elif time.monotonic() - progress_at > STALL_S and lag.idle():
                break
            self._check_alive()
            await asyncio.sleep(0.5)
        await lag.sample()

    def _check_alive(self) -> None:
        """A dead stage would only show up as a timeout ten minutes later: fail now, with why."""
        for proc in self.pipeline.processes:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.process.returncode} during the run; "
                                   f"log {proc.log_path}:\n{tail(proc.log_path)}")

    def _count(self, tag: str) -> int:
        with self._read() as conn:
            return conn.execute("SELECT COUNT(*) FROM results WHERE job_id >= ? AND job_id < ?", _ids_of(tag)).fetchone()[0]

    def fetch(self, tag: str) -> list[JobResult]:
        with self._read() as conn:
            rows = conn.execute("SELECT body FROM results WHERE job_id >= ? AND job_id < ?", _ids_of(tag)).fetchall()
        return [load_result(body) for (body,) in rows]

    def _read(self) -> _Reader:
        """A plain reader outside the store object: WAL lets it read beside the sink's writes
        without waiting for them, so polling costs the sink nothing."""
        return _Reader(self.db_path)

    def _scrape_inference(self) -> dict[str, InferencePage]:
        if not self.metrics_base_port:
            return {}
        return {
            p.name: InferencePage.parse(scrape(self._inference_url(p.index), SCRAPE_TIMEOUT_S), self.model)
            for p in self.pipeline.processes if p.stage == "inference"
        }

    def _inference_url(self, index: int) -> str:
        return self._metrics_url("inference", index)

    def _metrics_url(self, stage: str, index: int) -> str:
        return f"http://127.0.0.1:{metrics_port(self.metrics_base_port, stage, index)}/metrics"

    def routing_counts(self) -> RoutingCounts:
        """The routers' decisions per ready partition and preferred-partition flips so far,
        summed over the processes that place onto `ready` (preprocess, and decode where it
        runs preprocess's placement: fused, bypass)."""
        counts = RoutingCounts()
        for p in self.pipeline.processes:
            if places_onto_ready(self.pipeline.settings, p.stage) and self.metrics_base_port:
                counts.add(scrape(self._metrics_url(p.stage, p.index), SCRAPE_TIMEOUT_S) or "")
        return counts

    def _flushes(self) -> dict[str, dict[str, float]]:
        return {name: page.flushes for name, page in self._scrape_inference().items()}

    def _inference_metrics(self, flushes_before: dict[str, dict[str, float]]) -> dict[str, Any]:
        """The inference replicas' own view: peak GPU memory, and batch flushes by trigger
        during this run (full batch, max_wait, static timeout)."""
        out: dict[str, Any] = {}
        for name, page in self._scrape_inference().items():
            before = flushes_before.get(name, {})
            out[name] = {
                "gpu_memory_bytes": page.gpu_memory_bytes,
                "batch_flushes": {k: int(v - before.get(k, 0)) for k, v in page.flushes.items() if v - before.get(k, 0)},
            }
        return out


@dataclass
class InferencePage:
    """What the benchmark reads from an inference replica's metrics page."""

    gpu_memory_bytes: int = 0
    flushes: dict[str, float] = field(default_factory=dict)  # batches flushed so far, by trigger

    @classmethod
    def parse(cls, text: str | None, model: str) -> InferencePage:
        page = cls()  # an unreachable replica reads as empty
        for family in text_string_to_metric_families(text or ""):
            for sample in family.samples:
                if sample.name == "mm_gpu_memory_bytes":
                    page.gpu_memory_bytes = int(sample.value)
                elif sample.name == "mm_batch_flushes_total" and sample.labels.get("model") == model:
                    page.flushes[sample.labels["trigger"]] = sample.value
        return page


@dataclass
class RoutingCounts:
    """mm_route_decisions_total{partition} and mm_route_flips_total, as read from /metrics."""

    decisions: dict[str, float] = field(default_factory=dict)
    flips: float = 0.0

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "mm_route_decisions_total":
                    partition = sample.labels["partition"]
                    self.decisions[partition] = self.decisions.get(partition, 0.0) + sample.value
                elif sample.name == "mm_route_flips_total":
                    self.flips += sample.value

    def since(self, before: RoutingCounts) -> dict[str, Any]:
        """What happened between two read-outs: decisions per partition, flips."""
        decisions = {p: int(n - before.decisions.get(p, 0.0)) for p, n in sorted(self.decisions.items())}
        return {"decisions": {p: n for p, n in decisions.items() if n}, "flips": int(self.flips - before.flips)}


def _ids_of(tag: str) -> tuple[str, str]:
    """The job_id range of a run's jobs ("<tag>-..."): an index seek, where LIKE scans the
    whole index (the closed loop counts every few milliseconds)."""
    return f"{tag}-", f"{tag}."


class _Reader:
    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, timeout=10)

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()
