"""Partition-aware backpressure: bounded in-flight work per partition, pause/resume of fetching,
and a bound on the backlog a stage may pile up in front of the next stage.

A stage takes a message, works on it, produces its output, waits for the broker's ack of that
output and only then acks the input (so the committed offset never passes unfinished work).
Between take and ack the message is "in flight". The gate pauses a partition's fetching for
either of two reasons, and resumes it when neither holds:

* "inflight": the partition has `high` items in flight; released when it drains to `low`
  (hysteresis, no flapping). Other partitions keep flowing.
* "downstream": the next stage's consumer group lags more than a bound on the matching
  partition of this stage's output topic (Ray Data's bounded memory between operators, made
  of Kafka topics: a slow GPU stage throttles decoding instead of piling frames up).

Per process, at `max_total` in-flight items the agent itself waits; that also bounds what
faust may still deliver from its prefetch buffer after a pause. Memory per stage is therefore
bounded by max_total items plus faust's stream buffer, never by the backlog in Kafka.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from faust.types import TP

from mmpipe.streams.metrics import StageMetrics

TPLike = Any  # faust TP / aiokafka TopicPartition: (topic, partition) named tuple


def as_tp(tp: TPLike) -> TP:
    """faust's consumer asserts its partition sets hold faust TPs, not aiokafka's twins."""
    return tp if isinstance(tp, TP) else TP(tp[0], tp[1])

INFLIGHT = "inflight"
DOWNSTREAM = "downstream"


class PartitionGate:
    def __init__(
        self,
        *,
        high: int,
        low: int,
        max_total: int,
        pause: Callable[[list[TPLike]], None],
        resume: Callable[[list[TPLike]], None],
        metrics: StageMetrics | None = None,
    ) -> None:
        if not 0 <= low < high:
            raise ValueError(f"need 0 <= low < high, got low={low} high={high}")
        self.high = high
        self.low = low
        self.max_total = max_total
        self._pause = pause
        self._resume = resume
        self._metrics = metrics
        self.inflight: Counter[TPLike] = Counter()
        self.reasons: dict[TPLike, set[str]] = defaultdict(set)
        self.total = 0
        self.peak_total = 0
        self._has_space = asyncio.Event()
        self._has_space.set()
        # Labelled gauges, looked up once: a labels() call costs more than the rest of a
        # message's bookkeeping here, and _publish runs several times per message.
        self._total_gauge: Any = metrics.inflight.labels(metrics.stage) if metrics else None
        self._labelled: dict[TPLike, tuple[Any, Any]] = {}

    async def acquire(self, tp: TPLike) -> None:
        """Count one item of `tp` in flight; wait while the process-wide cap is reached."""
        tp = as_tp(tp)
        if self.total >= self.max_total and self._metrics:
            self._metrics.admission_waits.labels(self._metrics.stage).inc()
        while self.total >= self.max_total:
            self._has_space.clear()
            await self._has_space.wait()
        self.total += 1
        self.peak_total = max(self.peak_total, self.total)
        self.inflight[tp] += 1
        if self.inflight[tp] >= self.high:
            # Pause again even if already paused: faust's own buffer flow control can
            # re-activate a partition that we paused.
            self._hold(tp, INFLIGHT, force=True)
        self._publish(tp)

    def release(self, tp: TPLike) -> None:
        """One item of `tp` is done (its output acknowledged, its offset acked)."""
        tp = as_tp(tp)
        self.total -= 1
        self.inflight[tp] -= 1
        if self.inflight[tp] <= 0:
            del self.inflight[tp]
        if self.inflight[tp] <= self.low:
            self._unhold(tp, INFLIGHT)
        self._publish(tp)
        if self.total < self.max_total:
            self._has_space.set()

    def hold_for_downstream(self, tps: Iterable[TPLike], full: bool) -> None:
        """Pause (full=True) or release (full=False) partitions for the downstream reason."""
        for tp in map(as_tp, tps):
            if full:
                # forced: faust resumes every partition after a rebalance's recovery
                self._hold(tp, DOWNSTREAM, force=True)
            else:
                self._unhold(tp, DOWNSTREAM)
            self._publish(tp)

    def forget(self, tps: Iterable[TPLike]) -> None:
        """Partitions revoked in a rebalance: they are no longer ours to resume."""
        for tp in map(as_tp, tps):
            self.reasons.pop(tp, None)
            self._publish(tp)

    def _hold(self, tp: TPLike, reason: str, force: bool = False) -> None:
        reasons = self.reasons[tp]
        was_paused = bool(reasons)
        reasons.add(reason)
        if not was_paused and self._metrics:
            self._metrics.pauses.labels(self._metrics.stage).inc()
        if not was_paused or force:
            self._pause([tp])

    def _unhold(self, tp: TPLike, reason: str) -> None:
        reasons = self.reasons.get(tp)
        if not reasons or reason not in reasons:
            return
        reasons.discard(reason)
        if not reasons:
            self._resume([tp])

    def _publish(self, tp: TPLike) -> None:
        if self._metrics is None:
            return
        self._total_gauge.set(self.total)
        inflight, paused = self._partition_gauges(tp)
        inflight.set(self.inflight.get(tp, 0))
        paused.set(1 if self.reasons.get(tp) else 0)

    def _partition_gauges(self, tp: TPLike) -> tuple[Any, Any]:
        gauges = self._labelled.get(tp)
        if gauges is None:
            assert self._metrics is not None
            labels = (self._metrics.stage, tp[0], str(tp[1]))
            gauges = self._labelled[tp] = (
                self._metrics.partition_inflight.labels(*labels),
                self._metrics.partition_paused.labels(*labels),
            )
        return gauges
