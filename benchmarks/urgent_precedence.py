"""Does an urgent batch run at full speed beside a running main batch on the same core?

The urgent slot (streams/batching.py) runs high-priority items on a second model thread while
the main thread's batch runs. With the model pinned to its own core (MMPIPE_MODEL_CPUS), the two
threads share that core, and the kernel splits it evenly: the urgent batch runs at half speed.
Raising the slot thread's CPU priority (a lower nice value; streams/affinity.py) lets it take
most of the core while both run, and changes nothing while the main thread runs alone.

resnet18 (RANDOM weights: only speed is measured), frozen graph, one torch thread, both model
threads pinned to CPU 1. The main thread runs batches of `--batch` back to back; the urgent thread
runs one item every `--every` seconds. Rounds alternate ABBA between an even split and the slot
thread `--steps` nice steps up. Then, with a busy process on the same core (another tenant),
the main thread's items/s with the slot raised, and with the main thread lowered instead (the
unprivileged way to the same split: it also loses the core to that process). One run.

    flock /tmp/mmpipe-heavy.lock .venv/bin/python benchmarks/urgent_precedence.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time

import torch

from mmpipe.models.image_classifier import resnet18_spec
from mmpipe.streams.affinity import raise_thread_priority

MODEL_CPU = 1


def urgent_alone_ms(predict, item: list, reps: int) -> float:
    """Median time of one urgent item with the core to itself."""
    times = []

    def run() -> None:
        os.sched_setaffinity(0, {MODEL_CPU})
        for _ in range(reps):
            started = time.perf_counter()
            predict(item)
            times.append(time.perf_counter() - started)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return statistics.median(times) * 1000


def contended(predict, batch: list, item: list, mode: str, steps: int, seconds: float, every: float) -> dict[str, float]:
    """Main batches back to back, an urgent item every `every` s, same core; mode "even" (both
    at the process's nice value), "raised" (the urgent thread `steps` up) or "main lowered"
    (the main thread `steps` down)."""
    stop = threading.Event()
    main_items = [0]
    urgent_ms: list[float] = []

    def main_thread() -> None:
        os.sched_setaffinity(0, {MODEL_CPU})
        if mode == "main lowered":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + steps)
        while not stop.is_set():
            predict(batch)
            main_items[0] += len(batch)

    def urgent_thread() -> None:
        os.sched_setaffinity(0, {MODEL_CPU})
        if mode == "raised" and not raise_thread_priority(steps):
            sys.exit("cannot raise a thread's priority here (needs CAP_SYS_NICE or RLIMIT_NICE)")
        while not stop.wait(every):
            started = time.perf_counter()
            predict(item)
            urgent_ms.append((time.perf_counter() - started) * 1000)

    threads = [threading.Thread(target=main_thread), threading.Thread(target=urgent_thread)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    urgent_ms.sort()
    return {"urgent_p50": statistics.median(urgent_ms), "urgent_max": urgent_ms[-1], "urgent_n": len(urgent_ms),
            "main_items_per_s": main_items[0] / elapsed}


def spin() -> None:
    os.sched_setaffinity(0, {MODEL_CPU})
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="nice steps between the threads")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--every", type=float, default=0.4)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA pairs")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 CPUs: the model threads run on CPU 1")
    os.sched_setaffinity(0, {0})
    spec = resnet18_spec()
    model = spec.load("cpu", "", True)
    torch.set_num_threads(1)
    if not model.freeze_graph():
        sys.exit("no frozen graph for resnet18")
    batch, item = [spec.example_input()] * args.batch, [spec.example_input()]
    model.predict(batch)
    alone = urgent_alone_ms(model.predict, item, 10)
    print(f"resnet18 RANDOM weights, frozen graph, 1 torch thread, both model threads on CPU {MODEL_CPU}; main batch "
          f"{args.batch} back to back, urgent batch 1 every {args.every} s, {args.seconds:g} s per round; torch {torch.__version__}")
    print(f"urgent item alone on the core: {alone:.1f} ms")
    order = ["even", "raised", "raised", "even"] * args.rounds
    rows: dict[str, list[dict[str, float]]] = {"even": [], "raised": []}
    for mode in order:
        row = contended(model.predict, batch, item, mode, args.steps, args.seconds, args.every)
        rows[mode].append(row)
        print(f"{mode:>6}: urgent p50 {row['urgent_p50']:.1f} ms ({row['urgent_p50'] / alone:.2f}x alone), "
              f"max {row['urgent_max']:.1f} ms, {row['urgent_n']} urgent items; main {row['main_items_per_s']:.2f} items/s")
    mean = {mode: {k: statistics.mean(r[k] for r in runs) for k in runs[0]} for mode, runs in rows.items()}
    up, even = mean["raised"], mean["even"]
    print(f"mean of {len(rows['even'])} rounds each, slot raised {args.steps} steps / even split: urgent p50 "
          f"{up['urgent_p50']:.1f} / {even['urgent_p50']:.1f} ms (ratio {up['urgent_p50'] / even['urgent_p50']:.2f}), "
          f"urgent max {up['urgent_max']:.1f} / {even['urgent_max']:.1f} ms; main items/s {up['main_items_per_s']:.2f} / "
          f"{even['main_items_per_s']:.2f} (ratio {up['main_items_per_s'] / even['main_items_per_s']:.2f})")
    hog = multiprocessing.Process(target=spin, daemon=True)
    hog.start()
    try:
        busy = {mode: contended(model.predict, batch, item, mode, args.steps, args.seconds, args.every)
                for mode in ("even", "raised", "main lowered")}
    finally:
        hog.kill()
    print("with a busy process on the same core: " + "; ".join(
        f"{mode}: main {row['main_items_per_s']:.2f} items/s, urgent p50 {row['urgent_p50']:.1f} ms" for mode, row in busy.items())
        + f" (main lowered / slot raised, main items/s: {busy['main lowered']['main_items_per_s'] / busy['raised']['main_items_per_s']:.2f})")


if __name__ == "__main__":
    main()
