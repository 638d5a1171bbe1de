"""The shared life of a stage: consume, do one thing, produce, commit.

A Stage (stages/*.py) only says what to do with one message. StageRuntime runs it as a faust
app (its own consumer group) and owns everything shared:

* at-least-once without gaps: a message is acked only after every output it caused has been
  acknowledged by the broker; faust commits the highest contiguous acked offset;
* backpressure: PartitionGate bounds in-flight work per partition and per process;
* failure policy: bad input -> dead-letter topic at once with its reason; transient errors ->
  bounded retries with capped, jittered backoff; an unavailable dependency (database, broker)
  -> retried until it is back, holding the offset (the gate then pauses intake);
* metrics: queue wait, service time, outcomes, in-flight, pauses, consumer lag.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import faust
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from faust.sensors.prometheus import FaustMetrics

from mmpipe.schemas.settings import Settings
from mmpipe.schemas import BadMessage, DeadLetter, JobStatus, ModelRef, Prediction, peek_header, to_json
from mmpipe.streams import affinity, transport
from mmpipe.streams.backpressure import PartitionGate
from mmpipe.streams.fetch_wait import LagReadSchedule
from mmpipe.streams.kafka import LagReader, downstream_of, group_id, stage_input_topics
from mmpipe.streams.metrics import StageMetrics, StageMonitor, serve_metrics
from mmpipe.streams.topics import TopicNames

log = logging.getLogger(__name__)

EXCERPT_BYTES = 512
ADMISSION_POLL_S = 0.005


class TransientError(Exception):
    """Worth retrying a few times (a flaky read, a momentary resource shortage)."""


class DependencyUnavailable(Exception):
    """A dependency (database, broker) is down: retry until it is back, never dead-letter."""


class Outgoing(NamedTuple):
    topic: str
    key: bytes
    value: bytes


@dataclass(frozen=True)
class Incoming:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: float  # when the producer wrote it (epoch seconds)
    received_at: float  # when this stage took it

    @property
    def job_id(self) -> str:
        """Every topic is keyed by job id; a keyless message gets a locator instead."""
        if self.key:
            try:
                return self.key.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return f"unknown:{self.topic}:{self.partition}:{self.offset}"


class Stage(abc.ABC):
    """One step of the pipeline; subclasses live in stages/."""

    name: ClassVar[str]
    # A stage that sheds load answers jobs as rejected beyond max_backlog instead of waiting.
    sheds_load: bool = False

    def __init__(self, settings: Settings, metrics: StageMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.topics = TopicNames(settings.topic_prefix)
        self.backlog = 0  # this group's lag, refreshed by the runtime, decremented per message

    async def wait_for_room(self, message: Incoming) -> bool:
        """Admission: wait until the next stage has room for this message's work (True), or
        give up at once when shedding load (False). The runtime supplies the live version."""
        return True

    @property
    def input_topics(self) -> list[str]:
        return stage_input_topics(self.settings, self.name)

    def setup(self) -> None:
        """Blocking start-up work (load models, open the store) before joining the group."""

    async def start(self) -> None:
        """Async start-up inside the worker's event loop (start batchers...)."""

    async def stop(self) -> None:
        """Release resources when the worker stops."""

    @abc.abstractmethod
    async def handle(self, message: Incoming) -> list[Outgoing]:
        """Process one message; return what to produce. Raise BadMessage for bad input."""

    async def after_send(self, outgoing: list[Outgoing]) -> None:
        """Called once the broker acknowledged every output, before the input is acked."""

    # Helpers for subclasses ------------------------------------------------------------
    def answer_without_work(self, status: str, *, job_id: str, part: int, parts: int, kind: str, modality: str,
                            model: ModelRef, created_at: float, trace: dict[str, float], detail: str) -> Outgoing:
        """Answer an item as expired (deadline passed) or rejected (overload): no work is done,
        the answer goes straight to the sink, which decides the whole job with it."""
        counter = self.metrics.expired if status == "expired" else self.metrics.rejected
        counter.labels(self.name).inc()
        prediction = Prediction(
            job_id=job_id, part=part, parts=parts, kind=kind, modality=modality, model=model,
            status=status, created_at=created_at, trace=trace, error=detail,
        )
        return Outgoing(self.topics.predictions, job_id.encode(), to_json(prediction))

    def status(self, job_id: str, state: str) -> Outgoing:
        return Outgoing(
            self.topics.status, job_id.encode(), to_json(JobStatus(job_id, state, time.time(), self.name))
        )


def dead_letter(stage: str, message: Incoming, reason: str, detail: str) -> DeadLetter:
    header = peek_header(message.value)
    created = header.get("created_at")
    modality = header.get("modality")
    return DeadLetter(
        job_id=message.job_id,
        stage=stage,
        reason=reason,
        detail=detail[:2000],
        source_topic=message.topic,
        source_partition=message.partition,
        source_offset=message.offset,
        failed_at=time.time(),
        created_at=float(created) if isinstance(created, (int, float)) else None,
        modality=modality if isinstance(modality, str) else None,
        payload_excerpt=(message.value or b"")[:EXCERPT_BYTES],
    )


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Full-jitter exponential backoff: retries of many items spread out instead of marching
    in step, so a recovering dependency is not hit by a synchronized wave."""
    return random.uniform(0, min(cap_s, base_s * (2**attempt)))


def make_faust_app(stage_name: str, settings: Settings) -> faust.App:
    scheme = transport.register(settings.fetch_max_wait_ms, settings.fetch_idle_max_wait_ms, settings.fetch_idle_after_s)
    datadir = settings.state_path("faust")
    datadir.mkdir(parents=True, exist_ok=True)
    return faust.App(
        group_id(settings, stage_name),
        broker=f"{scheme}://{settings.bootstrap}",
        broker_credentials=_faust_credentials(settings),
        value_serializer="raw",
        key_serializer="raw",
        web_enabled=False,
        datadir=str(datadir / stage_name),
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=settings.heartbeat_interval_s,
        broker_rebalance_timeout=settings.rebalance_timeout_s,
        broker_commit_interval=settings.commit_interval_s,
        stream_buffer_maxsize=settings.stream_buffer_maxsize,
        broker_max_poll_records=settings.max_poll_records,
        producer_max_request_size=settings.max_message_bytes,
        consumer_max_fetch_size=settings.max_message_bytes,
        producer_acks=-1,
        producer_linger_ms=0,
        producer_max_batch_size=1 if settings.single_record_batches else 16384,
        # Stages are idempotent downstream, but finishing in-flight work before a rebalance
        # still saves duplicates.
        stream_wait_empty=True,
    )


def _faust_credentials(settings: Settings) -> Any:
    from mmpipe.streams.kafka import ssl_context

    sec = settings.security
    context = ssl_context(settings)
    if sec.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=sec.sasl_username,
            password=sec.sasl_password,
            mechanism=sec.sasl_mechanism or "PLAIN",
            ssl_context=context,
        )
    if context is not None:
        return faust.SSLCredentials(context)
    return None


class StageRuntime:
    """Runs one Stage as a faust worker: one agent over the stage's input topics."""

    def __init__(self, stage: Stage, ready_file: Path | None = None) -> None:
        self.stage = stage
        self.ready_file = ready_file
        self.settings = stage.settings
        self.metrics = stage.metrics
        self.app = make_faust_app(stage.name, self.settings)
        self.app.monitor = StageMonitor(
            self.metrics, FaustMetrics.create(_registry(), f"faust_{stage.name}")
        )
        self.gate = PartitionGate(
            high=self.settings.inflight_high_per_partition,
            low=min(self.settings.inflight_low_per_partition, self.settings.inflight_high_per_partition - 1),
            max_total=self.settings.max_inflight,
            pause=lambda tps: self.app.consumer.pause_partitions(tps),
            resume=lambda tps: self.app.consumer.resume_partitions(tps),
            metrics=self.metrics,
        )
        self._tasks: set[asyncio.Task] = set()
        channel = self.app.topic(*stage.input_topics, partitions=self.settings.partitions)
        self.app.agent(channel, name=f"{stage.name}-agent")(self._agent)
        self.app.timer(self.settings.lag_interval_s)(self._watch_lag)
        self.app.on_partitions_revoked.connect(self._on_revoked)
        self.app.on_partitions_assigned.connect(self._on_assigned)
        self.app.task(self._on_startup)
        self.app.on_before_shutdown.connect(self._on_shutdown)
        self._lag_reader: LagReader | None = None
        self._lag_schedule = LagReadSchedule(self.settings.lag_idle_interval_s)
        self._downstream = downstream_of(self.settings, stage.name)  # (topic, group) or None
        self._downstream_lag: dict[int, int] = {}  # per output partition, see _count_downstream
        self._admitting: Counter[int] = Counter()  # admitted messages whose output is not sent yet
        self._reserved: set[tuple[int, int]] = set()  # (partition, offset) of those messages
        stage.wait_for_room = self._wait_for_room  # type: ignore[method-assign]
        self._started = asyncio.Event()

    # Lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Blocking: load, then join the group and process until SIGINT/SIGTERM."""
        affinity.pin_pipeline_process(self.settings.model_cpus)  # before any thread starts
        self.stage.setup()
        serve_metrics(self.settings.metrics_port, self.settings.metrics_host)
        worker = faust.Worker(self.app, loglevel=self.settings.log_level, quiet=True)
        worker.execute_from_commandline()

    async def _on_startup(self) -> None:
        await self.stage.start()
        self._started.set()
        log.info("stage %s started; consuming %s", self.stage.name, ", ".join(self.stage.input_topics))

    async def _on_shutdown(self, app: Any, **_: Any) -> None:
        await self.stage.stop()
        if self._lag_reader is not None:
            await self._lag_reader.close()

    async def _on_revoked(self, app: Any, revoked: Any, **_: Any) -> None:
        self.gate.forget(revoked)

    async def _on_assigned(self, app: Any, assigned: Any, **_: Any) -> None:
        log.info("stage %s assigned %s", self.stage.name, sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))
        if self.ready_file is not None and not self.ready_file.exists():
            self.ready_file.write_text(str(os.getpid()))

    # The agent --------------------------------------------------------------------------
    async def _agent(self, stream: Any) -> None:
        await self._started.wait()
        async for event in stream.noack().events():
            tp = event.message.tp
            await self.gate.acquire(tp)
            task = asyncio.ensure_future(self._process(event, tp))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("stage %s: message task failed", self.stage.name, exc_info=task.exception())

    async def _process(self, event: Any, tp: Any) -> None:
        m = event.message
        message = Incoming(
            topic=m.topic,
            partition=m.partition,
            offset=m.offset,
            key=m.key,
            value=m.value,
            timestamp=m.timestamp,
            received_at=time.time(),
        )
        self.metrics.queue_wait.labels(self.stage.name).observe(max(message.received_at - message.timestamp, 0.0))
        try:
            outgoing = await self._handle(message)
            await self._send_all(outgoing, message)
            await self._after_send(outgoing)
            event.ack()
        finally:
            self._release_reservation(message)
            self.gate.release(tp)
            if self._downstream_lag:
                self._hold_or_release_for_downstream()  # the backlog estimate moved

    async def _handle(self, message: Incoming) -> list[Outgoing]:
        attempt = 0
        while True:
            try:
                outgoing = await self.stage.handle(message)
                self.metrics.count("ok")
                return outgoing
            except BadMessage as exc:
                return [self._dead_letter(message, exc.reason, exc.detail)]
            except TransientError as exc:
                if attempt >= self.settings.max_retries:
                    return [self._dead_letter(message, "retries_exhausted", f"{attempt + 1} attempts: {exc}")]
                await self._retry_pause("transient", attempt, exc)
            except DependencyUnavailable as exc:
                await self._retry_pause("dependency_unavailable", attempt, exc)
            except Exception as exc:  # a bug must not stall the partition: dead-letter it, loudly
                log.exception("stage %s failed on %s", self.stage.name, message.job_id)
                return [self._dead_letter(message, "internal_error", f"{type(exc).__name__}: {exc}")]
            attempt += 1

    async def _after_send(self, outgoing: list[Outgoing]) -> None:
        try:
            await self.stage.after_send(outgoing)
        except Exception as exc:  # bookkeeping only: a redelivery would repeat the same output
            log.warning("stage %s: after-send step failed: %s", self.stage.name, exc)

    async def _retry_pause(self, reason: str, attempt: int, exc: Exception) -> None:
        self.metrics.retries.labels(self.stage.name, reason).inc()
        delay = backoff_delay(attempt, self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        log.warning("stage %s: %s (%s); retry %d in %.2fs", self.stage.name, reason, exc, attempt + 1, delay)
        await asyncio.sleep(delay)

    def _dead_letter(self, message: Incoming, reason: str, detail: str) -> Outgoing:
        self.metrics.count("dead_letter")
        self.metrics.dead_letters.labels(self.stage.name, reason).inc()
        letter = dead_letter(self.stage.name, message, reason, detail)
        log.info("dead-letter %s from %s: %s: %s", letter.job_id, self.stage.name, reason, detail[:200])
        return Outgoing(self.stage.topics.dead_letter, message.job_id.encode(), to_json(letter))

    async def _send_all(self, outgoing: list[Outgoing], message: Incoming) -> None:
        """Produce every output and wait for the broker's acks; only then may we ack."""
        attempt = 0
        while True:
            try:
                futures = [
                    await self.app.producer.send(out.topic, out.key, out.value, None, None, None)
                    for out in outgoing
                ]
                self._count_downstream(await asyncio.gather(*futures))
                return
            except MessageSizeTooLargeError as exc:
                # Retrying cannot help; tell the sink why this job produced nothing.
                outgoing = [self._dead_letter(message, "output_too_large", str(exc))]
            except KafkaError as exc:
                await self._retry_pause("produce_failed", attempt, exc)
                attempt += 1

    # Lag, downstream backpressure, admission -------------------------------------------
    async def _watch_lag(self) -> None:
        """Export this group's lag, feed the stage's backlog estimate, and hold partitions
        while the next stage lags too far behind on this stage's output."""
        if not self._lag_schedule.due(transport.FETCH_WAIT, time.monotonic()):
            return  # idle with no lag anywhere: the last figures still hold
        try:
            if self._lag_reader is None:
                self._lag_reader = LagReader(self.settings)
            group = group_id(self.settings, self.stage.name)
            rows = await self._lag_reader.read(group, self.stage.input_topics)
            self._export_lag(group, rows)
            self.stage.backlog = sum(row.lag for row in rows)
            await self._apply_downstream_bound()
            self._lag_schedule.read(self.stage.backlog + sum(self._downstream_lag.values()), time.monotonic())
        except Exception as exc:  # telemetry and throttling must never kill the stage
            log.warning("lag read failed: %r", exc)

    def _export_lag(self, group: str, rows: list[Any]) -> None:
        for row in rows:
            self.metrics.lag.labels(group, row.topic, str(row.partition)).set(row.lag)

    async def _apply_downstream_bound(self) -> None:
        if self._downstream is None or self._lag_reader is None:
            return
        topic, group = self._downstream
        rows = await self._lag_reader.read(group, [topic])
        self._downstream_lag = {row.partition: row.lag for row in rows}
        self._export_lag(group, rows)
        self._hold_or_release_for_downstream()

    def _count_downstream(self, metadata: list[Any]) -> None:
        """Between two lag read-outs, count what we add to each downstream partition, so a
        fast stage pauses as soon as its estimate crosses the bound, not one interval late."""
        if self._downstream is None or not self._downstream_lag:
            return
        added = [md.partition for md in metadata if md is not None and md.topic == self._downstream[0]]
        for partition in added:
            self._downstream_lag[partition] = self._downstream_lag.get(partition, 0) + 1
        if added:
            self._hold_or_release_for_downstream()

    def _lag_at(self, partition: int) -> int:
        """The next stage's lag on the output partition fed by input partition `partition`:
        keys are job ids and partition counts match, so p feeds p; with other counts, the
        worst partition decides."""
        if partition in self._downstream_lag:
            return self._downstream_lag[partition]
        return max(self._downstream_lag.values(), default=0)

    def _downstream_lag_of(self, partition: int) -> int:
        return self._lag_at(partition) + self._admitting[partition]

    def _shedding(self) -> bool:
        return self.stage.sheds_load and self.stage.backlog > self.settings.max_backlog

    async def _wait_for_room(self, message: Incoming) -> bool:
        """Exact admission at the head of the pipeline: a message goes on only while the next
        stage's estimated backlog (last read-out + sent since + admitted, not yet sent) is under
        the bound. Otherwise it waits; under `reject` it is turned away once more than
        max_backlog jobs wait in front of this stage."""
        partition = message.partition
        while self._downstream_lag_of(partition) >= self.settings.downstream_lag_high:
            if self._shedding():
                return False
            await asyncio.sleep(ADMISSION_POLL_S)
        self._admitting[partition] += 1
        self._reserved.add((partition, message.offset))
        return True

    def _release_reservation(self, message: Incoming) -> None:
        key = (message.partition, message.offset)
        if key in self._reserved:
            self._reserved.discard(key)
            self._admitting[message.partition] -= 1

    def _hold_or_release_for_downstream(self) -> None:
        shedding = self._shedding()
        input_topic = self.stage.input_topics[0]
        assigned = [tp for tp in self.app.consumer.assignment() if tp.topic == input_topic]
        high, low = self.settings.downstream_lag_high, self.settings.downstream_lag_low
        for tp in assigned:
            lag = self._lag_at(tp.partition)
            if shedding or lag <= low:
                self.gate.hold_for_downstream([tp], full=False)
            elif lag > high:
                self.gate.hold_for_downstream([tp], full=True)


def _registry() -> Any:
    from prometheus_client import REGISTRY

    return REGISTRY
