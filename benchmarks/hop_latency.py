"""One Kafka hop on the embedded broker, with nothing else running: what a record of the
pipeline's size costs from `send` to the producer's ack and to a group consumer's hand, at the
priority scenario's rate (10 % of the records on a second topic, like the high lane). Both
producer batchings in one run: single-record batches (the embedded default, exact lag) and
aiokafka's default batching. Compare with the topic waits (`queue_*`) of `mmpipe bench
--scenario priority`: what exceeds this there is the stage processes', not the broker's. It also
prints the broker's CPU per record, to set beside its CPU per job in `mmpipe bench`.

    .venv/bin/python benchmarks/hop_latency.py [--rate 27] [--size 263000] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import psutil

from mmpipe.streams.broker import EmbeddedBroker, free_port

LANES = ("main", "high")
HIGH_SHARE = 0.1


def percentile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def one_run(bootstrap: str, prefix: str, single: bool, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(f"{prefix}.{lane}", 4, 1) for lane in LANES])
    await admin.close()
    options = dict(acks="all", linger_ms=0, max_request_size=32 << 20)
    if single:
        options["max_batch_size"] = 1
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **options)
    consumer = AIOKafkaConsumer(
        *(f"{prefix}.{lane}" for lane in LANES), bootstrap_servers=bootstrap, group_id=prefix,
        auto_offset_reset="earliest", fetch_max_wait_ms=20, max_partition_fetch_bytes=32 << 20,
        fetch_max_bytes=64 << 20, session_timeout_ms=6000, heartbeat_interval_ms=1000, rebalance_timeout_ms=5000)
    await producer.start()
    await consumer.start()
    while not consumer.assignment():
        await asyncio.sleep(0.1)
    sent: dict[bytes, float] = {}
    found: dict[str, dict[str, list[float]]] = {lane: {"ack": [], "hop": []} for lane in LANES}

    async def consume() -> None:
        async for record in consumer:
            if record.key in sent:
                found[record.topic.rsplit(".", 1)[1]]["hop"].append(time.time() - sent[record.key])

    async def send(i: int, lane: str, payload: bytes) -> None:
        key = f"{i}".encode()
        sent[key] = time.time()
        await (await producer.send(f"{prefix}.{lane}", payload, key=key))
        found[lane]["ack"].append(time.time() - sent[key])

    reader = asyncio.create_task(consume())
    rng = random.Random(args.seed)
    payload = os.urandom(args.size)
    sends, started, i = [], time.monotonic(), 0
    while time.monotonic() - started < args.seconds:
        lane = "high" if rng.random() < HIGH_SHARE else "main"
        sends.append(asyncio.create_task(send(i, lane, payload)))
        i += 1
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*sends)
    deadline = time.monotonic() + 10
    while sum(len(f["hop"]) for f in found.values()) < i and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    reader.cancel()
    await consumer.stop()
    await producer.stop()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=27.0, help="records per second (Poisson)")
    parser.add_argument("--size", type=int, default=263_000, help="bytes per record (a decoded 256x341 RGB image)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    port = free_port()
    runs, broker_ms = {}, {}
    with EmbeddedBroker(port=port) as broker:
        bootstrap = f"127.0.0.1:{port}"
        process = psutil.Process(broker.process.pid)
        for single in (True, False):
            before = sum(process.cpu_times()[:2])
            runs[single] = asyncio.run(one_run(bootstrap, f"hop{int(single)}", single, args))
            records = sum(len(f["hop"]) for f in runs[single].values())
            broker_ms[single] = 1000 * (sum(process.cpu_times()[:2]) - before) / max(records, 1)
    print(f"one hop on the embedded broker, nothing else running: {args.rate:g} records/s, {args.size} B each, "
          f"{args.seconds:g} s, {HIGH_SHARE:.0%} on the second topic; ms")
    for single, found in runs.items():
        for lane in LANES:
            ack, hop = found[lane]["ack"], found[lane]["hop"]
            print(f"  {'single-record batches' if single else 'default batching':22s} {lane:4s} n={len(hop):4d}  "
                  f"send->ack p50/p99 {percentile_ms(ack, .5):5.1f}/{percentile_ms(ack, .99):5.1f}  "
                  f"send->consumer p50/p99 {percentile_ms(hop, .5):5.1f}/{percentile_ms(hop, .99):5.1f}")
        print(f"  {'':22s} broker CPU {broker_ms[single]:.2f} ms per record (written once, read by one group; "
              "the run's set-up and idle polling included)")


if __name__ == "__main__":
    main()
