"""Delivery: runs one Stage as a faust worker (its own consumer group) and carries each message

    consume -> handle (under the failure policy) -> produce -> wait for the broker's acks -> ack

A message is acked only after every output it caused has been acknowledged by the broker, and
faust commits the highest contiguous acked offset (streams/transport.py): at-least-once with no
gap. Between take and ack the partition gate counts it in flight (backpressure.py); the
downstream admission (admission.py) is fed from here with lag read-outs and sent counts.
Status reports are not outputs: they are sent coalesced, off this path (status.py).
MessageDelivery carries one message; StageRuntime wires it to faust.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from faust.exceptions import ProducerSendError
from faust.sensors.prometheus import FaustMetrics
from prometheus_client import REGISTRY

from mmpipe.schemas.settings import Settings, secret
from mmpipe.streams import affinity, transport, wakeup
from mmpipe.streams.admission import DownstreamAdmission
from mmpipe.streams.backpressure import PartitionGate
from mmpipe.streams.failure import FailurePolicy
from mmpipe.streams.fetch_wait import LagReadSchedule
from mmpipe.streams.kafka import LagReader, downstreams_of, group_id, ssl_context
from mmpipe.streams.metrics import StageMonitor, serve_metrics
from mmpipe.streams.poison import PoisonGuard
from mmpipe.streams.retry import retry_async
from mmpipe.streams.stage import Incoming, Outgoing, Stage
from mmpipe.streams.status import StatusReporter

log = logging.getLogger(__name__)

# Awaiting a producer send gives a future that resolves to the record's metadata on the ack.
Send = Callable[[Outgoing], Awaitable["asyncio.Future[Any]"]]


def make_faust_app(stage_name: str, settings: Settings) -> faust.App:
    scheme = transport.register(
        settings.fetch_max_wait_ms, settings.fetch_idle_max_wait_ms, settings.fetch_idle_after_s,
        wakeup.listening_folder(settings, stage_name), settings.fetch_wake_fallback_ms, settings.consumer_in_thread,
    )
    datadir = settings.state_path("faust")
    datadir.mkdir(parents=True, exist_ok=True)
    return faust.App(
        group_id(settings, stage_name),
        broker=f"{scheme}://{settings.bootstrap}",
        broker_credentials=_faust_credentials(settings),
        broker_client_id=settings.client_id,
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


def use_event_loop(kind: str) -> None:
    """The loop every asyncio.get_event_loop() of this process makes from now on; before the
    faust worker makes its own."""
    if kind == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def quiet_worker(app: faust.App, loglevel: str) -> faust.Worker:
    """A faust worker without its terminal spinner. To advance the spinner on every log call,
    faust sets the root logger to DEBUG, so every library debug call in the hot path (aiokafka
    logs each send) built a log record only for the handlers to drop it; the spinner itself
    stops after start-up and never draws into a log file."""
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.spinner = None
    return worker


def _faust_credentials(settings: Settings) -> Any:
    sec = settings.security
    context = ssl_context(settings)
    if sec.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=sec.sasl_username,
            password=secret(sec.sasl_password),
            mechanism=sec.sasl_mechanism or "PLAIN",
            ssl_context=context,
        )
    if context is not None:
        return faust.SSLCredentials(context)
    return None


class Sender:
    """Produces a message's outputs and waits for every ack. Broker errors are retried until
    the broker takes them (the offset is held meanwhile); an output too large for the broker
    becomes a dead letter instead, since no retry can help."""

    def __init__(self, send: Send, failures: FailurePolicy, settings: Settings) -> None:
        self._send = send
        self._failures = failures
        self._backoff = (settings.retry_backoff_s, settings.retry_backoff_max_s)

    async def send_all(self, outgoing: list[Outgoing], message: Incoming) -> list[Any]:
        """Returns the acknowledged records' metadata."""
        try:
            return await self._send_retrying(outgoing)
        except MessageSizeTooLargeError as exc:
            # Tell the sink why this job produced nothing.
            return await self._send_retrying([self._failures.dead_letter(message, "output_too_large", str(exc))])

    async def _send_retrying(self, outgoing: list[Outgoing]) -> list[Any]:
        base, cap = self._backoff
        return await retry_async(
            lambda: self._send_once(outgoing), KafkaError, base_s=base, cap_s=cap,
            give_up=lambda exc, _: isinstance(exc, MessageSizeTooLargeError),
            on_retry=lambda exc, attempt, delay: self._failures.count_retry(exc, attempt, delay, "produce_failed"),
        )

    async def _send_once(self, outgoing: list[Outgoing]) -> list[Any]:
        futures = [await self._queue(out) for out in outgoing]
        return list(await asyncio.gather(*futures))

    async def _queue(self, out: Outgoing) -> asyncio.Future[Any]:
        try:
            return await self._send(out)
        except ProducerSendError as exc:
            # faust wraps the KafkaError raised while queueing a record (too large, buffer or
            # metadata timeout): unwrapped, the retry and the dead-letter rule above see it.
            if isinstance(exc.__cause__, KafkaError):
                raise exc.__cause__ from None
            raise


@dataclass
class MessageDelivery:
    """One message through the stage: the poison check, the handler under the failure policy,
    the outputs sent and acknowledged, then the input acked. However that ends, the message
    leaves the poison guard, its admission reservation and its place in the partition gate.
    No faust here: StageRuntime hands it each message (tests drive it with fakes)."""

    stage: Stage
    failures: FailurePolicy
    sender: Sender
    poison: PoisonGuard
    gate: PartitionGate
    admission: DownstreamAdmission
    downstream_topics: list[str]  # the output topics (both lanes) the next stage's admission counts

    async def process(self, message: Incoming, ack: Callable[[], None], tp: Any) -> None:
        """Deliver `message`, taken from partition `tp` (the gate already counts it in flight);
        `ack` acks it once its outputs are acknowledged."""
        self.stage.metrics.queue_wait.labels(self.stage.name).observe(max(message.received_at - message.timestamp, 0.0))
        where = (message.topic, message.partition, message.offset)
        entered = False
        try:
            # Poison messages (streams/poison.py): one that kept killing this stage is given up.
            entered = await self.poison.enter(*where)
            if entered:
                outgoing = await self.failures.run(self.stage.handle, message)
            else:
                outgoing = [self.failures.dead_letter(message, "crashed_stage", self.poison.detail(*where))]
            sent = await self.sender.send_all(outgoing, message)
            self._count_downstream(sent)
            await self._after_send(outgoing)
            ack()
        finally:
            if entered:
                await self.poison.leave(*where)
            self.admission.release(message.partition, message.offset, topic=message.topic)
            self.gate.release(tp)
            self.admission.refresh()

    async def _after_send(self, outgoing: list[Outgoing]) -> None:
        try:
            await self.stage.after_send(outgoing)
        except Exception as exc:  # bookkeeping only: a redelivery would repeat the same output
            log.warning("stage %s: after-send step failed: %s", self.stage.name, exc)

    def _count_downstream(self, metadata: list[Any]) -> None:
        if not self.downstream_topics:
            return
        self.admission.count_sent(md.partition for md in metadata if md is not None and md.topic in self.downstream_topics)


class StageRuntime:
    """Runs one Stage as a faust worker: one agent over the stage's input topics."""

    def __init__(self, stage: Stage, ready_file: Path | None = None) -> None:
        self.stage = stage
        self.ready_file = ready_file
        self.settings = stage.settings
        self.metrics = stage.metrics
        self.app = make_faust_app(stage.name, self.settings)
        self.app.monitor = StageMonitor(self.metrics, FaustMetrics.create(REGISTRY, f"faust_{stage.name}"))
        self.gate = PartitionGate(
            high=self.settings.inflight_high_per_partition,
            low=min(self.settings.inflight_low_per_partition, self.settings.inflight_high_per_partition - 1),
            max_total=self.settings.max_inflight,
            pause=lambda tps: self.app.consumer.pause_partitions(tps),
            resume=lambda tps: self.app.consumer.resume_partitions(tps),
            metrics=self.metrics,
        )
        self.failures = FailurePolicy(stage.name, self.settings, self.metrics, stage.topics.dead_letter)
        self.sender = Sender(self._produce, self.failures, self.settings)
        self._downstreams = downstreams_of(self.settings, stage.name)  # (stage, topics, group) each
        self.admission = DownstreamAdmission(
            high=self.settings.downstream_lag_high,
            low=self.settings.downstream_lag_low,
            aging_s=self.settings.scheduling.aging_s,
            gate=self.gate,
            assigned=self._assigned_inputs,
            shedding=lambda: stage.shedding,
        )
        stage.admit = self._admit
        stage.status_reporter = StatusReporter(
            stage.name, stage.topics.status, self._publish, self.settings.status_flush_s,
            on_drop=lambda n: self.metrics.errors.labels(stage.name, "status_report_dropped").inc(n),
        )
        self.poison = PoisonGuard(
            self.settings.state_path("poison", f"{group_id(self.settings, stage.name)}.db"), self.settings.poison_max_crashes
        )
        self.delivery = MessageDelivery(
            stage, self.failures, self.sender, self.poison, self.gate, self.admission,
            [topic for _, topics, _ in self._downstreams for topic in topics],
        )
        self._wakes = wakeup.wake_sender(self.settings)
        self._lag_reader: LagReader | None = None
        self._lag_schedule = LagReadSchedule(self.settings.lag_idle_interval_s)
        self._tasks: set[asyncio.Task] = set()
        self._started = asyncio.Event()
        channel = self.app.topic(*stage.input_topics, partitions=self.settings.partitions)
        self.app.agent(channel, name=f"{stage.name}-agent")(self._agent)
        self.app.timer(self.settings.lag_interval_s)(self._watch_lag)
        self.app.on_partitions_revoked.connect(self._on_revoked)
        self.app.on_partitions_assigned.connect(self._on_assigned)
        self.app.task(self._on_startup)
        self.app.on_before_shutdown.connect(self._on_shutdown)

    # Lifecycle --------------------------------------------------------------------------
    def run(self) -> None:
        """Blocking: load, then join the group and process until SIGINT/SIGTERM."""
        affinity.pin_pipeline_process(self.settings.model_cpus)  # before any thread starts
        self.stage.setup()
        serve_metrics(self.settings.metrics_port, self.settings.metrics_host)
        use_event_loop(self.settings.event_loop)
        quiet_worker(self.app, self.settings.log_level).execute_from_commandline()

    async def _on_startup(self) -> None:
        await self.stage.start()
        self._started.set()
        log.info("stage %s started on %s; consuming %s", self.stage.name, type(asyncio.get_running_loop()).__module__,
                 ", ".join(self.stage.input_topics))

    async def _on_shutdown(self, app: Any, **_: Any) -> None:
        await self.stage.stop()
        if self.stage.status_reporter is not None:
            await self.stage.status_reporter.close()
        if self._lag_reader is not None:
            await self._lag_reader.close()

    async def _on_revoked(self, app: Any, revoked: Any, **_: Any) -> None:
        self.gate.forget(revoked)
        self.stage.assigned = self.stage.assigned - {tp.partition for tp in revoked if tp.topic == self.stage.input_topics[0]}

    async def _on_assigned(self, app: Any, assigned: Any, **_: Any) -> None:
        log.info("stage %s assigned %s", self.stage.name, sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))
        self.stage.assigned = frozenset(tp.partition for tp in self._assigned_inputs())
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
            # Its message is never acked, so its partition commits no further until a restart
            # redelivers it: counted, so that an alert can say so (no known path leads here).
            self.metrics.errors.labels(self.stage.name, "message_task_failed").inc()
            log.error("stage %s: message task failed; its partition's commits are held until a restart",
                      self.stage.name, exc_info=task.exception())

    async def _process(self, event: Any, tp: Any) -> None:
        await self.delivery.process(_incoming(event.message), event.ack, tp)

    async def _produce(self, out: Outgoing) -> asyncio.Future[Any]:
        return await self._publish(out.topic, out.key, out.value, out.partition)

    async def _publish(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> asyncio.Future[Any]:
        acked = await self.app.producer.send(topic, key, value, partition, None, None)
        if self._wakes is not None:
            acked.add_done_callback(functools.partial(self._wake_reader, topic))
        return acked

    def _wake_reader(self, topic: str, acked: asyncio.Future[Any]) -> None:
        """The record is in the log: tell the stage that reads it (streams/wakeup.py)."""
        if self._wakes is not None and not acked.cancelled() and acked.exception() is None:
            record = acked.result()
            self._wakes.notify(topic, record.partition, record.offset)

    # Lag and admission ----------------------------------------------------------------------
    async def _admit(self, message: Incoming, priority: int) -> bool:
        return await self.admission.wait_for_room(message.partition, message.offset, priority, topic=message.topic)

    def _assigned_inputs(self) -> list[Any]:
        input_topic = self.stage.input_topics[0]
        return [tp for tp in self.app.consumer.assignment() if tp.topic == input_topic]

    async def _watch_lag(self) -> None:
        """Export this group's lag, feed the stage's backlog estimate, and refresh the next
        stage's lag that admission holds partitions on. One end-offsets request covers every
        group read; each group's lag is exported by its own stage (the one always current)."""
        if not self._lag_schedule.due(transport.FETCH_WAIT, time.monotonic()):
            return  # nothing to do here and nothing held: the last figures still hold
        try:
            if self._lag_reader is None:
                self._lag_reader = LagReader(self.settings)
            group = group_id(self.settings, self.stage.name)
            own, *downstream_rows = await self._lag_reader.read_groups(
                [(group, self.stage.input_topics)] + [(g, topics) for _, topics, g in self._downstreams])
            self._export_lag(group, own)
            self.stage.backlog = sum(row.lag for row in own)
            # Both lanes of a partition, and every stage fed (decode's bypass feeds two): one
            # bound on the backlog this stage put in front of the next ones.
            total: Counter[int] = Counter()
            for (downstream, _, _), rows in zip(self._downstreams, downstream_rows):
                lag: Counter[int] = Counter()
                for row in rows:
                    lag[row.partition] += row.lag
                self.stage.observe_downstream_lag(downstream, dict(lag))
                total.update(lag)
            if self._downstreams:
                self.admission.update(dict(total))
            self._lag_schedule.read(self.stage.backlog, self.admission.holding, time.monotonic())
        except Exception as exc:  # telemetry and throttling must never kill the stage
            log.warning("lag read failed: %r", exc)

    def _export_lag(self, group: str, rows: list[Any]) -> None:
        for row in rows:
            self.metrics.lag.labels(group, row.topic, str(row.partition)).set(row.lag)
            self.metrics.end_offset.labels(row.topic, str(row.partition)).set(row.end_offset)


def _incoming(m: Any) -> Incoming:
    return Incoming(
        topic=m.topic, partition=m.partition, offset=m.offset, key=m.key, value=m.value,
        timestamp=m.timestamp, received_at=time.time(),
    )
