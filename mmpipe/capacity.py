"""The replica hint of `mmpipe lag`: how many members each stage's consumer group needs to keep
up with what arrives, from numbers Kafka and the stages' Prometheus endpoints already hold:

    arrival rate     growth of the end offsets of the stage's input topics over a window
    service time     busy seconds per item in one replica (the stage's own metrics)
    workers          items one replica works on at once (decode / preprocess thread pools)

    replicas needed = ceil(arrival/s x seconds per item / (workers x target utilisation))

Batching is already inside the inference service time: a batch's execute time is shared by the
items it carried, so bigger batches show up as fewer seconds per item.

Only pure functions here (no I/O): report.py samples Kafka and scrapes the endpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from mmpipe.schemas.settings import Settings
from mmpipe.streams.topology import PIPELINE

# Below 1: headroom for bursts and rebalances; near 1 queues (and latency) grow without bound.
UTILISATION_TARGET = 0.7

# The mm_service_seconds step that times each stage's work (declared with the topology).
SERVICE_STEP = {spec.name: spec.service_step for spec in PIPELINE}

# Guards ceil() against float noise: 10/s x 0.07 s / 0.7 is 1.0000000000000002, not 2 replicas.
_EPSILON = 1e-9


@dataclass(frozen=True)
class ServiceTotals:
    """Cumulative work counters of one or more stage processes (Prometheus sums and counts)."""

    seconds: float = 0.0  # busy seconds
    items: float = 0.0  # items those seconds served
    batches: float = 0.0  # inference only: batches the items ran in

    def __add__(self, other: ServiceTotals) -> ServiceTotals:
        return ServiceTotals(self.seconds + other.seconds, self.items + other.items, self.batches + other.batches)

    def since(self, earlier: ServiceTotals) -> ServiceTotals:
        """Growth since an earlier scrape of the same process. Counters only grow, so a drop
        means the process restarted in between: then everything it has counted is new."""
        if self.seconds < earlier.seconds or self.items < earlier.items or self.batches < earlier.batches:
            return self
        return ServiceTotals(self.seconds - earlier.seconds, self.items - earlier.items, self.batches - earlier.batches)

    @property
    def per_item_s(self) -> float | None:
        return self.seconds / self.items if self.items > 0 else None

    @property
    def mean_batch(self) -> float | None:
        return self.items / self.batches if self.batches > 0 else None


@dataclass(frozen=True)
class MetricsPage:
    """What one /metrics page says about capacity: whose page it is, and its work counters."""

    stage: str | None
    totals: ServiceTotals


def parse_metrics(text: str, stage_hint: str | None = None) -> MetricsPage:
    """Read a stage process's /metrics page.

    The stage comes from the `stage` label of its mm_* series (each process serves one stage),
    else from the batch metrics (only inference has batchers), else from `stage_hint` (e.g. the
    port layout of `up`).

    Inference: mm_service_seconds{step="execute"} is observed once per *item* with its whole
    batch's duration, so its sum over-counts a batch by its size. The batcher's own series are
    observed once per batch: sum(mm_batch_execute_seconds) / sum(mm_batch_size) is exactly the
    busy seconds per item, and count(mm_batch_size) gives the mean batch size.
    """
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    stages = {s.labels["stage"] for s in samples if s.name.startswith("mm_") and "stage" in s.labels}
    has_batches = any(s.name.startswith("mm_batch_size") for s in samples)
    stage = next(iter(stages)) if len(stages) == 1 else ("inference" if has_batches else stage_hint)
    if stage == "inference":
        return MetricsPage(stage, _batch_totals(samples))
    step = SERVICE_STEP.get(stage or "")
    seconds = items = 0.0
    for s in samples:
        if s.labels.get("stage") == stage and s.labels.get("step") == step:
            if s.name == "mm_service_seconds_sum":
                seconds += s.value
            elif s.name == "mm_service_seconds_count":
                items += s.value
    return MetricsPage(stage, ServiceTotals(seconds, items))


def _batch_totals(samples: list) -> ServiceTotals:
    sums = {"mm_batch_execute_seconds_sum": 0.0, "mm_batch_size_sum": 0.0, "mm_batch_size_count": 0.0}
    for s in samples:
        if s.name in sums:
            sums[s.name] += s.value  # summed over models: one replica runs them all
    return ServiceTotals(sums["mm_batch_execute_seconds_sum"], sums["mm_batch_size_sum"], sums["mm_batch_size_count"])


def replicas_needed(
    arrival_per_s: float, per_item_s: float | None, workers: int = 1, target: float = UTILISATION_TARGET
) -> int | None:
    """Replicas that keep each one's busy fraction at or under `target`; None without a service
    time. At least 1: a stage with no traffic still needs a member to take the next item."""
    if per_item_s is None:
        return None
    if not 0 < target <= 1:
        raise ValueError(f"target utilisation must be in (0, 1], got {target}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    busy_replicas = max(arrival_per_s, 0.0) * per_item_s / workers  # replicas' worth of work per second
    return max(1, math.ceil(busy_replicas / target - _EPSILON))


@dataclass(frozen=True)
class StageLoad:
    """What was measured for one stage over one window (the inputs of the hint)."""

    stage: str
    window_s: float
    arrived: int  # end offsets' growth over the window, all input partitions
    consumed: int  # committed offsets' growth over the window
    lag: int  # at the end of the window
    partitions: int  # input partitions: the most members that can get work
    service: ServiceTotals | None  # None: no metrics endpoint of this stage answered
    service_recent: bool = True  # False: no item in the window, so the mean since process start
    workers: int = 1
    members: int | None = None  # consumer group members; None: unknown


@dataclass(frozen=True)
class CapacityHint:
    stage: str
    arrival_per_s: float
    done_per_s: float
    lag: int
    per_item_s: float | None
    service_recent: bool
    mean_batch: float | None
    workers: int
    needed: int | None
    members: int | None
    partitions: int
    advice: str


def combine_service(
    before: dict[str, MetricsPage], after: dict[str, MetricsPage], stage: str
) -> tuple[ServiceTotals | None, bool]:
    """One stage's work counters over its replicas' pages (keyed by URL), and whether they
    cover the window. Prefer the window's growth (the service time now, at this load); if no
    item was served in the window, fall back to the means since each process started.
    None when no page of the stage was read."""
    urls = [url for url, page in after.items() if page.stage == stage]
    if not urls:
        return None, True
    window = ServiceTotals()
    for url in urls:
        earlier = before.get(url)
        window += after[url].totals.since(earlier.totals) if earlier else after[url].totals
    if window.items > 0:
        return window, True
    lifetime = ServiceTotals()
    for url in urls:
        lifetime += after[url].totals
    return lifetime, False


def capacity_hint(load: StageLoad, target: float = UTILISATION_TARGET) -> CapacityHint:
    window = max(load.window_s, 1e-9)
    arrival = load.arrived / window
    done = load.consumed / window
    per_item = load.service.per_item_s if load.service else None
    needed = replicas_needed(arrival, per_item, load.workers, target)
    missing = "no metrics endpoint answered" if load.service is None else "no item served yet"
    return CapacityHint(
        stage=load.stage,
        arrival_per_s=arrival,
        done_per_s=done,
        lag=load.lag,
        per_item_s=per_item,
        service_recent=load.service_recent,
        mean_batch=load.service.mean_batch if load.service else None,
        workers=load.workers,
        needed=needed,
        members=load.members,
        partitions=load.partitions,
        advice=advice(needed, load.members, load.partitions, lag=load.lag, arrival_per_s=arrival, done_per_s=done, missing=missing),
    )


def advice(
    needed: int | None,
    members: int | None,
    partitions: int,
    *,
    lag: int = 0,
    arrival_per_s: float = 0.0,
    done_per_s: float = 0.0,
    missing: str = "no service time",
) -> str:
    """One short line for the table: what to do with this stage's group."""
    notes = []
    if needed is None:
        notes.append(missing)
    elif not members:
        notes.append(f"run {needed}")
    elif needed > members:
        notes.append(f"scale up to {needed}")
    elif needed < members:
        notes.append(f"ok ({needed} would do)")
    else:
        notes.append("ok")
    if needed is not None and needed > partitions:
        # Kafka gives each partition to one member of the group: the rest would sit idle.
        notes.append(f"> {partitions} partitions: add partitions first")
    if lag > 0 and done_per_s == 0:
        notes.append("not draining")
    elif lag > 0 and done_per_s < arrival_per_s:
        notes.append("falling behind")
    return "; ".join(notes)


def stage_workers(settings: Settings) -> dict[str, int]:
    """Items one replica works on at once: decode and preprocess run thread pools; inference's
    concurrency is its batch (already in the per-item time); the sink writes on one thread."""
    return {"decode": settings.decode_workers, "preprocess": settings.inference_workers, "inference": 1, "sink": 1}


# --- Autoscaling on consumer lag (KEDA's Kafka scaler) --------------------------------------------
#
# KEDA runs ceil(group lag / lagThreshold) replicas, so lagThreshold is the lag one replica may
# hold. A partition is a FIFO: an item that finds L items ahead of it on a replica that serves
# `workers / per_item_s` items a second waits L x per_item_s / workers. The threshold is the
# largest L whose wait stays within the stage's share of the end-to-end latency budget.

# End-to-end p99 the autoscaler and the alerts defend (seconds): the "p99 over budget" alert fires
# above it, and each stage's input topic may hold what one replica clears in an equal share of it.
LATENCY_BUDGET_S = 4.0

# Time a stopping replica needs beyond finishing its in-flight items: commit the offsets, leave the
# group, close the producer.
SHUTDOWN_MARGIN_S = 15.0


def stage_budget_s(latency_budget_s: float, stages: int = len(PIPELINE)) -> float:
    """Each stage's share of the end-to-end budget for the wait in its input topic."""
    if latency_budget_s <= 0:
        raise ValueError(f"latency budget must be > 0 s, got {latency_budget_s}")
    return latency_budget_s / stages


def lag_threshold(per_item_s: float, workers: int, budget_s: float) -> int:
    """The lag one replica clears within `budget_s` at its measured service time (at least 1)."""
    if per_item_s <= 0 or workers < 1:
        raise ValueError(f"need a positive service time and workers >= 1, got {per_item_s} s, {workers}")
    return max(1, math.floor(budget_s * workers / per_item_s + _EPSILON))


def drain_seconds(per_item_s: float, workers: int, max_inflight: int) -> float:
    """Time a replica needs to finish the most work it can hold (its in-flight cap)."""
    return max_inflight * per_item_s / workers


@dataclass(frozen=True)
class ScalingBounds:
    """What a KEDA ScaledObject for one stage should say."""

    stage: str
    per_item_s: float | None
    workers: int
    lag_threshold: int | None  # None: no service time measured
    min_replicas: int
    max_replicas: int  # the partition count: replicas beyond it get no work
    grace_period_s: int | None  # terminationGracePeriodSeconds that finishes in-flight work
    note: str


def scaling_bounds(
    stage: str,
    per_item_s: float | None,
    workers: int,
    partitions: int,
    *,
    max_inflight: int,
    latency_budget_s: float = LATENCY_BUDGET_S,
    arrival_per_s: float = 0.0,
    target: float = UTILISATION_TARGET,
) -> ScalingBounds:
    """lagThreshold from the stage's share of the budget; minReplicaCount from the replicas that
    keep up with `arrival_per_s` at `target` utilisation; maxReplicaCount the partition count;
    the grace period from the in-flight cap (settings.max_inflight)."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    needed = replicas_needed(arrival_per_s, per_item_s, workers, target) or 1
    notes = [f"replicas beyond {partitions} partitions get no work"]
    if needed > partitions:
        notes.append(f"{needed} needed: add partitions first")
    if per_item_s is None:
        notes.append("no service time measured")
        threshold = grace = None
    else:
        threshold = lag_threshold(per_item_s, workers, stage_budget_s(latency_budget_s))
        grace = math.ceil(drain_seconds(per_item_s, workers, max_inflight) + SHUTDOWN_MARGIN_S)
    return ScalingBounds(stage, per_item_s, workers, threshold, min(needed, partitions), partitions, grace, "; ".join(notes))


# --- Service times measured by the benchmark (`mmpipe bench`, benchmarks/results/*.json) ----------

# The trace fields of a job that time each stage's work on one item.
_BENCH_SERVICE_FIELD = {"decode": "decode_ms", "preprocess": "preprocess_ms", "sink": "sink_ms"}


def bench_service_times(result: dict) -> dict[str, float]:
    """Seconds per item of each stage in the benchmark's flood of its headline batching policy:
    the saturated pipeline, where lag builds and the autoscaler acts, with full batches. Inference
    is the batches' execute time over the items they carried (a batch's time is observed once
    per item in the trace, so the per-job mean over-counts it by the batch size)."""
    label = result["policies"]["headline"]["label"]
    flood = next(
        (run for run in result["runs"] if run["scenario"] == "flood" and run["label"] == label), None
    )
    if flood is None:
        raise ValueError(f"the benchmark result has no flood run of its headline policy {label!r}")
    stats = flood["stats"]
    times = {stage: stats["breakdown_ms"][field] / 1000 for stage, field in _BENCH_SERVICE_FIELD.items()}
    batch_ms = sum(stats["execute_ms_by_batch"][size] * count for size, count in stats["batch_count"].items())
    times["inference"] = batch_ms / sum(stats["batch_items"].values()) / 1000
    return {spec.name: times[spec.name] for spec in PIPELINE}
