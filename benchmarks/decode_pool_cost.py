"""What the decode stage's worker pool (stages/decode/isolation.py) costs per image job on top
of the decode itself, as the stage drives it: two workers, `--outstanding` decodes in flight on
one event loop, 640x480 JPEGs (the bench's image jobs) cut to resnet18's 224 crop.

Per round: CPU ms per job of this process (the stage's side: hand-offs, pickles, the loop) and
of the workers (decode + their side of the hand-offs), against the decode alone in this process
(decode_media called directly; the work any pool must do).

    .venv/bin/python benchmarks/decode_pool_cost.py [--jobs 600] [--rounds 2] [--compare-with TREE]

--compare-with measures another checkout (a folder whose `mmpipe` package is imported first,
e.g. an earlier commit laid out as the installed package: the pebble pool before 2026-12-07)
in the same run, rounds alternating ABBA in fresh subprocesses, and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import psutil

from mmpipe.harness.bench.resources import tree_cpu_times
from mmpipe.stages.decode import samples
from mmpipe.stages.decode.isolation import DecodePool
from mmpipe.stages.decode.media import DecodeLimits, decode_media

LIMITS = DecodeLimits(image_short_side=256, image_center_crop=224)


def measure(jobs: int, outstanding: int) -> dict[str, float]:
    image = samples.encode_image(samples.synthetic_picture(640, 480), "jpeg")
    me = psutil.Process()
    started = time.process_time()
    for _ in range(jobs // 4):
        decode_media("image", image, LIMITS)
    alone = (time.process_time() - started) / (jobs // 4)

    pool = DecodePool(2, 1 << 30, timeout_s=30.0)
    pool.warm_up(DecodeLimits(video_max_frames=1))

    async def flood() -> None:
        room = asyncio.Semaphore(outstanding)

        async def one() -> None:
            async with room:
                media = await pool.decode("image", image, LIMITS)
                assert media.frames[0].rgb.shape == (224, 224, 3)

        await asyncio.gather(*(one() for _ in range(jobs)))

    loop = asyncio.new_event_loop()
    loop.run_until_complete(flood())  # warm: the loop, the workers' first JPEGs
    own_before, tree_before, wall_before = sum(me.cpu_times()[:2]), sum(tree_cpu_times(me)), time.perf_counter()
    loop.run_until_complete(flood())
    own, tree, wall = sum(me.cpu_times()[:2]) - own_before, sum(tree_cpu_times(me)) - tree_before, time.perf_counter() - wall_before
    pool.close()
    loop.close()
    ms = 1000 / jobs
    return {"stage_side": own * ms, "workers": (tree - own) * ms, "total": tree * ms, "decode_alone": alone * 1000,
            "wall": wall * ms}


def rounds_in_subprocesses(tree: str | None, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree) if tree else dict(os.environ)
    out = subprocess.run([sys.executable, __file__, "--jobs", str(args.jobs), "--outstanding", str(args.outstanding),
                          "--json"], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--outstanding", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="per tree, ABBA order")
    parser.add_argument("--compare-with", help="another tree to measure in the same run")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a subprocess's answer
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.jobs, args.outstanding)))
        return
    trees = {"this tree": None} | ({args.compare_with: args.compare_with} if args.compare_with else {})
    order = [name for i in range(args.rounds) for name in (list(trees) if i % 2 == 0 else list(trees)[::-1])]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for name in order:
        results[name].append(rounds_in_subprocesses(trees[name], args))
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[name][-1].items()), flush=True)
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"\nCPU ms per image job, median of {args.rounds} rounds ({args.jobs} jobs, {args.outstanding} outstanding, "
          "2 workers); pool overhead = total - decode alone")
    print(f"{'tree':>40} {'stage side':>10} {'workers':>8} {'total':>7} {'decode alone':>12} {'overhead':>8} {'wall':>6}")
    for name, m in medians.items():
        print(f"{name:>40} {m['stage_side']:10.2f} {m['workers']:8.2f} {m['total']:7.2f} {m['decode_alone']:12.2f} "
              f"{m['total'] - m['decode_alone']:8.2f} {m['wall']:6.2f}")
    if args.compare_with:
        a, b = medians["this tree"], medians[args.compare_with]
        print(f"this / that: total {a['total'] / b['total']:.2f}, stage side {a['stage_side'] / b['stage_side']:.2f}, "
              f"overhead {(a['total'] - a['decode_alone']) / (b['total'] - b['decode_alone']):.2f}")


if __name__ == "__main__":
    main()
