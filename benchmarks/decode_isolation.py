"""What decoding in isolated worker processes (stages/decode/isolation.py: spawned
workers under RLIMIT_AS, a time budget per decode) costs per job against decoding in the
stage's own thread, for the pipeline's typical inputs, measured in one run; then the hostile
corpus through the pool, with the workers' peak RSS.

    flock /tmp/mmpipe-heavy.lock .venv/bin/python benchmarks/decode_isolation.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time

from mmpipe.harness import hostile
from mmpipe.stages.decode import samples
from mmpipe.stages.decode.isolation import DecodePool
from mmpipe.stages.decode.media import DecodeLimits, MediaError, decode_media

LIMITS = DecodeLimits()


def inputs() -> dict[str, tuple[str, bytes]]:
    return {
        "image 640x480 JPEG": ("image", samples.encode_image(samples.synthetic_picture(640, 480), "jpeg")),
        "audio 10 s FLAC": ("audio", samples.encode_audio(samples.tone_pcm(10.0), fmt="flac")),
        "video 4 s 640x360 H.264+AAC": ("video", samples.encode_video(seconds=4.0, audio=samples.tone_pcm(4.0))),
    }


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    pool = DecodePool(1, 1024**3, timeout_s=30.0)
    pool.warm_up(DecodeLimits(video_max_frames=1))
    loop = asyncio.new_event_loop()
    print(f"{'input':32s} {'in-thread ms':>13s} {'isolated ms':>12s} {'cost ms':>8s} {'ratio':>6s}")
    for name, (modality, data) in inputs().items():
        local = median_ms(lambda m=modality, d=data: decode_media(m, d, LIMITS), args.repeats)
        isolated = median_ms(lambda m=modality, d=data: loop.run_until_complete(pool.decode(m, d, LIMITS)), args.repeats)
        print(f"{name:32s} {local:13.2f} {isolated:12.2f} {isolated - local:8.2f} {isolated / local:6.2f}")
    print("\nhostile corpus through the pool:")
    for item in hostile.corpus():
        started = time.perf_counter()
        try:
            loop.run_until_complete(pool.decode(item.modality, item.data, LIMITS))
            outcome = "DECODED"
        except MediaError as exc:
            outcome = exc.reason
        print(f"  {item.name:28s} {outcome:24s} {(time.perf_counter() - started) * 1000:7.1f} ms")
    pool.close()
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS: decode workers {peak:.0f} MiB (limit: RLIMIT_AS 1024 MiB), this process {own:.0f} MiB")


if __name__ == "__main__":
    main()
