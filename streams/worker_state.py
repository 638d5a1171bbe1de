"""The execution side's report for routing: each inference worker publishes its WorkerState to
the compacted `workers` topic (keyed by worker) every worker_state_interval_s, and every
router reads that topic from the beginning without a group, so it sees every worker.

ServiceClock is the worker's measurement: seconds per item (EWMA of batch time / batch size)
and the queue wait per ready partition (EWMA of produce-to-batch-start). Each report also
carries the worker's backlog: the items it holds, not yet answered."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from mmpipe.schemas import BadMessage, to_json
from mmpipe.schemas.codec import from_json
from mmpipe.schemas.events import WorkerState
from mmpipe.schemas.settings import Settings
from mmpipe.streams.kafka import groupless_consumer, make_producer
from mmpipe.streams.retry import retry_async
from mmpipe.streams.tasks import cancel_and_wait
from mmpipe.streams.topics import TopicNames

log = logging.getLogger(__name__)

EWMA_WEIGHT = 0.2  # of the newest sample: smooths one odd batch, follows a change in ~5 batches


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + EWMA_WEIGHT * (sample - old)


@dataclass
class ServiceClock:
    """What the worker measures of itself, reported as-is (the router decides what it means)."""

    item_s: float | None = None
    waits_s: dict[int, float] = field(default_factory=dict)

    def item_done(self, batch_seconds: float, batch_size: int) -> None:
        """One item finished in a batch of batch_size that took batch_seconds."""
        self.item_s = _ewma(self.item_s, batch_seconds / max(batch_size, 1))

    def waited(self, partition: int, seconds: float) -> None:
        self.waits_s[partition] = _ewma(self.waits_s.get(partition), max(seconds, 0.0))


class _Background:
    """One task of the stage's event loop, started with the stage and cancelled at its stop."""

    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        raise NotImplementedError


class WorkerReporter(_Background):
    """Publishes this worker's state periodically; `snapshot` says what it is right now."""

    def __init__(self, settings: Settings, snapshot: Callable[[], WorkerState]) -> None:
        self.settings = settings
        self.snapshot = snapshot
        self.topic = TopicNames(settings.topic_prefix).workers

    # (first, longest) wait between connection attempts: a worker that never reports is never
    # routed to, so a broker that was not up at start must not silence it for good.
    CONNECT_BACKOFF_S = (0.25, 1.0)

    # How long a stopping worker waits for its tombstone's ack: inside the stage stop's first
    # cancellation (streams/tasks.py: RECANCEL_AFTER_S), so a second one cannot cut it short.
    TOMBSTONE_TIMEOUT_S = 0.4

    async def _run(self) -> None:
        first, longest = self.CONNECT_BACKOFF_S
        producer = await retry_async(self._connect, KafkaError, base_s=first, cap_s=longest, on_retry=self._retrying)
        key = self.snapshot().worker.encode()
        try:
            while True:
                try:
                    await producer.send_and_wait(self.topic, to_json(self.snapshot()), key=key)
                except KafkaError as exc:  # the next report will do; routing tolerates stale state
                    log.info("worker state not published: %s", exc)
                await asyncio.sleep(self.settings.scheduling.worker_state_interval_s)
        finally:
            try:
                await self._retire(producer, key)
            finally:
                await producer.stop()

    async def _retire(self, producer: Any, key: bytes) -> None:
        """A tombstone for this worker: routers forget it at once instead of after the
        staleness bound, and compaction drops its key (every restart is a new worker name)."""
        try:
            await asyncio.wait_for(producer.send_and_wait(self.topic, None, key=key), self.TOMBSTONE_TIMEOUT_S)
        except (KafkaError, asyncio.TimeoutError) as exc:  # the staleness bound forgets it instead
            log.info("worker state tombstone not published: %s", exc)

    async def _connect(self) -> Any:
        producer = make_producer(self.settings)
        try:
            await producer.start()
        except BaseException:
            await producer.stop()
            raise
        return producer

    def _retrying(self, exc: BaseException, attempt: int, delay: float) -> None:
        log.info("worker state reporter cannot reach the broker: %s; retrying in %.2f s", exc, delay)


class WorkerStateFeed(_Background):
    """Follows the `workers` topic and hands every report to `observe` (the router's)."""

    # (first, longest) wait before reconnecting: the router routes on stale state meanwhile,
    # so it comes back within a second.
    RECONNECT_BACKOFF_S = (0.25, 1.0)

    def __init__(self, settings: Settings, observe: Callable[[WorkerState], None],
                 forget: Callable[[str], None] = lambda worker: None) -> None:
        self.settings = settings
        self.observe = observe
        self.forget = forget  # a worker's tombstone: it stopped
        self.topic = TopicNames(settings.topic_prefix).workers

    async def _run(self) -> None:
        # The broker may not be up yet, or may restart: keep following, for as long as the stage runs.
        first, longest = self.RECONNECT_BACKOFF_S
        await retry_async(self._follow_once, KafkaError, base_s=first, cap_s=longest, on_retry=self._reconnecting)

    async def _follow_once(self) -> None:
        """One connection to the broker, followed until it fails."""
        consumer = groupless_consumer(self.settings, self.topic, offset_reset="earliest")
        try:
            await consumer.start()
            await self._follow(consumer)
        finally:
            await consumer.stop()

    def _reconnecting(self, exc: BaseException, attempt: int, delay: float) -> None:
        log.info("worker state feed interrupted: %s; reconnecting in %.2f s", exc, delay)

    async def _follow(self, consumer: object) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=1000)  # type: ignore[attr-defined]
            for records in batch.values():
                for record in records:
                    self._deliver(record.key, record.value)

    def _deliver(self, key: bytes | None, value: bytes | None) -> None:
        if value is None:  # a tombstone: the worker stopped
            if key:
                self.forget(key.decode(errors="replace"))
            return
        try:
            self.observe(from_json(value, WorkerState))
        except BadMessage as exc:  # a newer or broken writer: ignore it, keep routing on the rest
            log.warning("unreadable worker state ignored: %s", exc)


def snapshot(worker: str, partitions: set[int], ready: bool, models: list[str], clock: ServiceClock,
             backlog: int) -> WorkerState:
    return WorkerState(
        worker=worker, partitions=sorted(partitions), ready=ready, models=models, item_s=clock.item_s,
        waits_s={str(p): round(w, 6) for p, w in clock.waits_s.items()}, at=time.time(), backlog=backlog,
    )
