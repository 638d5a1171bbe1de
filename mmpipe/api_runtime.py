"""What the job API holds for its whole life: the store behind one thread, a producer for the
`events` topic, and ONE consumer of the `results` topic that resolves the sync waiters.

None of them is needed for the process to start: a broker or store that is down makes the
readiness probe fail and the requests that need it answer 503, and each reconnects by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from pydantic import SecretStr

from mmpipe.client import results_reader
from mmpipe.schemas.settings import Settings
from mmpipe.stages.sink.store import JobRecord, ResultStore, StoreUnavailable, open_store
from mmpipe.stages.sink.store.group import GroupCommit
from mmpipe.schemas import BadMessage, JobResult, MediaEvent, decode_result, encode_event
from mmpipe.streams.kafka import ensure_topics, make_producer
from mmpipe.streams.retry import async_retrying
from mmpipe.streams.tasks import cancel_and_wait, close_within
from mmpipe.streams.topics import EVENTS, TopicNames
from mmpipe.streams.wakeup import wake_sender

log = logging.getLogger(__name__)

T = TypeVar("T")

# Short on purpose: a request or a probe must answer quickly when a dependency is down.
CONNECT_TIMEOUT_S = 5.0
PUBLISH_TIMEOUT_S = 10.0
RECONNECT_BACKOFF_S = (0.5, 5.0)  # first and longest pause between listener reconnects
RETRY_CONNECT_AFTER_S = 1.0  # after a failed connect, answer from it for this long


class BrokerUnavailable(Exception):
    """The broker cannot be reached (or did not answer in time)."""


# Store ------------------------------------------------------------------------------------------
class StoreWorker:
    """The store's blocking calls on one thread, off the event loop. One thread, because the
    SQLite backend serialises every transaction (reads too) and keeps a connection per thread.
    Writes of concurrent requests share transactions (group commit): a submit writes twice
    (the job, then its `accepted` stamp), and one transaction each cost a quarter of the
    submit rate (benchmarks/api_submit_cost.py)."""

    def __init__(self, url: SecretStr | str) -> None:
        self.store: ResultStore = open_store(url)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="api-store")
        self._writes = GroupCommit(self.store, self._thread)
        self._schema_ready = False

    async def call(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        future = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"the store did not answer within {timeout_s} s") from None
        except OSError as exc:
            raise _unavailable(exc) from exc

    async def ensure_schema(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Create the tables if this process comes up before the sink (idempotent)."""
        if not self._schema_ready:
            await self.call(self.store.init_schema, timeout_s=timeout_s)
            self._schema_ready = True

    async def check(self, timeout_s: float) -> None:
        await self.ensure_schema(timeout_s)
        await self.call(self.store.get_job, "readyz-probe", timeout_s=timeout_s)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the next group commit; raises what it raised (OSError as StoreUnavailable)."""
        outcome = await self._writes.outcome(fn, *args)
        if isinstance(outcome, OSError):
            raise _unavailable(outcome) from outcome
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def accept_job(self, event: MediaEvent, model: str) -> bool:
        return await self.write(self.store.accept_job, event.job_id, event.modality, model, event.created_at)

    async def mark_accepted(self, job_id: str) -> None:
        await self.write(self.store.mark_accepted, job_id, time.time())

    async def is_unpublished(self, job_id: str) -> bool:
        return await self.call(self.store.is_unpublished, job_id)

    async def get_job(self, job_id: str) -> JobRecord | None:
        return await self.call(self.store.get_job, job_id)

    async def get_result(self, job_id: str) -> JobResult | None:
        return await self.call(self.store.get_result, job_id)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call(self.store.close, timeout_s=CONNECT_TIMEOUT_S)
        self._thread.shutdown(wait=False)


def _unavailable(exc: OSError) -> StoreUnavailable:
    """An unwritable directory, a refused connection: "not now", not a failed request."""
    return StoreUnavailable(f"{type(exc).__name__}: {exc}")


# Producer ---------------------------------------------------------------------------------------
class BrokerLink:
    """The producer of `events`, connected on first use and again after a failure, so a broker
    that is down makes publishing answer 503 quickly instead of hanging the request."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = TopicNames(settings.topic_prefix, settings.scheduling.priority_lanes)
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._last_failure: tuple[float, str] | None = None
        self._wakes = wake_sender(settings)  # the decode stage fetches when told (streams/wakeup.py)

    async def producer(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                self._refuse_if_just_failed()
                try:
                    self._producer = await self._connect()
                except BrokerUnavailable as exc:
                    self._last_failure = (time.monotonic(), str(exc))
                    raise
                self._last_failure = None
            return self._producer

    def _refuse_if_just_failed(self) -> None:
        # While the broker is down, a burst of requests gets the last answer instead of each
        # opening a connection of its own.
        if self._last_failure is not None and time.monotonic() - self._last_failure[0] < RETRY_CONNECT_AFTER_S:
            raise BrokerUnavailable(self._last_failure[1])

    async def _connect(self) -> AIOKafkaProducer:
        # A fresh producer per attempt: one whose start() failed is not reusable.
        producer = make_producer(self.settings, request_timeout_ms=int(PUBLISH_TIMEOUT_S * 1000))
        try:
            await asyncio.wait_for(producer.start(), CONNECT_TIMEOUT_S)  # fails fast when refused
            # Before the first publish: the API may come up before anything created the topics.
            await asyncio.wait_for(ensure_topics(self.settings, timeout_s=CONNECT_TIMEOUT_S), CONNECT_TIMEOUT_S)
        except (KafkaError, OSError, asyncio.TimeoutError, RuntimeError) as exc:
            await close_within(producer.stop(), CONNECT_TIMEOUT_S, "the events producer")
            raise BrokerUnavailable(f"cannot connect to {self.settings.bootstrap}: {_describe(exc)}") from exc
        return producer

    async def publish(self, event: MediaEvent) -> None:
        producer = await self.producer()
        topic = self.topics.lane(EVENTS, event.priority)  # high priority: the events topic's high lane
        try:
            record = await asyncio.wait_for(
                producer.send_and_wait(topic, encode_event(event), key=event.job_id.encode()),
                PUBLISH_TIMEOUT_S,
            )
        except (KafkaError, asyncio.TimeoutError) as exc:
            raise BrokerUnavailable(f"publishing to {topic} failed: {_describe(exc)}") from exc
        if self._wakes is not None:
            self._wakes.notify(topic, record.partition, record.offset)

    async def check(self, timeout_s: float) -> None:
        """A metadata request over the producer's connection: the broker answers or it is down."""
        try:
            producer = await asyncio.wait_for(self.producer(), timeout_s)
            await asyncio.wait_for(producer.client.fetch_all_metadata(), timeout_s)
        except (KafkaError, asyncio.TimeoutError) as exc:
            raise BrokerUnavailable(f"{self.settings.bootstrap}: {_describe(exc)}") from exc

    async def close(self) -> None:
        if self._wakes is not None:
            self._wakes.close()
            self._wakes = None
        async with self._lock:
            if self._producer is not None:
                await close_within(self._producer.stop(), CONNECT_TIMEOUT_S, "the events producer")
                self._producer = None


# Results listener -------------------------------------------------------------------------------
class ResultListener:
    """ONE consumer of the `results` topic per API process, in no consumer group and from the
    latest offset, that hands each result to the requests waiting for that job_id.

    Its offsets are pinned before it reports itself running, so a waiter registered while it
    runs and before the job is published cannot miss the result. After a reconnect the offsets
    are pinned again and the store is asked once for every pending job (the sink stores a
    result before publishing it), so a result that went by during the gap is not missed either.
    """

    def __init__(self, settings: Settings, lookup: Callable[[str], Awaitable[JobResult | None]]) -> None:
        self.settings = settings
        self.topic = TopicNames(settings.topic_prefix).results
        self._lookup = lookup
        self._waiters: dict[str, set[asyncio.Future[JobResult]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._positioned = False
        self.last_error: str | None = None

    # Waiters ------------------------------------------------------------------------------------
    def register(self, job_id: str) -> asyncio.Future[JobResult]:
        future: asyncio.Future[JobResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, set()).add(future)
        return future

    def release(self, job_id: str, future: asyncio.Future[JobResult]) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None:
            waiters.discard(future)
            if not waiters:
                del self._waiters[job_id]
        future.cancel()

    def deliver(self, result: JobResult) -> None:
        for future in self._waiters.get(result.job_id, ()):
            if not future.done():
                future.set_result(result)

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    # Lifecycle ----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and self._positioned

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="results-listener")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        # Connecting is retried with full-jitter backoff; once connected, a failure ends the
        # session after the shortest pause and the next one starts the backoff over. The loop
        # survives anything.
        first, longest = RECONNECT_BACKOFF_S
        while True:
            async for attempt in async_retrying(Exception, base_s=first, cap_s=longest, on_retry=self._report):
                with attempt:
                    consumer = await self._connect()
            try:
                self._positioned, self.last_error = True, None
                await self._sweep_store()
                await self._consume(consumer)
            except Exception as exc:
                self._report(exc, 0, first)
                await asyncio.sleep(first)
            finally:
                self._positioned = False
                await close_within(consumer.stop(), CONNECT_TIMEOUT_S, "the results consumer")

    def _report(self, exc: BaseException, attempt: int, delay: float) -> None:
        self.last_error = _describe(exc)
        log.warning("results listener: %s; reconnecting in %.1f s", self.last_error, delay)

    async def _connect(self) -> AIOKafkaConsumer:
        consumer = results_reader(self.settings, offset_reset="latest")
        try:
            # The API may come up before the pipeline has created the topics.
            await asyncio.wait_for(ensure_topics(self.settings, timeout_s=CONNECT_TIMEOUT_S), CONNECT_TIMEOUT_S * 2)
            await asyncio.wait_for(consumer.start(), CONNECT_TIMEOUT_S)
            partitions = consumer.partitions_for_topic(self.topic)
            if not partitions:
                raise RuntimeError(f"no partitions of {self.topic} in the cluster metadata")
            tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the end offsets now, not lazily on the first fetch
                await asyncio.wait_for(consumer.position(tp), CONNECT_TIMEOUT_S)
        except BaseException:
            await close_within(consumer.stop(), CONNECT_TIMEOUT_S, "the results consumer")
            raise
        return consumer

    async def _consume(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                for record in records:
                    self._deliver_record(record.value)

    def _deliver_record(self, value: bytes | None) -> None:
        if value is None:
            return  # a tombstone: nothing to deliver
        try:
            self.deliver(decode_result(value))
        except BadMessage as exc:
            log.warning("results listener: skipping an unreadable result: %s", exc)

    async def _sweep_store(self) -> None:
        for job_id in list(self._waiters):
            try:
                result = await self._lookup(job_id)
            except StoreUnavailable as exc:
                log.warning("results listener: store lookup for %s failed: %s", job_id, exc)
                continue
            if result is not None:
                self.deliver(result)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    text = str(exc)
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}" if text else name
