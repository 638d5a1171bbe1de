"""Does another Python thread of the inference process slow the model thread through the GIL?

resnet18 (RANDOM weights: only speed is measured) at batch 4, one torch thread, loaded through
the project's model interface; the model thread runs on CPU 1, an "event loop" thread on CPU 0
runs Python bytecode for `--duty` of the time (3 ms bursts, then sleeps). Each row is the
median batch time, as a ratio to the eager model alone measured in the same round.

    flock /tmp/mmpipe-heavy.lock .venv/bin/python benchmarks/gil_contention.py [--duty 0.3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from mmpipe.models.image_classifier import resnet18_spec

MODEL_CPU, LOOP_CPU = 1, 0
BURST_S = 0.003


def busy_loop(stop: threading.Event, duty: float) -> None:
    """Hold the GIL for `duty` of the time, as an event loop deserialising messages would."""
    os.sched_setaffinity(0, {LOOP_CPU})
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < BURST_S:
            sum(range(50))
        time.sleep(BURST_S * (1 - duty) / duty)


def median_ms(run: Callable[[], object], reps: int) -> float:
    """Median time of `run` on a thread of its own pinned to MODEL_CPU."""
    times: list[float] = []

    def model_thread() -> None:
        os.sched_setaffinity(0, {MODEL_CPU})
        for _ in range(3):
            run()
        for _ in range(reps):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    return statistics.median(times) * 1000


def with_loop(run: Callable[[], object], reps: int, duty: float, switch_s: float = 0.005) -> float:
    sys.setswitchinterval(switch_s)
    stop = threading.Event()
    loop = threading.Thread(target=busy_loop, args=(stop, duty))
    loop.start()
    try:
        return median_ms(run, reps)
    finally:
        stop.set()
        loop.join()
        sys.setswitchinterval(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duty", type=float, default=0.3)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 CPUs: the model thread and the loop run on different cores")
    os.sched_setaffinity(0, {LOOP_CPU})
    spec = resnet18_spec()
    eager = spec.load("cpu", "", True)
    graph = spec.load("cpu", "", True)
    torch.set_num_threads(1)
    if not graph.freeze_graph():
        sys.exit("no frozen graph for resnet18")
    batch = [spec.example_input()] * 4
    print(f"resnet18 RANDOM weights, batch 4, 1 torch thread, loop thread busy {args.duty:.0%} of the time; "
          f"torch {torch.__version__}, median of {args.reps} batches")
    for round_ in range(args.rounds):
        rows = {
            "eager alone": median_ms(lambda: eager.predict(batch), args.reps),
            "eager + loop": with_loop(lambda: eager.predict(batch), args.reps, args.duty),
            "eager + loop, switch interval 0.5 ms": with_loop(lambda: eager.predict(batch), args.reps, args.duty, 0.0005),
            "frozen graph alone": median_ms(lambda: graph.predict(batch), args.reps),
            "frozen graph + loop": with_loop(lambda: graph.predict(batch), args.reps, args.duty),
        }
        base = rows["eager alone"]
        print(f"round {round_ + 1}: " + "; ".join(f"{k} {v:.1f} ms ({v / base:.2f}x)" for k, v in rows.items()))


if __name__ == "__main__":
    main()
