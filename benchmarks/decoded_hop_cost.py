"""What cutting frames to the model's centre crop in decode saves (Settings.decode_center_crop):
the decoded hop of an image job with the crop and without, on the embedded broker, with
nothing else running. Per job: decode's side (decode the bench's 640x480 JPEG, encode the work
item, produce it), preprocess's side (fetch it, decode the item, the model's preprocess, encode
the ready item) and the broker's CPU, the two variants in alternating blocks of jobs so that a
drift of the machine's speed weighs on both alike (the pipeline bench's rounds are minutes
apart, and this machine's speed moves by 30 % between them). One run, one process.

    .venv/bin/python benchmarks/decoded_hop_cost.py [--blocks 12] [--jobs 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import psutil
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from mmpipe.harness.bench.workload import IMAGE_SIZE
from mmpipe.models.image_classifier import resnet18_spec
from mmpipe.schemas.codec import WorkItem, decode_work_item, encode_work_item
from mmpipe.stages.decode import samples
from mmpipe.stages.decode.media import DecodeLimits, decode_image
from mmpipe.stages.decode.stage import frame_meta
from mmpipe.streams.broker import EmbeddedBroker, free_port

VARIANTS = {"centre crop": True, "whole frames": False}


def decoded_item(jpeg: bytes, limits: DecodeLimits, spec, n: int) -> WorkItem:
    """What decode publishes for one image job (stages/decode/stage.py: _items)."""
    media = decode_image(jpeg, limits)
    (frame,) = media.frames
    now = time.time()
    return WorkItem(job_id=f"j{n}", part=0, parts=1, kind="image", modality="image", model=spec.ref, created_at=now,
                    deadline=now + 300, trace={"created": now}, meta=frame_meta(frame, media), tensors={"rgb": frame.rgb})


async def block(producer, consumer, topic: str, jpeg: bytes, limits: DecodeLimits, spec, jobs: int, first: int,
                broker: psutil.Process) -> dict[str, float]:
    decode_s = preprocess_s = 0.0
    sizes = []
    broker_before = sum(broker.cpu_times()[:2])
    for n in range(first, first + jobs):
        t0 = time.process_time()
        raw = encode_work_item(decoded_item(jpeg, limits, spec, n))
        await producer.send_and_wait(topic, raw, key=f"j{n}".encode())
        t1 = time.process_time()
        record = await consumer.getone()
        item = decode_work_item(record.value)
        item.tensors = spec.preprocess(item.tensors, item.meta)
        encode_work_item(item)
        preprocess_s += time.process_time() - t1
        decode_s += t1 - t0
        sizes.append(len(raw))
    broker_s = sum(broker.cpu_times()[:2]) - broker_before
    return {"decode_ms": 1000 * decode_s / jobs, "preprocess_ms": 1000 * preprocess_s / jobs,
            "broker_ms": 1000 * broker_s / jobs, "bytes": statistics.mean(sizes)}


async def run(bootstrap: str, broker: psutil.Process, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    topic = "hopcost.decoded"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 1)])
    await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0, max_batch_size=1,
                                max_request_size=32 << 20)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=20,
                                max_partition_fetch_bytes=32 << 20, fetch_max_bytes=64 << 20)
    await producer.start()
    await consumer.start()
    spec = resnet18_spec()
    hints = spec.config.decode
    jpeg = samples.encode_image(samples.synthetic_picture(*IMAGE_SIZE, seed=0), "jpeg")
    limits = {name: DecodeLimits(image_short_side=hints.image_short_side,
                                 image_center_crop=hints.image_center_crop if crop else None)
              for name, crop in VARIANTS.items()}
    found: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    n = 0
    await block(producer, consumer, topic, jpeg, limits["whole frames"], spec, args.jobs, n, broker)  # warm-up
    n += args.jobs
    for b in range(args.blocks):
        order = list(VARIANTS) if b % 2 == 0 else list(VARIANTS)[::-1]  # ABBA
        for name in order:
            found[name].append(await block(producer, consumer, topic, jpeg, limits[name], spec, args.jobs, n, broker))
            n += args.jobs
    await consumer.stop()
    await producer.stop()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=12, help="blocks per variant, in ABBA order")
    parser.add_argument("--jobs", type=int, default=20, help="jobs per block")
    args = parser.parse_args()
    port = free_port()
    with EmbeddedBroker(port=port) as broker:
        found = asyncio.run(run(f"127.0.0.1:{port}", psutil.Process(broker.process.pid), args))
    print(f"the decoded hop of an image job ({IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} JPEG, resnet18's 256 -> 224 crop), "
          f"{args.blocks} blocks of {args.jobs} jobs per variant in ABBA order; CPU ms per job, median over blocks")
    figures = ("decode_ms", "preprocess_ms", "broker_ms")
    medians = {name: {f: statistics.median(b[f] for b in blocks) for f in (*figures, "bytes")} for name, blocks in found.items()}
    crop, whole = medians["centre crop"], medians["whole frames"]
    print(f"  {'':14s} {'decode side':>12s} {'preprocess side':>16s} {'broker':>8s} {'all three':>10s} {'bytes/record':>13s}")
    for name, m in medians.items():
        print(f"  {name:14s} {m['decode_ms']:12.2f} {m['preprocess_ms']:16.2f} {m['broker_ms']:8.2f} "
              f"{sum(m[f] for f in figures):10.2f} {m['bytes']:13.0f}")
    ratios = "  ".join(f"{f.removesuffix('_ms')} {crop[f] / whole[f]:.2f}" for f in figures)
    total = sum(crop[f] for f in figures) / sum(whole[f] for f in figures)
    print(f"  crop / whole: {ratios}  all three {total:.2f}  bytes {crop['bytes'] / whole['bytes']:.2f}")


if __name__ == "__main__":
    main()
