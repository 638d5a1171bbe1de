"""A seeded discrete-event simulation of the batcher, as a cross-check of the measurements.

It replays the same arrival times through the same policy rules as streams.batching (off:
one at a time; dynamic: flush when full or when the oldest item has waited max_wait; static:
flush when full or after static_timeout), with the service time t(b) measured on the model
alone. No Kafka, no decode, no CPU contention: where the measured figures and the simulated
ones part, the difference is what the rest of the pipeline costs.

Several replicas are modelled as independent batchers, each arrival routed to one at random
(as Kafka's key hashing spreads job ids over partitions), each with its own extra delay (a
degraded replica).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class SimPolicy:
    mode: str  # off | static | dynamic
    max_batch: int
    max_wait_s: float = 0.0
    static_timeout_s: float = 1.0


@dataclass
class SimResult:
    items: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float  # items/s from the first arrival to the last completion
    mean_batch: float

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(
    arrivals_s: Sequence[float],
    policy: SimPolicy,
    service_ms: Callable[[int], float],
    *,
    replicas: int = 1,
    extra_ms: Sequence[float] = (),
    seed: int = 0,
) -> SimResult:
    """Sojourn time in the batcher (queue + fill wait + execution) of every arrival."""
    arrivals = np.sort(np.asarray(arrivals_s, dtype=float))
    if arrivals.size == 0:
        return SimResult(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    route = np.random.default_rng(seed).integers(replicas, size=arrivals.size) if replicas > 1 else np.zeros(arrivals.size, int)
    sojourns: list[np.ndarray] = []
    batches = 0
    last_finish = 0.0
    for r in range(replicas):
        extra = extra_ms[r] if r < len(extra_ms) else 0.0
        times, finish, count = _one_server(arrivals[route == r], policy, lambda b, e=extra: service_ms(b) + e)
        sojourns.append(times)
        batches += count
        last_finish = max(last_finish, finish)
    waits = np.concatenate(sojourns) * 1000.0
    span = last_finish - arrivals[0]
    return SimResult(
        items=int(arrivals.size),
        p50_ms=round(float(np.percentile(waits, 50)), 2),
        p95_ms=round(float(np.percentile(waits, 95)), 2),
        p99_ms=round(float(np.percentile(waits, 99)), 2),
        mean_ms=round(float(waits.mean()), 2),
        throughput=round(arrivals.size / span, 3) if span > 0 else 0.0,
        mean_batch=round(arrivals.size / batches, 2) if batches else 0.0,
    )


def _one_server(arrivals: np.ndarray, policy: SimPolicy, service_ms: Callable[[int], float]) -> tuple[np.ndarray, float, int]:
    """Batches formed exactly as BatchPolicy forms them, when the model thread is free."""
    n = arrivals.size
    sojourn = np.zeros(n)
    free_at = 0.0
    i = batches = 0
    limit = 1 if policy.mode == "off" else policy.max_batch
    while i < n:
        fill_at = arrivals[i + limit - 1] if i + limit - 1 < n else np.inf
        if policy.mode == "off":
            due = arrivals[i]
        elif policy.mode == "dynamic":
            due = min(fill_at, arrivals[i] + policy.max_wait_s)
        else:
            due = min(fill_at, arrivals[i] + policy.static_timeout_s)
        start = max(free_at, due)
        size = int(np.searchsorted(arrivals[i : i + limit], start, side="right"))
        finish = start + service_ms(size) / 1000.0
        sojourn[i : i + size] = finish - arrivals[i : i + size]
        free_at = finish
        i += size
        batches += 1
    return sojourn, free_at, batches


def saturation(policy: SimPolicy, service_ms: Callable[[int], float], items: int = 2000) -> float:
    """Items/s when everything is queued at once (the simulated flood)."""
    return simulate([0.0] * items, policy, service_ms).throughput


def load_curve(
    policy: SimPolicy, service_ms: Callable[[int], float], rates: Sequence[float], seed: int, items: int = 3000
) -> list[dict]:
    """Simulated p50/p99 over a range of Poisson rates (the model-only curve in the plot)."""
    rng = np.random.default_rng(seed)
    points = []
    for rate in rates:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=items))
        result = simulate(arrivals, policy, service_ms)
        points.append({"rate": round(float(rate), 3), **result.to_dict()})
    return points
