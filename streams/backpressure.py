"""Partition-aware backpressure: bounded in-flight work per partition, pause/resume of fetching.

A stage takes a message, works on it, produces its output, waits for the broker's ack of that
output and only then acks the input (so the committed offset never passes unfinished work).
Between take and ack the message is "in flight". The gate bounds that:

* per partition: at `high` in-flight items the partition's fetching is paused (other partitions
  keep flowing); it resumes when the partition drains to `low` (hysteresis, no flapping);
* per process: at `max_total` in-flight items the agent itself waits, which also bounds what
  faust may still deliver from its prefetch buffer after a pause.

Memory per stage is therefore bounded by max_total items plus faust's stream buffer
(stream_buffer_maxsize per topic), never by the backlog in Kafka.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from streams.metrics import StageMetrics

TPLike = Any  # faust TP / aiokafka TopicPartition: (topic, partition) named tuple


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
        self.paused: set[TPLike] = set()
        self.total = 0
        self.peak_total = 0
        self._has_space = asyncio.Event()
        self._has_space.set()

    async def acquire(self, tp: TPLike) -> None:
        """Count one item of `tp` in flight; wait while the process-wide cap is reached."""
        if self.total >= self.max_total and self._metrics:
            self._metrics.admission_waits.labels(self._metrics.stage).inc()
        while self.total >= self.max_total:
            self._has_space.clear()
            await self._has_space.wait()
        self.total += 1
        self.peak_total = max(self.peak_total, self.total)
        self.inflight[tp] += 1
        # Pause again even if already marked paused: faust's own buffer flow control can
        # re-activate a partition that we paused.
        if self.inflight[tp] >= self.high:
            if tp not in self.paused and self._metrics:
                self._metrics.pauses.labels(self._metrics.stage).inc()
            self.paused.add(tp)
            self._pause([tp])
        self._publish(tp)

    def release(self, tp: TPLike) -> None:
        """One item of `tp` is done (its output acknowledged, its offset acked)."""
        self.total -= 1
        self.inflight[tp] -= 1
        if self.inflight[tp] <= 0:
            del self.inflight[tp]
        if tp in self.paused and self.inflight[tp] <= self.low:
            self.paused.discard(tp)
            self._resume([tp])
        self._publish(tp)
        if self.total < self.max_total:
            self._has_space.set()

    def forget(self, tps: Iterable[TPLike]) -> None:
        """Partitions revoked in a rebalance: they are no longer ours to resume."""
        for tp in tps:
            self.paused.discard(tp)
            self._publish(tp)

    def resume_all(self) -> None:
        if self.paused:
            self._resume(list(self.paused))
            self.paused.clear()

    def _publish(self, tp: TPLike) -> None:
        if self._metrics is None:
            return
        stage = self._metrics.stage
        topic, partition = tp[0], str(tp[1])
        self._metrics.inflight.labels(stage).set(self.total)
        self._metrics.partition_inflight.labels(stage, topic, partition).set(self.inflight.get(tp, 0))
        self._metrics.partition_paused.labels(stage, topic, partition).set(1 if tp in self.paused else 0)
