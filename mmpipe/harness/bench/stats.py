"""Figures of one run, computed from the stored JobResults (their per-stage timings)."""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmpipe.schemas import JobResult

# The spans of Timings, in path order; together they tile end_to_end_ms.
SPANS = (
    "queue_decode_ms", "decode_ms", "queue_preprocess_ms", "preprocess_ms", "queue_inference_ms",
    "batch_wait_ms", "execute_ms", "queue_sink_ms", "sink_ms",
)
# Which stage a span is charged to, for "which stage holds it back".
SPAN_STAGE = {
    "queue_decode_ms": "decode", "decode_ms": "decode",
    "queue_preprocess_ms": "preprocess", "preprocess_ms": "preprocess",
    "queue_inference_ms": "inference", "batch_wait_ms": "inference", "execute_ms": "inference",
    "queue_sink_ms": "sink", "sink_ms": "sink",
}
# The spans before a job reaches the inference batcher: their sum after created_at is its
# arrival there (the trace's inference_in stamp).
BEFORE_BATCHER = SPANS[:SPANS.index("batch_wait_ms")]
# Starvation check: the trace stamps a job's arrival at the batcher when the inference stage
# takes its message, a moment before the batcher ranks it; leads within this of the window pass.
STAMP_TOLERANCE_S = 0.05
# Jobs whose batch starts (rebuilt from rounded spans) are closer than this ran in one batch.
SAME_BATCH_S = 1e-4
# Saturation throughput skips this share of the completions while fed: the ramp-up (an empty
# pipeline filling) is not the steady state.
STEADY_SKIP = 0.1
# ... and falls back to the count between the first and last completion unless the fed
# completions span at least this share of all completions' time: a window of one or two batches
# finishing within milliseconds of each other gives a slope of thousands of jobs/s.
STEADY_MIN_SPAN = 0.25


def percentiles(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    arr = np.asarray(values, dtype=float)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {"p50": round(float(p50), 2), "p95": round(float(p95), 2), "p99": round(float(p99), 2),
            "max": round(float(arr.max()), 2), "mean": round(float(arr.mean()), 2)}


def run_stats(results: list[JobResult], published: int, flood: bool) -> dict[str, Any]:
    ok = [r for r in results if r.status == "ok"]
    statuses = Counter(r.status for r in results)
    stats: dict[str, Any] = {
        "published": published,
        "results": len(results),
        "missing": published - len(results),
        "ok": len(ok),
        "statuses": dict(statuses),
        # Which model versions and weights answered (random weights: timings real, labels not).
        "models": dict(Counter(f"{r.model.name}:{r.model.version} ({r.weights})" for r in results if r.model)),
        "throughput": round(_steady_throughput(ok) if flood else _throughput(ok), 3),
        "e2e_ms": percentiles([r.timings.end_to_end_ms for r in ok]),
        # Time in the inference stage's batcher plus execution: what the simulation models.
        "inference_ms": percentiles([r.timings.batch_wait_ms + r.timings.execute_ms for r in ok]),
        "breakdown_ms": mean_spans(ok),
        "breakdown_p99_ms": {span: percentiles([getattr(r.timings, span) for r in ok])["p99"] for span in SPANS},
        "tail_breakdown_ms": _tail_breakdown(ok),
    }
    stats.update(_batches(ok))
    stats["by_modality"] = {
        modality: {"jobs": len(rs), "e2e_ms": percentiles([r.timings.end_to_end_ms for r in rs])}
        for modality, rs in _group(ok, lambda r: r.modality).items()
    }
    return stats


def priority_stats(results: list[JobResult], aging_s: float) -> dict[str, Any]:
    """A run with several priority levels: per level (0 = high) the jobs, end-to-end and
    batcher-wait percentiles, mean spans; the highest level's p99 over the lowest level's; and the
    starvation check at the inference batcher (batcher_overtakes)."""
    ok = [r for r in results if r.status == "ok"]
    every = _group(results, lambda r: r.priority)
    done = _group(ok, lambda r: r.priority)
    levels = {
        str(level): {"jobs": len(every[level]), "ok": len(done[level]),
                     "e2e_ms": percentiles([r.timings.end_to_end_ms for r in done[level]]),
                     "batch_wait_ms": percentiles([r.timings.batch_wait_ms for r in done[level]]),
                     "breakdown_ms": mean_spans(done[level])}
        for level in sorted(every)
    }
    high, low = (min(done), max(done)) if done else (None, None)
    low_p99 = levels[str(low)]["e2e_ms"]["p99"] if done else 0.0
    ratio = levels[str(high)]["e2e_ms"]["p99"] / low_p99 if high != low and low_p99 else None
    return {"aging_s": aging_s, "levels": levels, "high": high, "low": low,
            "high_over_low_p99": None if ratio is None else round(ratio, 4),
            "starvation": batcher_overtakes(ok, aging_s, low)}


def batcher_overtakes(ok: list[JobResult], aging_s: float, watched: int | None) -> dict[str, Any]:
    """The starvation bound (streams/priority.py), checked at the one queue whose entry and exit
    every job's trace stamps: the inference batcher. A job's arrival there is created_at plus the
    spans before it, its exit the start of its batch. Job H overtook job L when it arrived after
    L and ran in an earlier batch; the rank order allows that only if H arrived less than
    max(p_L - p_H, 0) x aging_s after L, so a larger lead (beyond STAMP_TOLERANCE_S) is a
    violation. Valid for one inference replica and one shape bucket (one image model);
    single-part jobs only (a multi-part job's spans are its last part's). The decode admission
    wait and the decode and preprocess pools rank too, but their waits lie inside decode_ms and
    preprocess_ms (nothing stamps when a worker takes an item): not checked here.

    Returns the pairs of levels seen overtaking (victim<-overtaker: window, largest lead, jobs
    overtaken), the jobs overtaken beyond the bound, and for the `watched` level (the lowest)
    its largest batcher wait and end-to-end time, and the job that waited longest: how many
    jobs overtook it and their largest lead."""
    jobs = [r for r in ok if r.parts == 1 and r.timings.batch_size > 0]
    arrived = [r.created_at + sum(getattr(r.timings, s) for s in BEFORE_BATCHER) / 1000 for r in jobs]
    started = [a + r.timings.batch_wait_ms / 1000 for a, r in zip(arrived, jobs)]
    levels = sorted({r.priority for r in jobs})
    latest = {q: float("-inf") for q in levels}  # latest arrival per level among earlier batches
    seen: list[float] = []  # arrivals of the jobs of earlier batches, sorted
    pairs: dict[str, dict[str, Any]] = {}
    beyond: list[str] = []
    overtakers: dict[str, tuple[int, float]] = {}  # job -> (how many overtook it, largest lead)
    order = sorted(range(len(jobs)), key=started.__getitem__)
    batches = np.split(order, np.flatnonzero(np.diff([started[i] for i in order]) >= SAME_BATCH_S) + 1) if jobs else []
    for batch in batches:
        for i in batch:
            r, a = jobs[i], arrived[i]
            leads = {q: latest[q] - a for q in levels if latest[q] > a}
            windows = {q: max(r.priority - q, 0) * aging_s for q in leads}
            for q, lead in leads.items():
                pair = pairs.setdefault(f"{r.priority}<-{q}", {"window_s": windows[q], "max_lead_s": 0.0, "jobs_overtaken": 0})
                pair["max_lead_s"] = round(max(pair["max_lead_s"], lead), 3)
                pair["jobs_overtaken"] += 1
            if any(lead >= windows[q] + STAMP_TOLERANCE_S for q, lead in leads.items()):
                beyond.append(r.job_id)
            overtakers[r.job_id] = (len(seen) - bisect.bisect_right(seen, a), max(leads.values(), default=0.0))
        for i in batch:
            latest[jobs[i].priority] = max(latest[jobs[i].priority], arrived[i])
            bisect.insort(seen, arrived[i])
    out: dict[str, Any] = {"where": "inference batcher", "jobs": len(jobs), "tolerance_s": STAMP_TOLERANCE_S,
                           "pairs": dict(sorted(pairs.items())), "beyond_bound": len(beyond), "beyond_jobs": beyond[:10]}
    low = [r for r in jobs if r.priority == watched]
    if low:
        worst = max(low, key=lambda r: r.timings.batch_wait_ms)
        count, lead = overtakers[worst.job_id]
        out["low"] = {
            "priority": watched,
            "max_batch_wait_ms": round(worst.timings.batch_wait_ms, 2),
            "max_e2e_ms": round(max(r.timings.end_to_end_ms for r in low), 2),
            "longest_wait": {"job_id": worst.job_id, "overtaken_by": count, "max_lead_s": round(lead, 3)},
        }
    return out


def dominant_stage(breakdown_ms: dict[str, float]) -> tuple[str, float]:
    """The stage whose spans (its input queue included) take the largest share of the path."""
    per_stage: dict[str, float] = defaultdict(float)
    for span, value in breakdown_ms.items():
        per_stage[SPAN_STAGE[span]] += value
    total = sum(per_stage.values()) or 1.0
    stage = max(per_stage, key=per_stage.get)
    return stage, per_stage[stage] / total


def _tail_breakdown(ok: list[JobResult]) -> dict[str, float]:
    """Mean spans of the slowest 1% of jobs (at least one): where the p99 is spent."""
    slowest = sorted(ok, key=lambda r: r.timings.end_to_end_ms)[-max(1, len(ok) // 100):]
    return mean_spans(slowest)


def mean_spans(results: list[JobResult]) -> dict[str, float]:
    """Mean ms per span over these jobs (zeros when there are none)."""
    return {span: round(float(np.mean([getattr(r.timings, span) for r in results])), 2) if results else 0.0 for span in SPANS}


def _throughput(ok: list[JobResult]) -> float:
    """Completions per second between the first and the last completion: the offered rate
    when the pipeline keeps up, its capacity when it does not (first creation to last
    completion would bill one end-to-end latency to a short run)."""
    done = sorted(r.completed_at for r in ok)
    if len(done) < 2 or done[-1] <= done[0]:
        return 0.0
    return (len(done) - 1) / (done[-1] - done[0])


def _steady_throughput(ok: list[JobResult]) -> float:
    """Slope of completions over time while the pipeline is still fed (completions up to the
    last arrival), past the ramp-up. Jobs complete in clumps (a batch at a time), so a
    least-squares line through the staircase is steadier than a count between two completions."""
    if not ok:
        return 0.0
    last_arrival = max(r.created_at for r in ok)
    done = np.sort([r.completed_at for r in ok])
    fed = done[done <= last_arrival]
    lo = int(STEADY_SKIP * len(fed))
    if len(fed) - lo < 4 or fed[-1] - fed[lo] <= STEADY_MIN_SPAN * (done[-1] - done[0]):
        return _throughput(ok)
    return float(np.polyfit(fed[lo:], np.arange(lo, len(fed)), 1)[0])


def _batches(ok: list[JobResult]) -> dict[str, Any]:
    """Batch sizes as the jobs saw them. A job of one item that ran in a batch of b is one of
    b such jobs, so batches of size b = jobs at b / b (exact for single-item jobs)."""
    items = Counter(r.timings.batch_size for r in ok if r.timings.batch_size > 0)
    batches = {size: count / size for size, count in items.items()}
    n_batches = sum(batches.values())
    execute = _group(ok, lambda r: r.timings.batch_size)
    return {
        "batch_items": {str(k): v for k, v in sorted(items.items())},
        "batch_count": {str(k): round(v, 1) for k, v in sorted(batches.items())},
        "mean_batch": round(sum(items.values()) / n_batches, 2) if n_batches else 0.0,
        "execute_ms_by_batch": {
            str(size): round(float(np.median([r.timings.execute_ms for r in rs])), 2)
            for size, rs in sorted(execute.items()) if size > 0
        },
    }


def _group(results: list[JobResult], key: Any) -> dict[Any, list[JobResult]]:
    groups: dict[Any, list[JobResult]] = defaultdict(list)
    for r in results:
        groups[key(r)].append(r)
    return groups
