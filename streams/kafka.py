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
from aiokafka.protocol.fetch import FetchRequest

from mmpipe.schemas.settings import Settings, secret
from mmpipe.streams.topics import TopicNames, with_lanes
from mmpipe.streams.retry import retry_async
from mmpipe.streams.topology import stage_spec

log = logging.getLogger(__name__)


def group_id(settings: Settings, stage: str) -> str:
    return f"{settings.topic_prefix}-{stage}"


def stage_input_topics(settings: Settings, stage: str) -> list[str]:
    return [topic.name(settings.topic_prefix) for topic in stage_spec(stage, settings).inputs]


def downstreams_of(settings: Settings, stage: str) -> list[tuple[str, list[str], str]]:
    """(next stage, its input topics from `stage`: an output and its high lane, its group) for
    each stage `stage` feeds; none after the sink."""
    return [
        (downstream, [t.name(settings.topic_prefix) for t in with_lanes(topic)], group_id(settings, downstream))
        for topic, downstream in stage_spec(stage, settings).outputs()
    ]


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
        "client_id": settings.client_id,
        "security_protocol": sec.security_protocol,
    }
    if sec.security_protocol.startswith("SASL"):
        kwargs.update(
            sasl_mechanism=sec.sasl_mechanism or "PLAIN",
            sasl_plain_username=sec.sasl_username,
            sasl_plain_password=secret(sec.sasl_password),
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


def groupless_consumer(settings: Settings, *topics: str, offset_reset: str) -> AIOKafkaConsumer:
    """A consumer without a group (every reader sees every record), sized for the largest
    message; subscribed to `topics`, or to none when the caller assigns partitions itself."""
    return AIOKafkaConsumer(
        *topics,
        **client_kwargs(settings),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset=offset_reset,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
        max_partition_fetch_bytes=settings.max_message_bytes,
        fetch_max_bytes=settings.max_message_bytes * 2,
    )


async def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> None:
    """Create every pipeline topic if missing (idempotent; safe from every process)."""
    names = TopicNames(settings.topic_prefix)
    admin = AIOKafkaAdminClient(**client_kwargs(settings))
    await retry_async(admin.start, KafkaError, base_s=0.25, cap_s=1.0, deadline_s=timeout_s)
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
    (what kafka-consumer-groups --describe shows): one end-offsets request (a fetch past the
    end, or ListOffsets) through a group-less consumer and one OffsetFetch per group through
    the admin client."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._consumer: AIOKafkaConsumer | None = None  # group-less: metadata and end offsets
        self._admin: AIOKafkaAdminClient | None = None
        self._coordinators: dict[str, int] = {}  # group -> coordinator node (saves a lookup)
        self._fetch_refused = False

    async def _metadata_consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = groupless_consumer(self.settings, offset_reset="latest")  # never fetches
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def _admin_client(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            admin = AIOKafkaAdminClient(**client_kwargs(self.settings))
            await admin.start()
            self._admin = admin
        return self._admin

    async def read(self, group: str, topics: list[str]) -> list[PartitionLag]:
        return (await self.read_groups([(group, topics)]))[0]

    async def read_groups(self, reads: list[tuple[str, list[str]]]) -> list[list[PartitionLag]]:
        """The lag of each (group, topics): the end offsets of all their topics in one request,
        then one OffsetFetch per group."""
        consumer = await self._metadata_consumer()
        tps_of = [[TopicPartition(topic, p) for topic in topics for p in sorted(await _partitions_of(consumer, topic))]
                  for _, topics in reads]
        every_tp = list(dict.fromkeys(tp for tps in tps_of for tp in tps))
        if not every_tp:
            return [[] for _ in reads]
        ends = await self.end_offsets(consumer, every_tp)
        rows = []
        for (group, _), tps in zip(reads, tps_of):
            committed = await self.committed(group, tps) if tps else {}
            rows.append([PartitionLag(group, tp.topic, tp.partition, ends[tp], committed.get(tp)) for tp in tps])
        return rows

    async def end_offsets(self, consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        if self.settings.end_offsets_from_fetch and not self._fetch_refused:
            try:
                ends = await high_watermarks(consumer, tps)
            except FetchRefused as exc:  # a broker that checks fetch offsets: ListOffsets from now on
                self._fetch_refused = True
                log.info("%s; reading end offsets with ListOffsets", exc)
            else:
                if ends is not None:
                    return ends
        return await consumer.end_offsets(tps)  # also while a partition's leader is not known yet

    async def committed(self, group: str, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The group's committed offsets; partitions it never committed are left out."""
        admin = await self._admin_client()
        try:
            offsets = await admin.list_consumer_group_offsets(group, self._coordinators.get(group), tps)
        except KafkaError:
            self._coordinators.pop(group, None)  # the coordinator may have moved: look it up next time
            raise
        if group not in self._coordinators:
            self._coordinators[group] = await admin.find_coordinator(group)
        return {TopicPartition(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items() if meta.offset >= 0}

    async def read_stage(self, stage: str) -> list[PartitionLag]:
        """The lag of a stage's group on its input topics."""
        return await self.read(group_id(self.settings, stage), stage_input_topics(self.settings, stage))

    async def group_members(self, group: str) -> int | None:
        """Members of the group now (one per stage process); None if the broker won't say."""
        try:
            responses = await (await self._admin_client()).describe_consumer_groups([group])
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
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._admin is not None:
            await self._admin.close()
            self._admin = None


# Far past any partition's end: the embedded broker answers a fetch there without looking at
# the stored batches (the offset is not below its high watermark).
PAST_THE_END = 1 << 62


class FetchRefused(KafkaError):
    """The broker would not answer a fetch past a partition's end with its high watermark."""


async def high_watermarks(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> dict[TopicPartition, int] | None:
    """End offsets from the high watermarks of one fetch per leader, asked past each partition's
    end so that no records come back. On the embedded broker a ListOffsets request lists every
    batch the partition ever stored (its cost grows with the partition:
    benchmarks/broker_partition_growth.py); this fetch reads one stored counter, exact with
    multi-record batches too. None while a partition's leader is not known; FetchRefused when
    the broker answers with an error (Apache Kafka checks the offset: OFFSET_OUT_OF_RANGE) or
    leaves a partition out."""
    client = consumer._client  # noqa: SLF001
    by_leader: dict[int, list[TopicPartition]] = {}
    for tp in tps:
        leader = client.cluster.leader_for_partition(tp)
        if leader is None or leader < 0:
            return None
        by_leader.setdefault(leader, []).append(tp)
    ends: dict[TopicPartition, int] = {}
    for leader, group in by_leader.items():
        topics: dict[str, list[tuple[int, int, int]]] = {}
        for tp in group:
            topics.setdefault(tp.topic, []).append((tp.partition, PAST_THE_END, 1))
        # A max wait of 0 is answered with no partitions at all by the embedded broker.
        response = await client.send(leader, FetchRequest(1, 1, 1, 0, list(topics.items())))
        for topic, partitions in response.topics:
            for partition, error_code, highwater, *_ in partitions:
                if error_code != 0 or highwater < 0:
                    raise FetchRefused(f"the broker answered a fetch past {topic}/{partition}'s end with error {error_code}")
                ends[TopicPartition(topic, partition)] = highwater
    missing = [tp for tp in tps if tp not in ends]
    if missing:
        raise FetchRefused(f"the broker left {missing[0].topic}/{missing[0].partition} out of a fetch past its end")
    return ends


async def _partitions_of(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    known = consumer.partitions_for_topic(topic)
    if known:
        return known
    await consumer.topics()  # refreshes cluster metadata for every topic
    return consumer.partitions_for_topic(topic) or set()
