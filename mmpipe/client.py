"""The producer side and the downstream reader: build events, publish them keyed by job_id,
and read results from the `results` topic."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import RecordMetadata

from mmpipe.schemas.settings import Settings
from mmpipe.schemas import SCHEMA_VERSION, JobResult, MediaEvent, ModelRef, Payload, decode_result, encode_event
from mmpipe.schemas.events import NORMAL_PRIORITY
from mmpipe.streams.kafka import groupless_consumer, make_producer
from mmpipe.streams.topics import EVENTS, TopicNames
from mmpipe.streams.wakeup import wake_sender

EXTENSIONS = {
    "image": {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff"},
    "audio": {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac"},
    "video": {".mp4", ".mkv", ".webm", ".mov", ".avi"},
    "text": {".txt", ".md"},
}


def guess_modality(path: Path) -> str:
    suffix = path.suffix.lower()
    for modality, suffixes in EXTENSIONS.items():
        if suffix in suffixes:
            return modality
    raise ValueError(f"cannot tell the modality of {path.name}; pass --modality")


def new_job_id(prefix: str = "job") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def parse_model(text: str | None) -> ModelRef | None:
    if not text:
        return None
    name, _, version = text.partition(":")
    if not version:
        raise ValueError(f"model must be NAME:VERSION, got {text!r}")
    return ModelRef(name, version)


def make_event(
    modality: str,
    *,
    data: bytes | None = None,
    text: str | None = None,
    uri: str | None = None,
    job_id: str | None = None,
    model: ModelRef | None = None,
    deadline_s: float | None = None,
    attributes: dict[str, str] | None = None,
    priority: int = NORMAL_PRIORITY,
    on_timeout: str = "reject",
) -> MediaEvent:
    now = time.time()
    return MediaEvent(
        job_id=job_id or new_job_id(modality),
        modality=modality,  # type: ignore[arg-type]
        payload=Payload(data=data, text=text, uri=uri),
        schema_version=SCHEMA_VERSION,
        created_at=now,
        model=model,
        deadline=None if deadline_s is None else now + deadline_s,
        attributes=attributes or {},
        priority=priority,
        on_timeout=on_timeout,  # type: ignore[arg-type]
    )


def event_for_file(path: Path, *, inline: bool, modality: str | None = None, **kwargs: object) -> MediaEvent:
    modality = modality or guess_modality(path)
    if modality == "text" and inline:
        return make_event(modality, text=path.read_text("utf-8"), **kwargs)  # type: ignore[arg-type]
    if inline:
        return make_event(modality, data=path.read_bytes(), **kwargs)  # type: ignore[arg-type]
    return make_event(modality, uri=str(path.resolve()), **kwargs)  # type: ignore[arg-type]


class Publisher:
    """Publishes events to the `events` topic (high-priority ones to its high lane), keyed by
    job_id (same job -> same partition)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = TopicNames(settings.topic_prefix, settings.scheduling.priority_lanes)
        self.topic = self.topics.events
        self._producer = make_producer(settings)
        # Tells the decode stage on this machine that events are in (it fetches then, instead
        # of polling): streams/wakeup.py.
        self._wakes = wake_sender(settings)

    async def __aenter__(self) -> Publisher:
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._producer.stop()
        finally:
            if self._wakes is not None:
                self._wakes.close()

    async def publish(self, event: MediaEvent) -> None:
        topic = self.topics.lane(EVENTS, event.priority)
        self._announce([await self._producer.send_and_wait(topic, encode_event(event), key=event.job_id.encode())])

    async def publish_raw(self, key: bytes | None, value: bytes, topic: str | None = None) -> None:
        """For tests and fault injection: put arbitrary bytes on the events topic (or `topic`)."""
        self._announce([await self._producer.send_and_wait(topic or self.topic, value, key=key)])

    async def publish_many(self, events: Iterable[MediaEvent]) -> int:
        sent = [(self.topics.lane(EVENTS, e.priority), e) for e in events]
        futures = [await self._producer.send(topic, encode_event(e), key=e.job_id.encode()) for topic, e in sent]
        self._announce(await asyncio.gather(*futures))
        return len(futures)

    def _announce(self, records: Iterable[RecordMetadata]) -> None:
        """After the broker acknowledged `records`: a wake-up naming the last of each partition
        (its reader tells news from records it already fetched: streams/wakeup.py)."""
        if self._wakes is None:
            return
        last: dict[tuple[str, int], int] = {}
        for record in records:
            key = (record.topic, record.partition)
            last[key] = max(record.offset, last.get(key, record.offset))
        for (topic, partition), offset in last.items():
            self._wakes.notify(topic, partition, offset)


def results_reader(settings: Settings, *topics: str, offset_reset: str) -> AIOKafkaConsumer:
    """A consumer without a group (every reader sees every result)."""
    return groupless_consumer(settings, *topics, offset_reset=offset_reset)


async def follow_results(
    settings: Settings, *, from_beginning: bool = True, idle_timeout_s: float | None = None
) -> AsyncIterator[JobResult]:
    """Read the `results` topic (no consumer group: every reader sees every result)."""
    consumer = results_reader(settings, TopicNames(settings.topic_prefix).results,
                              offset_reset="earliest" if from_beginning else "latest")
    await consumer.start()
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=int((idle_timeout_s or 1.0) * 1000))
            if not batch and idle_timeout_s is not None:
                return
            for records in batch.values():
                for record in records:
                    if record.value is not None:
                        yield decode_result(record.value)
    finally:
        await consumer.stop()


async def collect_results(
    settings: Settings,
    job_ids: set[str],
    timeout_s: float,
    on_result: Callable[[JobResult], None] | None = None,
) -> dict[str, JobResult]:
    """Wait until every job in `job_ids` has a result on the topic (or the timeout passes)."""
    found: dict[str, JobResult] = {}

    async def read() -> None:
        async for result in follow_results(settings):
            if result.job_id in job_ids and result.job_id not in found:
                found[result.job_id] = result
                if on_result is not None:
                    on_result(result)
                if len(found) == len(job_ids):
                    return

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        pass
    return found
