"""Admission: how much a stage may add in front of the next one.

The next stage's consumer group lag on this stage's output topic is read every lag interval;
between two read-outs the stage counts what it sent since (so a fast stage pauses as soon as
its estimate crosses the bound, not one interval late) and what it admitted but has not sent
yet. From that estimate, per partition:

* hold / release: the partition gate pauses an input partition while the next stage lags
  more than `high` on the matching output partition, resumes it at `low` (hysteresis);
* exact admission at the head of the pipeline (decode): a message goes on only while the
  estimate is under `high`; otherwise it waits, or, when the stage sheds load, is turned away.

Keys are job IDs and partition counts match, so input partition p feeds output partition p;
with other counts the worst partition decides. No Kafka here: delivery feeds the read-outs.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from mmpipe.schemas.events import NORMAL_PRIORITY
from mmpipe.streams.backpressure import PartitionGate
from mmpipe.streams.priority import PriorityWaiters

ADMISSION_POLL_S = 0.005


class DownstreamAdmission:
    def __init__(
        self,
        *,
        high: int,
        low: int,
        aging_s: float,
        gate: PartitionGate,
        assigned: Callable[[], Iterable[Any]],
        shedding: Callable[[], bool],
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        poll_s: float = ADMISSION_POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.high = high
        self.low = low
        self._aging_s = aging_s
        self._clock = clock
        self._order: dict[int, PriorityWaiters] = {}  # waiters per input partition, by priority
        self.gate = gate
        self._assigned = assigned  # this stage's assigned input partitions (TPs)
        self._shedding = shedding
        self._sleep = sleep
        self._poll_s = poll_s
        self._lag: dict[int, int] = {}  # next stage's lag per output partition, see count_sent
        self._admitting: Counter[int] = Counter()  # admitted messages whose output is not sent yet
        # (topic, partition, offset) of those messages: a stage reads two lanes, whose offsets
        # are independent, so a partition and an offset alone name two messages at times.
        self._reserved: set[tuple[str, int, int]] = set()
        self._told: dict[tuple[str, int], bool] = {}  # (topic, partition) -> last hold told the gate

    @property
    def known(self) -> bool:
        """True once a lag read-out arrived (before it nothing is held)."""
        return bool(self._lag)

    @property
    def holding(self) -> bool:
        """Whether a partition is held for the next stage's lag (only a read-out releases it)."""
        return any(self._told.values())

    def update(self, lag_by_partition: dict[int, int]) -> None:
        """A fresh read-out of the next stage's lag: replaces the estimate."""
        self._lag = dict(lag_by_partition)
        self.hold_or_release(reassert=True)

    def count_sent(self, partitions: Iterable[int]) -> None:
        """Outputs the broker acknowledged on the downstream topic since the last read-out."""
        if not self._lag:
            return
        added = list(partitions)
        for partition in added:
            self._lag[partition] = self._lag.get(partition, 0) + 1
        if added:
            self.hold_or_release()

    def lag_at(self, partition: int) -> int:
        if partition in self._lag:
            return self._lag[partition]
        return max(self._lag.values(), default=0)

    def estimate(self, partition: int) -> int:
        return self.lag_at(partition) + self._admitting[partition]

    async def wait_for_room(self, partition: int, offset: int, priority: int = NORMAL_PRIORITY, *, topic: str) -> bool:
        """Wait until the next stage has room for this message's work (True), or give up at
        once while the stage sheds load (False). Waiters take room in rank order (priority,
        aged: streams/priority.py). A True reserves room until release()."""
        order = self._order.setdefault(partition, PriorityWaiters(self._aging_s, self._clock))
        turn = order.enter(priority)
        try:
            while not order.is_first(turn) or self.estimate(partition) >= self.high:
                if self._shedding():
                    return False
                await self._sleep(self._poll_s)
        finally:
            order.leave(turn)
        key = (topic, partition, offset)
        if key not in self._reserved:  # a retried handler admits the same message again
            self._reserved.add(key)
            self._admitting[partition] += 1
        return True

    def release(self, partition: int, offset: int, *, topic: str) -> None:
        """The message's outputs are sent (or it failed): its reservation ends."""
        key = (topic, partition, offset)
        if key in self._reserved:
            self._reserved.discard(key)
            self._admitting[partition] -= 1

    def refresh(self) -> None:
        """Re-decide holds after the estimate moved (a message finished)."""
        if self._lag:
            self.hold_or_release()

    def hold_or_release(self, reassert: bool = False) -> None:
        """Tell the gate which partitions to hold. After each message only a change is told (the
        gate's pause and its metrics cost more than the message's own bookkeeping); each read-out
        tells every hold again, since faust resumes all partitions after a rebalance's recovery."""
        shedding = self._shedding()
        for tp in self._assigned():
            lag = self.lag_at(tp.partition)
            if shedding or lag <= self.low:
                full = False
            elif lag > self.high:
                full = True
            else:
                continue  # between low and high: as it was (hysteresis)
            key = (tp.topic, tp.partition)
            if reassert or self._told.get(key) is not full:
                self._told[key] = full
                self.gate.hold_for_downstream([tp], full=full)
