"""What recycling decode workers costs (stages/decode/isolation.py, TASKS_PER_WORKER), and
whether a worker's memory grows without it. One decode worker, the same mixed media for each
setting (PNG 320x240, JPEG 1280x720, a 2 s 640x360 H.264 clip with audio, a 5 s WAV), one run.

A spawned worker imports its parent's __main__ again; in the decode stage that is mmpipe.cli,
so this script imports it too and every respawn pays what it pays in the stage.

    flock /tmp/mmpipe-heavy.lock .venv/bin/python benchmarks/decode_worker_recycling.py [--decodes 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time

import psutil

import mmpipe.cli  # noqa: F401  (the decode stage's __main__, imported again by every spawned worker)
from mmpipe.stages.decode import isolation, samples
from mmpipe.stages.decode.media import DecodeLimits


def media() -> list[tuple[str, bytes]]:
    png = [samples.encode_image(samples.synthetic_picture(320, 240, seed=i)) for i in range(8)]
    jpg = [samples.encode_image(samples.synthetic_picture(1280, 720, seed=i), fmt="jpeg") for i in range(4)]
    clip = samples.encode_video(seconds=2.0, width=640, height=360, audio=samples.tone_pcm(2.0))
    wav = samples.encode_audio(samples.tone_pcm(5.0))
    mix = [("image", png[i % 8]) for i in range(6)] + [("image", jpg[i % 4]) for i in range(2)]
    return mix + [("video", clip), ("audio", wav)]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers that ended (recycled, or closed)
    return usage.ru_utime + usage.ru_stime


def worker_rss_mib() -> list[int]:
    kids = psutil.Process(os.getpid()).children()
    return [k.memory_info().rss >> 20 for k in kids if "multiprocessing" in " ".join(k.cmdline())]


async def run(tasks_per_worker: int, decodes: int, items: list[tuple[str, bytes]]) -> dict[str, float | list[int]]:
    pool = isolation.DecodePool(1, 1 << 30, 30.0, tasks_per_worker=tasks_per_worker)
    limits = DecodeLimits()
    await pool.decode(*items[0], limits)  # the first worker's start is not billed
    cpu0, wall0 = children_cpu_s(), time.perf_counter()
    rss = []
    for i in range(decodes):
        await pool.decode(*items[i % len(items)], limits)
        if (i + 1) % (decodes // 4) == 0:
            rss += worker_rss_mib()
    wall = time.perf_counter() - wall0
    pool.close()
    return {"wall_ms": wall * 1000 / decodes, "cpu_ms": (children_cpu_s() - cpu0) * 1000 / decodes, "rss_mib": rss}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decodes", type=int, default=3000)
    args = parser.parse_args()
    items = media()
    rows = {n: await run(n, args.decodes, items) for n in (500, 5000)}
    print(f"{args.decodes} decodes, one worker, mixed media; per decode (worker CPU includes its start-ups):")
    for n, row in rows.items():
        print(f"  recycle every {n:>5}: wall {row['wall_ms']:.2f} ms, worker CPU {row['cpu_ms']:.2f} ms, "
              f"worker RSS MiB at each quarter {row['rss_mib']}")
    a, b = rows[500], rows[5000]
    print(f"every 5000 / every 500: wall {b['wall_ms'] / a['wall_ms']:.3f}, worker CPU {b['cpu_ms'] / a['cpu_ms']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
