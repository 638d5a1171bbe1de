"""Dynamic batching with two independent limits, shape buckets and per-item deadlines.

BatchPolicy is the pure decision logic (no asyncio, clock passed in) so it is tested under a
fake clock; DynamicBatcher runs it against real time and a model on an executor thread.

A bucket (items with equal shape keys) is flushed when
  * it holds max_batch_size items ("full"), or
  * its oldest item has waited max_wait ("max_wait") - dynamic mode, or
  * its oldest item has waited static_timeout ("timeout") - static mode, which otherwise only
    runs full batches, or
  * at once, one item at a time ("off") - batching disabled.
Items whose deadline passes while queued are answered as expired and never run. When several
buckets are due, the one with the oldest item goes first, so a rare shape is not starved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from mmpipe.schemas.settings import BatchingSettings
from mmpipe.streams.metrics import StageMetrics

log = logging.getLogger(__name__)


class Expired(Exception):
    """The item's deadline passed before it could run."""


class ItemFailed(Exception):
    """The model failed on this item alone (a poison input), or the output was malformed."""


@dataclass
class Pending:
    payload: Any
    key: Hashable
    arrived: float  # batcher clock
    deadline: float  # batcher clock
    future: asyncio.Future | None = None


@dataclass(frozen=True)
class BatchInfo:
    size: int
    trigger: str
    oldest_wait_s: float
    started_at: float  # wall clock, for traces
    finished_at: float


@dataclass
class BatchPolicy:
    max_batch_size: int
    max_wait_s: float
    mode: str = "dynamic"
    static_timeout_s: float = 1.0
    buckets: dict[Hashable, deque[Pending]] = field(default_factory=dict)
    size: int = 0

    @classmethod
    def from_settings(cls, s: BatchingSettings, model_limit: int) -> BatchPolicy:
        max_batch = 1 if s.mode == "off" else min(s.max_batch_size, model_limit)
        return cls(max_batch, s.max_wait_ms / 1000.0, s.mode, s.static_timeout_ms / 1000.0)

    def add(self, item: Pending) -> None:
        self.buckets.setdefault(item.key, deque()).append(item)
        self.size += 1

    def pop_expired(self, now: float) -> list[Pending]:
        expired: list[Pending] = []
        for key in list(self.buckets):
            queue = self.buckets[key]
            keep = deque(p for p in queue if p.deadline > now)
            if len(keep) != len(queue):
                expired.extend(p for p in queue if p.deadline <= now)
                self._set(key, keep)
        self.size -= len(expired)
        return expired

    def next_batch(self, now: float) -> tuple[list[Pending], str] | None:
        due: list[tuple[float, Hashable, str]] = []
        for key, queue in self.buckets.items():
            trigger = self._trigger(queue, now)
            if trigger:
                due.append((queue[0].arrived, key, trigger))
        if not due:
            return None
        _, key, trigger = min(due, key=lambda d: d[0])
        queue = self.buckets[key]
        batch = [queue.popleft() for _ in range(min(self.max_batch_size, len(queue)))]
        self._set(key, queue)
        self.size -= len(batch)
        return batch, trigger

    def wake_at(self) -> float | None:
        """The earliest time a bucket can become due or an item can expire."""
        times = []
        for queue in self.buckets.values():
            head = queue[0]
            if self.mode == "dynamic":
                times.append(head.arrived + self.max_wait_s)
            elif self.mode == "static":
                times.append(head.arrived + self.static_timeout_s)
            times.append(min(p.deadline for p in queue))
        return min(times) if times else None

    def _trigger(self, queue: deque[Pending], now: float) -> str | None:
        if self.mode == "off" or len(queue) >= self.max_batch_size:
            return "full"
        # Same expressions as wake_at(), so a wake-up at that instant always finds it due.
        oldest = queue[0].arrived
        if self.mode == "dynamic" and now >= oldest + self.max_wait_s:
            return "max_wait"
        if self.mode == "static" and now >= oldest + self.static_timeout_s:
            return "timeout"
        return None

    def _set(self, key: Hashable, queue: deque[Pending]) -> None:
        if queue:
            self.buckets[key] = queue
        else:
            self.buckets.pop(key, None)


class BatcherLoop:
    """A batcher's scheduling loop (`_run`) as a task from start() to stop(), and its sleep
    until new work is signalled or the policy's next due time."""

    _task: asyncio.Task | None = None
    _wakeup: asyncio.Event
    _clock: Callable[[], float]

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        raise NotImplementedError

    async def _sleep_until(self, wake: float | None) -> None:
        self._wakeup.clear()
        try:
            timeout = None if wake is None else max(wake - self._clock(), 0.0)
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class DynamicBatcher(BatcherLoop):
    """Queues items for one model and runs them in batches on a single executor thread."""

    def __init__(
        self,
        name: str,
        predict: Callable[[list[Any]], Sequence[Any]],
        bucket_key: Callable[[Any], Hashable],
        settings: BatchingSettings,
        model_limit: int,
        executor: Executor,
        metrics: StageMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.policy = BatchPolicy.from_settings(settings, model_limit)
        self.max_queue = settings.max_queue
        self._predict = predict
        self._bucket_key = bucket_key
        self._executor = executor
        self._metrics = metrics
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()

    async def submit(self, payload: Any, deadline_wall: float) -> tuple[Any, BatchInfo]:
        """Queue one item; resolves with (output, batch info), or raises Expired/ItemFailed."""
        while self.policy.size >= self.max_queue:
            self._space.clear()
            await self._space.wait()
        now = self._clock()
        future = asyncio.get_running_loop().create_future()
        deadline = now + (deadline_wall - time.time())
        self.policy.add(Pending(payload, self._bucket_key(payload), now, deadline, future))
        self._publish_queue()
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        while True:
            now = self._clock()
            for item in self.policy.pop_expired(now):
                _resolve(item, exc=Expired(f"deadline passed after {now - item.arrived:.3f}s in the batcher"))
                if self._metrics:
                    self._metrics.expired.labels("inference").inc()
            ready = self.policy.next_batch(now)
            self._publish_queue()
            if ready is not None:
                batch, trigger = ready
                await self._execute(batch, trigger, now)
                continue
            await self._sleep_until(self.policy.wake_at())

    async def _execute(self, batch: list[Pending], trigger: str, now: float) -> None:
        loop = asyncio.get_running_loop()
        oldest_wait = now - min(p.arrived for p in batch)
        started = time.time()
        try:
            outputs = await loop.run_in_executor(self._executor, self._checked_predict, [p.payload for p in batch])
        except Exception as exc:
            log.warning("%s: batch of %d failed (%s); isolating items", self.name, len(batch), exc)
            await self._run_alone(batch, trigger, oldest_wait)
            return
        info = BatchInfo(len(batch), trigger, oldest_wait, started, time.time())
        self._observe(info)
        for item, output in zip(batch, outputs):
            _resolve(item, result=(output, info))

    async def _run_alone(self, batch: list[Pending], trigger: str, oldest_wait: float) -> None:
        """Retry each item once on its own: one poison input fails only itself."""
        loop = asyncio.get_running_loop()
        if self._metrics and len(batch) > 1:
            self._metrics.retries.labels("inference", "batch_isolation").inc(len(batch))
        for item in batch:
            started = time.time()
            try:
                (output,) = await loop.run_in_executor(self._executor, self._checked_predict, [item.payload])
            except Exception as exc:
                _resolve(item, exc=ItemFailed(f"{type(exc).__name__}: {exc}"))
                continue
            info = BatchInfo(1, f"{trigger}+isolated", oldest_wait, started, time.time())
            self._observe(info)
            _resolve(item, result=(output, info))

    def _checked_predict(self, inputs: list[Any]) -> Sequence[Any]:
        outputs = self._predict(inputs)
        if len(outputs) != len(inputs):
            raise ItemFailed(f"model returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs

    def _observe(self, info: BatchInfo) -> None:
        if self._metrics is None:
            return
        self._metrics.batch_size.labels(self.name).observe(info.size)
        self._metrics.batch_wait.labels(self.name).observe(info.oldest_wait_s)
        self._metrics.batch_execute.labels(self.name).observe(info.finished_at - info.started_at)
        self._metrics.batch_flush.labels(self.name, info.trigger).inc()

    def _publish_queue(self) -> None:
        if self.policy.size < self.max_queue:
            self._space.set()
        if self._metrics:
            self._metrics.batcher_queue.labels(self.name).set(self.policy.size)


def _resolve(item: Pending, result: Any = None, exc: BaseException | None = None) -> None:
    if item.future is None or item.future.done():
        return  # the caller gave up (cancelled); nothing to deliver
    if exc is not None:
        item.future.set_exception(exc)
    else:
        item.future.set_result(result)
