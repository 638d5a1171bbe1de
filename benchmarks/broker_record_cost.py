"""What the embedded broker (Tansu) spends per record by the record's size: `--records` records
produced one per request (as the stages do: single-record batches, each awaited), then read back
by one consumer; the broker's CPU per record for each part, from /proc. Sizes: a status or
prediction record (1 KB), an image event as an envelope (85 KB) and as JSON with base64
(113 KB), a decoded 224 crop (150 KB).

    .venv/bin/python benchmarks/broker_record_cost.py [--records 300]
"""

from __future__ import annotations

import argparse
import asyncio

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmpipe.streams.broker import EmbeddedBroker

SIZES = (1_000, 85_000, 113_000, 150_000)


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def one_size(bootstrap: str, broker: psutil.Process, size: int, records: int) -> tuple[float, float]:
    topic = f"cost-{size}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 4, 1)])
    await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_batch_size=1 << 20, max_request_size=1 << 22)
    await producer.start()
    payload = b"x" * size
    await producer.send_and_wait(topic, payload, partition=0)  # topic metadata, first writes
    await asyncio.sleep(0.5)
    before = cpu_s(broker)
    for i in range(records):
        await producer.send_and_wait(topic, payload, partition=i % 4)
    produced = cpu_s(broker)
    # A fetch held for a wait (20 ms, the stages' polling wait): Tansu answers 0 ms fetches empty.
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                fetch_max_wait_ms=20, max_partition_fetch_bytes=1 << 22, fetch_max_bytes=1 << 24)
    await consumer.start()
    got = 0
    while got < records + 1:
        batches = await consumer.getmany(timeout_ms=500)
        got += sum(len(batch) for batch in batches.values())
    read = cpu_s(broker)
    await consumer.stop()
    await producer.stop()
    return (produced - before) / records * 1000, (read - produced) / records * 1000


async def measure(bootstrap: str, pid: int, records: int) -> None:
    broker = psutil.Process(pid)
    print(f"embedded broker CPU ms per record, {records} records each produced in its own request, then read back:")
    for size in SIZES:
        produce_ms, read_ms = await one_size(bootstrap, broker, size, records)
        print(f"  {size:>7} B: produce {produce_ms:.2f}, read {read_ms:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300)
    args = parser.parse_args()
    with EmbeddedBroker(port=0) as broker:
        asyncio.run(measure(broker.bootstrap, broker.process.pid, args.records))


if __name__ == "__main__":
    main()
