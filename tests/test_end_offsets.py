"""End offsets for the lag read-outs: from a fetch's high watermarks on the embedded broker
(streams/kafka.py high_watermarks), ListOffsets where the broker refuses such a fetch."""

import asyncio

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmpipe.schemas.settings import Settings
from mmpipe.streams import kafka
from mmpipe.streams.kafka import LagReader, groupless_consumer, high_watermarks, make_producer


async def create(bootstrap: str, *topics: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 2, 1) for topic in topics])
    finally:
        await admin.close()


async def produce(producer: AIOKafkaProducer, topic: str, counts: dict[int, int]) -> None:
    await producer.start()
    try:
        acks = [await producer.send(topic, b"x", partition=p) for p, n in counts.items() for _ in range(n)]
        await asyncio.gather(*acks)
    finally:
        await producer.stop()


def test_high_watermarks_match_the_records_written_in_single_and_multi_record_batches(broker):
    async def run() -> None:
        settings = Settings(bootstrap=broker.bootstrap)
        await create(broker.bootstrap, "hwm-single", "hwm-batched")
        await produce(make_producer(settings), "hwm-single", {0: 3, 1: 5})
        # linger: several records per producer batch, which ListOffsets on this broker miscounts
        await produce(AIOKafkaProducer(bootstrap_servers=broker.bootstrap, linger_ms=100), "hwm-batched", {0: 7})
        consumer = groupless_consumer(settings, offset_reset="latest")
        await consumer.start()
        try:
            await consumer.topics()
            tps = [TopicPartition(t, p) for t in ("hwm-single", "hwm-batched") for p in (0, 1)]
            ends = await high_watermarks(consumer, tps)
            assert ends == {tps[0]: 3, tps[1]: 5, tps[2]: 7, tps[3]: 0}
            single = await consumer.end_offsets(tps[:2])
            assert single == {tps[0]: 3, tps[1]: 5}  # the two ways agree on single-record batches
        finally:
            await consumer.stop()

    asyncio.run(run())


def test_the_lag_reader_falls_back_to_list_offsets_once_the_broker_refuses_the_fetch(broker, monkeypatch):
    async def run() -> None:
        settings = Settings(bootstrap=broker.bootstrap)
        await create(broker.bootstrap, "hwm-refused")
        await produce(make_producer(settings), "hwm-refused", {0: 2, 1: 1})
        tried = []

        async def refused(consumer, tps):
            tried.append(tps)
            raise kafka.FetchRefused("error 1")  # what Apache Kafka's OFFSET_OUT_OF_RANGE comes to

        monkeypatch.setattr(kafka, "high_watermarks", refused)
        reader = LagReader(settings)
        try:
            for _ in range(2):
                rows = await reader.read("no-such-group", ["hwm-refused"])
                assert {(r.partition, r.end_offset, r.lag) for r in rows} == {(0, 2, 2), (1, 1, 1)}
        finally:
            await reader.close()
        assert len(tried) == 1  # refused once: ListOffsets from then on

    asyncio.run(run())


def test_a_leader_not_known_yet_reads_list_offsets_once_and_keeps_the_fetch(broker, monkeypatch):
    async def run() -> None:
        settings = Settings(bootstrap=broker.bootstrap)
        await create(broker.bootstrap, "hwm-no-leader")
        await produce(make_producer(settings), "hwm-no-leader", {0: 4})
        answers = [None]  # the first read finds no leader; the broker was never asked
        calls = []
        real = kafka.high_watermarks

        async def first_without_leader(consumer, tps):
            calls.append(tps)
            return answers.pop() if answers else await real(consumer, tps)

        monkeypatch.setattr(kafka, "high_watermarks", first_without_leader)
        reader = LagReader(settings)
        try:
            for _ in range(2):
                rows = await reader.read("no-such-group", ["hwm-no-leader"])
                assert {(r.partition, r.end_offset) for r in rows} == {(0, 4), (1, 0)}
        finally:
            await reader.close()
        assert len(calls) == 2  # still the fetch on the second read

    asyncio.run(run())


def test_one_read_out_of_several_groups_asks_for_all_their_end_offsets_at_once(broker, monkeypatch):
    """A stage reads its own group's lag and the next stages': one end-offsets request for all
    their topics, each group's committed offsets its own."""
    async def run() -> None:
        settings = Settings(bootstrap=broker.bootstrap)
        await create(broker.bootstrap, "lag-in", "lag-out")
        await produce(make_producer(settings), "lag-in", {0: 3, 1: 1})
        await produce(make_producer(settings), "lag-out", {1: 2})
        consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="lag-in-group",
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign([TopicPartition("lag-in", 0)])
            await consumer.commit({TopicPartition("lag-in", 0): 2})
        finally:
            await consumer.stop()
        calls = []
        real = kafka.high_watermarks

        async def counted(consumer, tps):
            calls.append(sorted(tps))
            return await real(consumer, tps)

        monkeypatch.setattr(kafka, "high_watermarks", counted)
        reader = LagReader(settings)
        try:
            own, downstream = await reader.read_groups([("lag-in-group", ["lag-in"]), ("lag-out-group", ["lag-out"])])
        finally:
            await reader.close()
        assert {(r.group, r.partition, r.end_offset, r.lag) for r in own} == {
            ("lag-in-group", 0, 3, 1), ("lag-in-group", 1, 1, 1)}
        assert {(r.group, r.partition, r.end_offset, r.lag) for r in downstream} == {
            ("lag-out-group", 0, 0, 0), ("lag-out-group", 1, 2, 2)}
        assert len(calls) == 1 and {tp.topic for tp in calls[0]} == {"lag-in", "lag-out"}

    asyncio.run(run())
