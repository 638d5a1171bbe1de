"""Two per-job costs on decode's path for an image job (640x480 JPEG, resnet18's 224 crop),
each measured against its alternative in one run, CPU microseconds per job (median of rounds):

  event      : reading (and writing) the event as JSON with base64 bytes against the envelope
               (schemas/codec.py: a JSON header, then the raw bytes), and its size either way
  layout copy: a frame decode already cut, made model-ready (HWC -> CHW) in place against the
               same through the preprocess pool's thread (streams/priority.py), as it went
               before, and numpy's copy against torch's (before)

    .venv/bin/python benchmarks/decode_path_cost.py [--repeats 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import torch

from mmpipe.models.registry import DEFAULTS, get_spec
from mmpipe.schemas import SCHEMA_VERSION, MediaEvent, Payload, decode_event, encode_event
from mmpipe.schemas.codec import to_json
from mmpipe.stages.decode import samples
from mmpipe.stages.decode.media import DecodeLimits, decode_media
from mmpipe.streams.priority import PriorityExecutor


def cpu_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(min(repeats, 50)):
        fn()
    started = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    image = samples.encode_image(samples.synthetic_picture(640, 480), "jpeg")
    event = MediaEvent(job_id="cost-1", modality="image", payload=Payload(data=image), schema_version=SCHEMA_VERSION,
                       created_at=time.time())
    as_json, as_envelope = to_json(event), encode_event(event)
    spec = get_spec(DEFAULTS["image"])
    frame = decode_media("image", image, DecodeLimits(image_short_side=256, image_center_crop=224)).frames[0]
    tensors, meta = {"rgb": frame.rgb}, {"center_crop": frame.center_crop}
    assert not spec.needs_preprocess(tensors, meta)
    pool = PriorityExecutor(2, "cost", 1.0, time.monotonic)
    loop = asyncio.new_event_loop()

    def through_thread() -> None:
        loop.run_until_complete(pool.run(1, spec.preprocess, tensors, meta))

    cases = {
        "decode event, JSON + base64": lambda: decode_event(as_json),
        "decode event, envelope": lambda: decode_event(as_envelope),
        "encode event, JSON + base64": lambda: to_json(event),
        "encode event, envelope": lambda: encode_event(event),
        "layout copy via the pool's thread": through_thread,
        "layout copy in place": lambda: spec.preprocess(tensors, meta),
        "layout copy by torch (before), in place": lambda: torch.from_numpy(frame.rgb).permute(2, 0, 1).contiguous().numpy(),
    }
    rounds = {name: [cpu_us(fn, args.repeats) for _ in range(args.rounds)] for name, fn in cases.items()}
    pool.shutdown()
    print(f"image event of a 640x480 JPEG ({len(image)} B): JSON + base64 {len(as_json)} B, envelope "
          f"{len(as_envelope)} B ({len(as_envelope) / len(as_json):.2f})")
    print(f"CPU us per call, median of {args.rounds} rounds of {args.repeats}:")
    for name, values in rounds.items():
        print(f"  {name:36s} {statistics.median(values):8.1f}")


if __name__ == "__main__":
    main()
