"""Figures of one run, computed from the stored JobResults (their per-stage timings)."""

from __future__ import annotations

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
# Saturation throughput skips this share of the completions while fed: the ramp-up (an empty
# pipeline filling) is not the steady state.
STEADY_SKIP = 0.1


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
        "breakdown_ms": {span: round(float(np.mean([getattr(r.timings, span) for r in ok])), 2) if ok else 0.0 for span in SPANS},
        "breakdown_p99_ms": {span: percentiles([getattr(r.timings, span) for r in ok])["p99"] for span in SPANS},
        "tail_breakdown_ms": _tail_breakdown(ok),
    }
    stats.update(_batches(ok))
    stats["by_modality"] = {
        modality: {"jobs": len(rs), "e2e_ms": percentiles([r.timings.end_to_end_ms for r in rs])}
        for modality, rs in _group(ok, lambda r: r.modality).items()
    }
    return stats


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
    if not ok:
        return {span: 0.0 for span in SPANS}
    slowest = sorted(ok, key=lambda r: r.timings.end_to_end_ms)[-max(1, len(ok) // 100):]
    return {span: round(float(np.mean([getattr(r.timings, span) for r in slowest])), 2) for span in SPANS}


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
    if len(fed) - lo < 4 or fed[-1] <= fed[lo]:
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
