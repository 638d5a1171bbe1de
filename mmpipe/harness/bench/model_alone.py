"""The model alone: LoadedModel.predict over a sweep of batch sizes, no Kafka, no stages.

This is the baseline every pipeline figure is divided by, and the service-time curve t(b) the
queueing simulation runs on. Same process-level conditions as the inference stage: the same
device, the same torch thread count, preprocessed representative inputs, warm-up first.

Sizes are measured in interleaved rounds (1, 2, 4, ... then again) and the median batch time is
kept, so a burst of load from another process on a shared machine spreads over all sizes
instead of skewing one of them.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

# Sizes within this share of the best throughput count as "as good": the smallest wins, since
# a smaller batch fills sooner and costs less latency for the same throughput.
NEAR_BEST = 0.97
# cuDNN picks its kernels per shape on the first calls; a CPU needs one call to page things in.
WARMUP_ITERATIONS = {"cpu": 1, "cuda": 3}


@dataclass
class CurvePoint:
    batch_size: int
    batch_ms: float  # median wall time of one predict(batch)
    items_per_s: float
    iterations: int
    cpu_ms_per_item: float = 0.0  # process CPU time per item (all torch threads), for CPU-cost ratios


@dataclass
class ModelCurve:
    model: str
    version: str
    weights: str
    device: str
    torch_threads: int
    points: list[CurvePoint] = field(default_factory=list)
    gpu_peak_bytes: int = 0
    graph: bool = False  # ran as a frozen graph (models/torch_util.py), as the inference stage does

    @property
    def best_batch(self) -> int:
        top = max(p.items_per_s for p in self.points)
        return min(p.batch_size for p in self.points if p.items_per_s >= NEAR_BEST * top)

    def batch_ms(self, batch_size: float) -> float:
        """t(b): interpolated between measured sizes, extrapolated linearly past the ends."""
        sizes = [p.batch_size for p in self.points]
        times = [p.batch_ms for p in self.points]
        if len(sizes) == 1:
            return times[0] * batch_size / sizes[0]
        if batch_size >= sizes[-1]:
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            return times[-1] + slope * (batch_size - sizes[-1])
        return float(np.interp(batch_size, sizes, times))

    def throughput(self, batch_size: int) -> float:
        return batch_size / self.batch_ms(batch_size) * 1000.0

    @property
    def batching_gain(self) -> float:
        """Model-alone throughput at the best batch size over batch size 1."""
        return self.throughput(self.best_batch) / self.throughput(1)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "best_batch": self.best_batch,
            "batching_gain": round(self.batching_gain, 3),
        }


def batch_sizes(device: str, model_limit: int) -> list[int]:
    """Powers of two up to what is worth trying: 16 on a CPU, 256 on a GPU."""
    top = 256 if device.startswith("cuda") else 16
    top = min(top, model_limit)
    return [2**k for k in range(int(math.log2(top)) + 1)]


def measure_curve(
    spec: Any,
    example: dict[str, np.ndarray],
    *,
    device: str,
    weights_dir: str,
    torch_threads: int,
    graph_mode: bool,
    sizes: list[int],
    seconds_per_size: float,
    rounds: int = 3,
) -> ModelCurve:
    model, graph = _load(spec, device, weights_dir, torch_threads, graph_mode)
    on_gpu = model.device.startswith("cuda")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    timings: dict[int, list[float]] = {b: [] for b in sizes}
    cpu: dict[int, float] = {b: 0.0 for b in sizes}
    try:
        for b in sizes:
            for _ in range(WARMUP_ITERATIONS["cuda" if on_gpu else "cpu"]):
                model.predict([example] * b)
        for _ in range(rounds):
            for b in sizes:
                cpu_start = time.process_time()
                timed = _time_batches(model, [example] * b, seconds_per_size / rounds)
                cpu[b] += time.process_time() - cpu_start
                timings[b] += timed
        curve = ModelCurve(spec.config.name, spec.config.version, model.weights, model.device, torch.get_num_threads(),
                           graph=graph)
        for b in sizes:
            median_ms = float(np.median(timings[b])) * 1000.0
            cpu_ms = cpu[b] * 1000.0 / (b * len(timings[b]))
            curve.points.append(CurvePoint(b, round(median_ms, 3), round(b / median_ms * 1000.0, 2), len(timings[b]), round(cpu_ms, 2)))
        if on_gpu:
            curve.gpu_peak_bytes = int(torch.cuda.max_memory_allocated())
        return curve
    finally:
        del model
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()  # the inference stage gets the GPU to itself


class ModelProbe:
    """The model alone at one batch size, timed again whenever asked: how fast the machine runs
    it at that point of a run, beside the curve measured at the start. A shared machine's
    speed drifts between runs (README, Efficiency); a flood that is slow while the probe before
    it was slow too is the machine's, not the pipeline's."""

    def __init__(self, spec: Any, example: dict[str, np.ndarray], *, device: str, weights_dir: str,
                 torch_threads: int, graph_mode: bool) -> None:
        self.model, _ = _load(spec, device, weights_dir, torch_threads, graph_mode)
        self.example = example

    def items_per_s(self, batch_size: int, budget_s: float) -> float:
        """Median over predicts filling `budget_s`, after one untimed."""
        batch = [self.example] * batch_size
        self.model.predict(batch)
        return batch_size / float(np.median(_time_batches(self.model, batch, budget_s)))


def _load(spec: Any, device: str, weights_dir: str, torch_threads: int, graph_mode: bool) -> tuple[Any, bool]:
    """The model as the inference stage runs it: the frozen graph where it answers alike."""
    model = spec.load(device, weights_dir, True)
    graph = graph_mode and model.freeze_graph()
    if torch_threads:
        torch.set_num_threads(torch_threads)  # after load: loading silero resets it
    return model, graph


def _time_batches(model: Any, batch: list[dict[str, np.ndarray]], budget_s: float) -> list[float]:
    """At least one timed predict; more while the budget lasts."""
    times: list[float] = []
    spent = 0.0
    while not times or spent < budget_s:
        started = time.perf_counter()
        model.predict(batch)  # returns host-side outputs: a GPU run is synchronised
        elapsed = time.perf_counter() - started
        times.append(elapsed)
        spent += elapsed
    return times
