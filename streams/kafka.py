"""Plain aiokafka clients for everything that is not a faust stage: producers (CLI, API,
benchmarks), topic creation, and lag read-outs. All take their settings from one place, so
SASL/TLS settings reach every client alike."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from mmpipe.schemas.settings import Settings
from mmpipe.streams.topics import TopicNames
from mmpipe.streams.topology import stage_spec

log = logging.getLogger(__name__)


def group_id(settings: Settings, stage: str) -> str:
    return f"{settings.topic_prefix}-{stage}"


def stage_input_topics(settings: Settings, stage: str) -> list[str]:
    return [topic.name(settings.topic_prefix) for topic in stage_spec(stage).inputs]


def downstream_of(settings: Settings, stage: str) -> tuple[str, str] | None:
    """(output topic, consuming group) of the stage after `stage`; None after the sink."""
    spec = stage_spec(stage)
    if spec.output is None or spec.downstream is None:
        return None
    return spec.output.name(settings.topic_prefix), group_id(settings, spec.downstream)


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    sec = settings.security
    if sec.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    context = ssl.create_default_context(cafile=str(sec.ssl_cafile) if sec.ssl_cafile else None)
    if sec.ssl_certfile:
        context.load_cert_chain(str(sec.ssl_certfile), str(sec.ssl_keyfile) if sec.ssl_keyfile else None)
    return context


def client_kwargs(settings: Settings) -> dict[str, Any]:
    sec = settings.security
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap,
        "security_protocol": sec.security_protocol,
    }
    if sec.security_protocol.startswith("SASL"):
        kwargs.update(
            sasl_mechanism=sec.sasl_mechanism or "PLAIN",
            sasl_plain_username=sec.sasl_username,
            sasl_plain_password=sec.sasl_password,
        )
    context = ssl_context(settings)
    if context is not None:
        kwargs["ssl_context"] = context
    return kwargs


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    # No idempotent producer / transactions: the embedded broker refuses InitProducerId, and
    # duplicates are made harmless by job_id-keyed idempotent writes downstream.
    options = dict(acks="all", linger_ms=0, max_request_size=settings.max_message_bytes)
    if settings.single_record_batches:
        options["max_batch_size"] = 1  # see Settings.single_record_batches
    options.update(overrides)
    return AIOKafkaProducer(**client_kwargs(settings), **options)


async def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> None:
    """Create every pipeline topic if missing (idempotent; safe from every process)."""
    names = TopicNames(settings.topic_prefix)
    admin = AIOKafkaAdminClient(**client_kwargs(settings))
    await _start_with_retry(admin.start, timeout_s)
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(name, settings.partitions, settings.replication, topic_configs=spec.kafka_config())
            for name, spec in names.all()
            if name not in existing
        ]
        if new:
            response = await admin.create_topics(new)
            for topic, code, message in _topic_errors(response):
                if code not in (0, TopicAlreadyExistsError.errno):
                    raise RuntimeError(f"creating topic {topic} failed: {code} {message}")
    finally:
        await admin.close()


def _topic_errors(response: Any) -> Iterable[tuple[str, int, str]]:
    for entry in getattr(response, "topic_errors", []):
        topic, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else ""
        yield topic, code, message


async def _start_with_retry(start: Any, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await start()
            return
        except KafkaError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    end_offset: int
    committed: int | None

    @property
    def lag(self) -> int:
        return self.end_offset - (self.committed or 0)


class LagReader:
    """Reads end offsets and a group's committed offsets without joining the group
    (what kafka-consumer-groups --describe shows)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._consumers: dict[str, AIOKafkaConsumer] = {}
        self._admin: AIOKafkaAdminClient | None = None

    async def _consumer(self, group: str) -> AIOKafkaConsumer:
        if group not in self._consumers:
            consumer = AIOKafkaConsumer(
                **client_kwargs(self.settings), group_id=group, enable_auto_commit=False
            )
            await consumer.start()
            self._consumers[group] = consumer
        return self._consumers[group]

    async def read(self, group: str, topics: list[str]) -> list[PartitionLag]:
        consumer = await self._consumer(group)
        tps = [
            TopicPartition(topic, p)
            for topic in topics
            for p in sorted(consumer.partitions_for_topic(topic) or await _partitions(consumer, topic))
        ]
        if not tps:
            return []
        ends = await consumer.end_offsets(tps)
        rows = []
        for tp in tps:
            committed = await consumer.committed(tp)
            rows.append(PartitionLag(group, tp.topic, tp.partition, ends[tp], committed))
        return rows

    async def read_stage(self, stage: str) -> list[PartitionLag]:
        """The lag of a stage's group on its input topics."""
        return await self.read(group_id(self.settings, stage), stage_input_topics(self.settings, stage))

    async def group_members(self, group: str) -> int | None:
        """Members of the group now (one per stage process); None if the broker won't say."""
        try:
            if self._admin is None:
                admin = AIOKafkaAdminClient(**client_kwargs(self.settings))
                await admin.start()
                self._admin = admin
            responses = await self._admin.describe_consumer_groups([group])
        except (KafkaError, OSError, asyncio.TimeoutError) as exc:
            log.info("describing group %s failed: %s", group, exc)
            return None
        for response in responses:
            for error_code, group_name, _state, _protocol_type, _protocol, members, *_ in response.groups:
                if group_name == group:
                    # A group nobody has joined is reported "Dead" with no members: 0 is right.
                    return len(members) if error_code == 0 else None
        return None

    async def close(self) -> None:
        for consumer in self._consumers.values():
            await consumer.stop()
        self._consumers.clear()
        if self._admin is not None:
            await self._admin.close()
            self._admin = None


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer.topics()  # refreshes cluster metadata for every topic
    return consumer.partitions_for_topic(topic) or set()
