"""Does the embedded broker (Tansu, memory storage) slow down as its topics fill? One run.

Round trip of a small record (produce -> a consumer already fetching with the stages' 20 ms
fetch wait) and the broker's CPU per round trip, while ~150 KB records (an image job's size on
`ready`) pile up: in another topic, and in the very partition the small records travel.

    .venv/bin/python benchmarks/broker_log_growth.py [--steps 6] [--per-step 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from mmpipe.streams.broker import EmbeddedBroker

PINGS = 40
BLOB = 150_000


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def probe(broker: EmbeddedBroker, bulk_topic: str, steps: int, per_step: int) -> None:
    boot = f"127.0.0.1:{broker.port}"
    producer = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=0, max_request_size=1 << 22)
    await producer.start()
    ping = TopicPartition(f"ping-{bulk_topic}", 0)
    bulk = ping.topic if bulk_topic == "same" else f"bulk-{bulk_topic}"
    for topic in {ping.topic, bulk}:
        await producer.send_and_wait(topic, b"x", partition=0)
    consumer = AIOKafkaConsumer(bootstrap_servers=boot, fetch_max_wait_ms=20, auto_offset_reset="latest")
    await consumer.start()
    consumer.assign([ping])
    await consumer.seek_to_end(ping)
    blob, stored = os.urandom(BLOB), 0
    try:
        for _ in range(steps):
            latencies, cpu_before = [], cpu_s(broker.process.pid)
            for _ in range(PINGS):
                started = time.perf_counter()
                await producer.send_and_wait(ping.topic, b"p", partition=0)
                await consumer.getone()
                latencies.append((time.perf_counter() - started) * 1000)
            cpu_ms = (cpu_s(broker.process.pid) - cpu_before) / PINGS * 1000
            latencies.sort()
            print(f"{bulk_topic:>5} {stored:6d} records ({stored * BLOB / 1e6:5.0f} MB): round trip p50 "
                  f"{latencies[PINGS // 2]:5.1f} ms, p90 {latencies[PINGS * 9 // 10]:5.1f} ms; broker CPU "
                  f"{cpu_ms:4.2f} ms per round trip", flush=True)
            for _ in range(per_step):
                await producer.send(bulk, blob, partition=0)
            await producer.flush()
            stored += per_step
            await consumer.seek_to_end(ping)
    finally:
        await consumer.stop()
        await producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--per-step", type=int, default=1000)
    args = parser.parse_args()
    for where in ("other", "same"):  # bulk in another topic / in the ping partition itself
        with EmbeddedBroker(port=0) as broker:
            asyncio.run(probe(broker, where, args.steps, args.per_step))


if __name__ == "__main__":
    main()
