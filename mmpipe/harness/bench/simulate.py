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

import msgspec
import numpy as np

from mmpipe.schemas.events import WorkerState
from mmpipe.schemas.settings import SchedulingSettings
from mmpipe.streams.routing import Router
from mmpipe.streams.worker_state import ServiceClock


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
    return _result(np.concatenate(sojourns) * 1000.0, last_finish - arrivals[0], batches)


def _result(waits_ms: np.ndarray, span_s: float, batches: int) -> SimResult:
    """Sojourn percentiles, throughput from the first arrival to the last completion, mean batch."""
    items = waits_ms.size
    return SimResult(
        items=int(items),
        p50_ms=round(float(np.percentile(waits_ms, 50)), 2),
        p95_ms=round(float(np.percentile(waits_ms, 95)), 2),
        p99_ms=round(float(np.percentile(waits_ms, 99)), 2),
        mean_ms=round(float(waits_ms.mean()), 2),
        throughput=round(items / span_s, 3) if span_s > 0 else 0.0,
        mean_batch=round(items / batches, 2) if batches else 0.0,
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
        start = max(free_at, _due(policy, arrivals[i], fill_at))
        size = int(np.searchsorted(arrivals[i : i + limit], start, side="right"))
        finish = start + service_ms(size) / 1000.0
        sojourn[i : i + size] = finish - arrivals[i : i + size]
        free_at = finish
        i += size
        batches += 1
    return sojourn, free_at, batches


def _due(policy: SimPolicy, head: float, fill_at: float) -> float:
    """When the batch whose oldest item arrived at `head` flushes (the model thread free):
    at once (off); when full or when the oldest has waited max_wait (dynamic) or the static
    timeout (static)."""
    if policy.mode == "off":
        return head
    timeout = policy.max_wait_s if policy.mode == "dynamic" else policy.static_timeout_s
    return min(fill_at, head + timeout)


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


# Lag-aware routing ---------------------------------------------------------------------------------
# The same batchers, each arrival placed by the real Router (streams/routing.py) from the reports
# the simulated workers publish every worker_state_interval_s (their backlog and measured seconds per
# item, as stages/inference.py reports them), delivered report_delay_s later. Replicas share no
# CPU here (an accelerator each), so the placement policy alone decides the difference.


class _Replica:
    """One worker's batcher, advanced lazily: a batch is formed once nothing that arrives later
    can change it (it is due and the model thread is free, within the time simulated so far)."""

    def __init__(self, name: str, partitions: list[int], policy: SimPolicy, service_ms: Callable[[int], float]) -> None:
        self.name, self.partitions, self.policy, self.service_ms = name, partitions, policy, service_ms
        self.limit = 1 if policy.mode == "off" else policy.max_batch
        self.queue: list[tuple[float, int]] = []  # (arrival at the worker, item index), in order
        self.running: list[tuple[float, int]] = []  # (finish, size) of started batches
        self.free_at = 0.0
        self.clock = ServiceClock()  # seconds per item, measured as the inference stage measures it
        self.batches = 0

    def advance(self, now: float, finish: np.ndarray) -> None:
        while self.queue:
            head = self.queue[0][0]
            fill_at = self.queue[self.limit - 1][0] if len(self.queue) >= self.limit else np.inf
            start = max(self.free_at, _due(self.policy, head, fill_at))
            if start > now:
                return  # later arrivals may still join this batch
            batch = [item for item in self.queue[: self.limit] if item[0] <= start]
            del self.queue[: len(batch)]
            seconds = self.service_ms(len(batch)) / 1000.0
            self.free_at = start + seconds
            finish[[index for _, index in batch]] = self.free_at
            self.running.append((self.free_at, len(batch)))
            self.clock.item_done(seconds, len(batch))
            self.batches += 1

    def report(self, now: float, epoch: float) -> WorkerState:
        """The worker's state at `now` (simulated seconds), stamped `epoch + now` for the Router."""
        self.running = [(end, size) for end, size in self.running if end > now]
        backlog = len(self.queue) + sum(size for _, size in self.running)
        return WorkerState(worker=self.name, partitions=self.partitions, ready=True, models=[SIM_MODEL],
                           item_s=self.clock.item_s, waits_s={}, at=epoch + now, backlog=backlog)


SIM_MODEL = "model"


def simulate_routed(
    arrivals_s: Sequence[float],
    policy: SimPolicy,
    service_ms: Callable[[int], float],
    scheduling: SchedulingSettings,
    *,
    extra_ms: Sequence[float],
    partitions_per_replica: int = 2,
    hop_s: float = 0.02,
    report_delay_s: float = 0.05,
    committed_lag: bool = False,
    lag_interval_s: float = 0.5,
    commit_interval_s: float = 0.5,
) -> SimResult:
    """Sojourn time (routing hop + batcher) of every arrival, placed by the Router.

    committed_lag: the workers report no backlog and the router reads the group's committed
    lag every lag_interval_s instead (what routing used before the workers counted their own
    queue): a partition's lag counts what its worker finished since its last commit."""
    arrivals = np.sort(np.asarray(arrivals_s, dtype=float))
    if arrivals.size == 0:
        return SimResult(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    epoch = 1_000_000.0  # the Router reads epoch-like seconds; any origin will do
    now = [epoch]
    router = Router(scheduling, lambda: now[0])
    replicas = [
        _Replica(f"r{r}", list(range(r * partitions_per_replica, (r + 1) * partitions_per_replica)), policy,
                 lambda b, e=extra: service_ms(b) + e)
        for r, extra in enumerate(extra_ms)
    ]
    owner = {p: replica for replica in replicas for p in replica.partitions}
    finish = np.full(arrivals.size, np.nan)
    placed = np.full(arrivals.size, -1)
    pending: list[tuple[float, WorkerState]] = []  # reports on their way to the router
    next_report = next_lag = arrivals[0]
    for index, at in enumerate(arrivals):
        while next_report <= at:  # every worker reports; the router reads it report_delay_s later
            for replica in replicas:
                replica.advance(next_report, finish)
                state = replica.report(next_report, epoch)
                pending.append((next_report + report_delay_s, msgspec.structs.replace(state, backlog=None)
                                if committed_lag else state))
            next_report += scheduling.worker_state_interval_s
        while committed_lag and next_lag <= at:
            for replica in replicas:
                replica.advance(next_lag, finish)
            committed = np.floor(next_lag / commit_interval_s) * commit_interval_s
            open_ = (placed >= 0) & ~(finish <= committed)  # unfinished or finished since the commit
            router.observe_lag({p: int(np.count_nonzero(open_ & (placed == p))) for p in owner})
            next_lag += lag_interval_s
        for state in [s for due, s in pending if due <= at]:
            router.observe_worker(state)
        pending = [(due, s) for due, s in pending if due > at]
        now[0] = epoch + at
        chosen = router.choose(SIM_MODEL, fallback=int(index % len(owner)))
        owner[chosen].queue.append((at + hop_s, index))
        placed[index] = chosen
    for replica in replicas:
        replica.advance(np.inf, finish)
    return _result((finish - arrivals) * 1000.0, float(np.nanmax(finish)) - arrivals[0], sum(r.batches for r in replicas))
