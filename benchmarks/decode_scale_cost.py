"""decode_image's CPU per image with the swscale context kept per thread and one scaling thread
(stages/decode/media.py: _reformatter) against what VideoFrame.to_ndarray did before: a new
context per frame, with PyAV 18's default of a scaling thread per core. One run, rounds in ABBA
order, the bench's eight noisy 640x480 JPEGs scaled to resnet18's 256 short side and cut to 224.

    .venv/bin/python benchmarks/decode_scale_cost.py [--images 400] [--rounds 6]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

from av.video.reformatter import VideoReformatter

from mmpipe.harness.bench.workload import IMAGE_VARIANTS, _image
from mmpipe.stages.decode import media
from mmpipe.stages.decode.media import DecodeLimits, decode_image

KEPT = DecodeLimits(image_short_side=256, image_center_crop=224)
PER_FRAME = DecodeLimits(image_short_side=256, image_center_crop=224, threads=0)  # 0: PyAV's default, a thread per core


@contextlib.contextmanager
def contexts_per_frame() -> Iterator[None]:
    """decode as it was: a fresh swscale context for every frame (what to_ndarray does)."""
    kept = media._reformatter
    media._reformatter = VideoReformatter
    try:
        yield
    finally:
        media._reformatter = kept


def cost(images: list[bytes], limits: DecodeLimits, count: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per image."""
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(count):
        decode_image(images[i % len(images)], limits)
    return (time.process_time() - cpu) / count * 1e3, (time.perf_counter() - wall) / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    images = [_image(i) for i in range(IMAGE_VARIANTS)]

    def before() -> tuple[float, float]:
        with contexts_per_frame():
            return cost(images, PER_FRAME, args.images)

    def now() -> tuple[float, float]:
        return cost(images, KEPT, args.images)

    cases: dict[str, Callable[[], tuple[float, float]]] = {"context per frame, thread per core (before)": before,
                                                            "context kept per thread, one thread (now)": now}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for name, fn in cases.items():
        fn()  # warm-up
    for r in range(args.rounds):
        for name in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            results[name].append(cases[name]())
    same = all((decode_image(img, KEPT).frames[0].rgb == _before_rgb(img)).all() for img in images)
    print(f"decode_image, {len(images)} JPEGs 640x480 ({min(map(len, images))}-{max(map(len, images))} B) -> 224x224, "
          f"median of {args.rounds} rounds of {args.images} (ABBA); pixels identical: {same}")
    medians = {name: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for name, v in results.items()}
    for name, (cpu, wall) in medians.items():
        print(f"  {name:46s} CPU {cpu:6.3f} ms  wall {wall:6.3f} ms")
    (b_cpu, b_wall), (n_cpu, n_wall) = medians.values()
    print(f"now / before: CPU {n_cpu / b_cpu:.2f}, wall {n_wall / b_wall:.2f}")


def _before_rgb(image: bytes):  # noqa: ANN202 - an array
    with contexts_per_frame():
        return decode_image(image, PER_FRAME).frames[0].rgb


if __name__ == "__main__":
    main()
