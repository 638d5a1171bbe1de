"""What the embedded broker (Tansu, memory storage) pays per record as a partition grows.

Tansu's memory engine keeps every produced batch as its own object and, for a fetch that has
records to return, lists every object of the partition to find the fetch offset; a ListOffsets
request lists them too. Neither cost depends on how many records are returned, only on how many
the partition holds, and a fetch stops listing when its max wait runs out, so past some size a
fetch no longer reaches the newest records at all. (benchmarks/broker_log_growth.py showed the
growth up to 5,000 records, and none from records in another topic.) This script fills one partition with
single-record batches (as the stages produce them, `single_record_batches`) in steps, and at
each size produces `--probes` records one at a time and reads each back with one consumer whose
fetches the broker may hold `--hold-ms` (the stages' polling wait), reporting:
  found   : probes whose first read (a `getmany` of up to 1 s) returned the record
  fetch ms: broker CPU per probe (its produce, the fetches that read it), from /proc
  e2e ms  : median time from the probe's acknowledgement to its arrival, over the found ones
  ListOffsets ms: broker CPU per end-offset request on that partition
  by fetch ms   : the same end offset read from a fetch's high watermark (streams/kafka.py
                  high_watermarks, what the lag read-outs use on the embedded broker)
With `--transport` the consumer's fetches follow the stages' transport (streams/transport.py):
a fetch the broker cut short (records reported past the offset, none returned) doubles the next
one's max wait until one comes back whole.

    .venv/bin/python benchmarks/broker_partition_growth.py [--sizes 100,2000,10000,30000,60000] [--transport]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmpipe.streams.broker import EmbeddedBroker
from mmpipe.streams.fetch_wait import AdaptiveFetchWait
from mmpipe.streams.kafka import high_watermarks
from mmpipe.streams.transport import adapt_fetch_wait

TOPIC = "growth"
RECORD = b"x" * 200


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def fill(producer: AIOKafkaProducer, records: int) -> None:
    """Produce `records` single-record batches, many in flight at once (fast to fill)."""
    for start in range(0, records, 1000):
        acks = [await producer.send(TOPIC, RECORD, partition=0) for _ in range(min(1000, records - start))]
        await asyncio.gather(*acks)


async def probe(bootstrap: str, broker: psutil.Process, producer: AIOKafkaProducer, probes: int,
                hold_ms: int, transport: bool) -> tuple[int, float, float | None]:
    tp = TopicPartition(TOPIC, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, fetch_max_wait_ms=hold_ms)
    await consumer.start()
    if transport:
        adapt_fetch_wait(consumer._fetcher, AdaptiveFetchWait(hold_ms, hold_ms, 1.0))  # noqa: SLF001
    consumer.assign([tp])
    await consumer.seek_to_end(tp)
    await consumer.position(tp)
    found, latencies = 0, []
    before = cpu_s(broker)
    for _ in range(probes):
        await producer.send_and_wait(TOPIC, RECORD, partition=0)
        acked = time.monotonic()
        if any((await consumer.getmany(timeout_ms=1000)).values()):
            found += 1
            latencies.append(time.monotonic() - acked)
        else:
            await consumer.getmany(timeout_ms=3000)  # let a slow fetch land before the next probe
    cpu_per_probe = (cpu_s(broker) - before) / probes
    await consumer.stop()
    return found, cpu_per_probe * 1000, statistics.median(latencies) * 1000 if latencies else None


async def end_offset_costs(bootstrap: str, broker: psutil.Process, requests: int) -> tuple[float, float]:
    """Broker CPU ms per end-offset read: by ListOffsets, and by a fetch's high watermark."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    tp = TopicPartition(TOPIC, 0)
    costs = []
    for read in (consumer.end_offsets, lambda tps: high_watermarks(consumer, tps)):
        end = await read([tp])
        before = cpu_s(broker)
        for _ in range(requests):
            assert await read([tp]) == end
        costs.append((cpu_s(broker) - before) / requests * 1000)
    await consumer.stop()
    return costs[0], costs[1]


async def measure(bootstrap: str, pid: int, sizes: list[int], probes: int, hold_ms: int, transport: bool) -> None:
    broker = psutil.Process(pid)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(TOPIC, 1, 1)])
    await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_batch_size=1, linger_ms=0)
    await producer.start()
    fetches = "the stages' transport" if transport else "plain aiokafka"
    print(f"one partition, single-record batches of {len(RECORD)} B; {probes} probes per size, fetches held up to"
          f" {hold_ms} ms, {fetches}")
    print(f"{'records':>8} {'found':>7} {'fetch ms':>9} {'e2e ms':>7} {'ListOffsets ms':>15} {'by fetch ms':>12}")
    held = 0
    for size in sizes:
        await fill(producer, size - held)
        found, fetch_ms, e2e_ms = await probe(bootstrap, broker, producer, probes, hold_ms, transport)
        held = size + probes
        list_ms, by_fetch_ms = await end_offset_costs(bootstrap, broker, 50)
        e2e = f"{e2e_ms:7.1f}" if e2e_ms is not None else f"{'-':>7}"
        print(f"{size:>8} {found:>3}/{probes:<3} {fetch_ms:>9.2f} {e2e} {list_ms:>15.2f} {by_fetch_ms:>12.2f}", flush=True)
    await producer.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,2000,10000,30000,60000", help="records in the partition, ascending")
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--hold-ms", type=int, default=20)
    parser.add_argument("--transport", action="store_true", help="fetch as the stages do (streams/transport.py)")
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with EmbeddedBroker(port=0) as broker:
        asyncio.run(measure(broker.bootstrap, broker.process.pid, sizes, args.probes, args.hold_ms, args.transport))


if __name__ == "__main__":
    main()
