"""Seeded arrival schedules: when each job is sent, of which modality and priority.

A schedule is a list of Arrival(offset_s, modality, priority), sorted by offset. The same seed
gives the same schedule, so the measured run and its queueing simulation see identical traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mmpipe.schemas.events import HIGH_PRIORITY, LOW_PRIORITY, NORMAL_PRIORITY

# The mixed workload: mostly images (the batching showcase), plus the other modalities.
MIXED_SHARES = {"image": 0.7, "video": 0.1, "audio": 0.1, "text": 0.1}


@dataclass(frozen=True)
class Arrival:
    offset_s: float
    modality: str
    priority: int = NORMAL_PRIORITY  # of the job's event (0 = high)


def poisson(rate: float, duration_s: float, seed: int, modality: str = "image") -> list[Arrival]:
    """Exponential gaps at `rate` jobs/s for `duration_s` seconds."""
    rng = np.random.default_rng(seed)
    offsets = _poisson_offsets(rng, rate, 0.0, duration_s)
    return _label(offsets, modality, rng)


def bursty(on_rate: float, on_s: float, off_s: float, duration_s: float, seed: int, modality: str = "image") -> list[Arrival]:
    """On/off traffic: Poisson at `on_rate` for `on_s`, silence for `off_s`, repeated."""
    rng = np.random.default_rng(seed)
    offsets: list[float] = []
    start = 0.0
    while start < duration_s:
        offsets += _poisson_offsets(rng, on_rate, start, min(start + on_s, duration_s))
        start += on_s + off_s
    return _label(offsets, modality, rng)


def flood(count: int, modality: str = "image", seed: int = 0) -> list[Arrival]:
    """Everything at once (warm-ups). The closed-loop saturation run takes only its modalities:
    it sends each job when an earlier one completes, not at these offsets."""
    rng = np.random.default_rng(seed)
    return _label([0.0] * count, modality, rng)


def with_priorities(
    schedule: list[Arrival], high_share: float, seed: int, rest: int = LOW_PRIORITY,
) -> list[Arrival]:
    """The same arrivals, round(high_share x n) of them (a seeded pick) at HIGH_PRIORITY and
    the others at `rest`."""
    rng = np.random.default_rng((seed, 1))  # its own stream: the offsets stay those of `seed`
    high = set(rng.choice(len(schedule), size=round(high_share * len(schedule)), replace=False).tolist())
    return [replace(a, priority=HIGH_PRIORITY if i in high else rest) for i, a in enumerate(schedule)]


def mean_rate(schedule: list[Arrival]) -> float:
    if len(schedule) < 2:
        return 0.0
    span = schedule[-1].offset_s - schedule[0].offset_s
    return (len(schedule) - 1) / span if span > 0 else float("inf")


def _poisson_offsets(rng: np.random.Generator, rate: float, start: float, end: float) -> list[float]:
    if rate <= 0:
        return []
    offsets = []
    t = start + rng.exponential(1.0 / rate)
    while t < end:
        offsets.append(float(t))
        t += rng.exponential(1.0 / rate)
    return offsets


def _label(offsets: list[float], modality: str, rng: np.random.Generator) -> list[Arrival]:
    if modality != "mixed":
        return [Arrival(t, modality) for t in offsets]
    names = list(MIXED_SHARES)
    picks = rng.choice(len(names), size=len(offsets), p=list(MIXED_SHARES.values()))
    return [Arrival(t, names[i]) for t, i in zip(offsets, picks)]
