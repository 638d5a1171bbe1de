"""Dynamic batching with two independent limits, shape buckets and per-item deadlines.

BatchPolicy is the pure decision logic (no asyncio, clock passed in) so it is tested under a
fake clock; DynamicBatcher runs it against real time and a model on an executor thread.

A bucket (items with equal shape keys) is flushed when
  * it holds max_batch_size items ("full"), or
  * its oldest item has waited max_wait ("max_wait") - dynamic mode, or
  * its oldest item has waited static_timeout ("timeout") - static mode, which otherwise only
    runs full batches, or
  * at once, one item at a time ("off") - batching disabled.
Items whose deadline passes while queued are answered as expired and never run, unless their
timeout action is run_late (then they run when their turn comes and the caller marks them
late). Items carry a priority: within a bucket the best-ranked items (streams/priority.py:
highest priority first, aged so low priorities are overtaken only for a bounded time) form the
batch, and when several buckets are due, the one whose best item ranks first goes first; with
equal priorities that is the oldest item, so a rare shape is not starved. A bucket whose best
item is at expedite_priority or higher is due at once ("expedite"): if it holds a full batch, that
batch runs, urgent items first (no throughput is lost when the model is the bottleneck); if not,
only the leading urgent items run, so urgent work neither waits for max_wait nor pays for the
items that happen to be queued. Ranks still decide who leads, so the starvation bound is the same.

The urgent slot (Triton's second model instance, kept for urgent work): a model whose predict
may run on two threads at once (ModelConfig.reentrant_predict) runs the best-ranked urgent items
on a second thread whenever that thread is free, so they neither wait for a running batch nor
ride in a full one (a batch of 8 ran 3-5x as long as a batch of 1 on the measured CPU). They
run in batches of their own level, which gives up the batching gain on them (on the measured
CPU an item alone cost 1.2-1.4x its share of a full batch; with 10 % urgent work the served
rate did not move beyond the runs' spread). On one CPU core the two threads share it for the
urgent batch's length: the running batch finishes that much later and no work is added. On a
GPU both issue kernels on the default stream (no stream per thread yet), so the urgent kernels
queue behind those the running batch already issued. Only an urgent item that ranks first of
everything queued takes the slot, so the starvation bound holds there too.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from mmpipe.schemas.events import NORMAL_PRIORITY
from mmpipe.schemas.settings import BatchingSettings
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.priority import rank
from mmpipe.streams.tasks import cancel_and_wait

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
    priority: int = NORMAL_PRIORITY  # 0 = highest (streams/priority.py)
    on_timeout: str = "reject"  # reject: expire in the queue; run_late: run, marked late

    @property
    def expires(self) -> bool:
        return self.on_timeout != "run_late"


@dataclass(frozen=True)
class BatchInfo:
    size: int
    trigger: str
    oldest_wait_s: float
    started_at: float  # wall clock, for traces
    finished_at: float


Entry = tuple[float, int, Pending]  # (rank, arrival sequence, item): a bucket is a heap of these


@dataclass
class BatchPolicy:
    max_batch_size: int
    max_wait_s: float
    mode: str = "dynamic"
    static_timeout_s: float = 1.0
    aging_s: float = 1.0  # priority levels: see streams/priority.py
    expedite_priority: int | None = None  # this level and higher skip max_wait (see the module docstring)
    buckets: dict[Hashable, list[Entry]] = field(default_factory=dict)
    size: int = 0
    _seq: Iterator[int] = field(default_factory=itertools.count, repr=False)

    @classmethod
    def from_settings(cls, s: BatchingSettings, model_limit: int, aging_s: float = 1.0) -> BatchPolicy:
        max_batch = 1 if s.mode == "off" else min(s.max_batch_size, model_limit)
        return cls(max_batch, s.max_wait_ms / 1000.0, s.mode, s.static_timeout_ms / 1000.0, aging_s,
                   s.expedite_priority)

    def add(self, item: Pending) -> None:
        entry = (rank(item.priority, item.arrived, self.aging_s), next(self._seq), item)
        heapq.heappush(self.buckets.setdefault(item.key, []), entry)
        self.size += 1

    def pop_expired(self, now: float) -> list[Pending]:
        """Remove and return the items whose deadline passed and whose timeout action is
        reject; run_late items stay and run when their turn comes."""
        expired: list[Pending] = []
        for key in list(self.buckets):
            heap = self.buckets[key]
            gone = [e for e in heap if e[2].expires and e[2].deadline <= now]
            if gone:
                expired.extend(e[2] for e in gone)
                self._set(key, [e for e in heap if not (e[2].expires and e[2].deadline <= now)])
        self.size -= len(expired)
        return expired

    def next_batch(self, now: float) -> tuple[list[Pending], str] | None:
        """The due bucket whose best item ranks first (highest priority, then oldest), and its
        best-ranked items up to max_batch_size."""
        due: list[tuple[float, int, Hashable, str]] = []
        for key, heap in self.buckets.items():
            trigger = self._trigger(heap, now)
            if trigger:
                due.append((heap[0][0], heap[0][1], key, trigger))
        if not due:
            return None
        *_, key, trigger = min(due, key=lambda d: (d[0], d[1]))
        return self._take(key, urgent_only=trigger == "expedite"), trigger

    def next_urgent_batch(self) -> list[Pending] | None:
        """The urgent slot's work: the leading urgent items of the bucket whose best item ranks
        first of all, if that item is urgent (up to max_batch_size of them)."""
        if not self.buckets:
            return None
        key = min(self.buckets, key=lambda k: self.buckets[k][0][:2])
        return self._take(key, urgent_only=True) or None

    def expiry_at(self) -> float | None:
        """The earliest deadline of a queued item that expires (a reject timeout action)."""
        return min((e[2].deadline for heap in self.buckets.values() for e in heap if e[2].expires), default=None)

    def wake_at(self) -> float | None:
        """The earliest time a bucket can become due or an item can expire."""
        times = []
        for heap in self.buckets.values():
            oldest = _oldest(heap)
            if self._urgent(heap[0][2]):
                times.append(heap[0][2].arrived)
            if self.mode == "dynamic":
                times.append(oldest + self.max_wait_s)
            elif self.mode == "static":
                times.append(oldest + self.static_timeout_s)
        expiry = self.expiry_at()
        if expiry is not None:
            times.append(expiry)
        return min(times, default=None)

    def _take(self, key: Hashable, urgent_only: bool) -> list[Pending]:
        """The bucket's best-ranked items up to max_batch_size (only its leading urgent ones
        with `urgent_only`), out of the queue."""
        heap = self.buckets[key]
        batch: list[Pending] = []
        while heap and len(batch) < self.max_batch_size and (not urgent_only or self._urgent(heap[0][2])):
            batch.append(heapq.heappop(heap)[2])
        self._set(key, heap)
        self.size -= len(batch)
        return batch

    def _urgent(self, item: Pending) -> bool:
        return self.expedite_priority is not None and item.priority <= self.expedite_priority

    def _trigger(self, heap: list[Entry], now: float) -> str | None:
        if self.mode == "off" or len(heap) >= self.max_batch_size:
            return "full"
        if self._urgent(heap[0][2]):
            return "expedite"
        # Same expressions as wake_at(), so a wake-up at that instant always finds it due.
        # The wait is the oldest item's, whatever its priority: every item keeps max_wait.
        oldest = _oldest(heap)
        if self.mode == "dynamic" and now >= oldest + self.max_wait_s:
            return "max_wait"
        if self.mode == "static" and now >= oldest + self.static_timeout_s:
            return "timeout"
        return None

    def _set(self, key: Hashable, heap: list[Entry]) -> None:
        if heap:
            heapq.heapify(heap)
            self.buckets[key] = heap
        else:
            self.buckets.pop(key, None)


def _oldest(heap: list[Entry]) -> float:
    return min(e[2].arrived for e in heap)


class BatcherLoop:
    """A batcher's scheduling loop (`_run`) as a task from start() to stop(), and its sleep
    until new work is signalled or the policy's next due time."""

    _task: asyncio.Task | None = None
    _wakeup: asyncio.Event
    _clock: Callable[[], float]

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

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
        aging_s: float = 1.0,
        urgent_executor: Executor | None = None,
    ) -> None:
        self.name = name
        self.policy = BatchPolicy.from_settings(settings, model_limit, aging_s)
        self.max_queue = settings.max_queue
        self._predict = predict
        self._bucket_key = bucket_key
        self._executor = executor
        self._urgent_executor = urgent_executor  # the urgent slot's thread (module docstring)
        self._metrics = metrics
        self._clock = clock
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._running: asyncio.Task | None = None  # the batch on the model thread
        self._urgent_running: asyncio.Task | None = None  # urgent items beside it

    async def stop(self) -> None:
        await super().stop()
        for task in (self._running, self._urgent_running):
            await cancel_and_wait(task)

    async def submit(
        self, payload: Any, deadline_wall: float, priority: int = NORMAL_PRIORITY, on_timeout: str = "reject",
    ) -> tuple[Any, BatchInfo]:
        """Queue one item; resolves with (output, batch info), or raises Expired/ItemFailed."""
        while self.policy.size >= self.max_queue:
            self._space.clear()
            await self._space.wait()
        now = self._clock()
        future = asyncio.get_running_loop().create_future()
        deadline = now + (deadline_wall - time.time())
        self.policy.add(Pending(payload, self._bucket_key(payload), now, deadline, future, priority, on_timeout))
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
            if self._urgent_executor is not None and self._urgent_running is None:
                # First: urgent items neither wait for a running batch nor ride in a full one.
                urgent = self.policy.next_urgent_batch()
                if urgent is not None:
                    self._urgent_running = self._spawn(urgent, "urgent_slot", now, self._urgent_executor)
            if self._running is None:
                ready = self.policy.next_batch(now)
                if ready is not None:
                    self._running = self._spawn(*ready, now, self._executor)
            self._publish_queue()
            # While a batch runs only a new item (submit), its end or an expiry can change anything.
            await self._sleep_until(self.policy.wake_at() if self._running is None else self.policy.expiry_at())

    def _spawn(self, batch: list[Pending], trigger: str, now: float, executor: Executor) -> asyncio.Task:
        task = asyncio.ensure_future(self._execute(batch, trigger, now, executor))
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        if self._running is task:
            self._running = None
        if self._urgent_running is task:
            self._urgent_running = None
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: a batch ended in an error", self.name, exc_info=task.exception())
        self._wakeup.set()

    async def _execute(self, batch: list[Pending], trigger: str, now: float, executor: Executor) -> None:
        loop = asyncio.get_running_loop()
        oldest_wait = now - min(p.arrived for p in batch)
        self._observe_waits(batch, now)
        started = time.time()
        try:
            outputs = await loop.run_in_executor(executor, self._checked_predict, [p.payload for p in batch])
        except Exception as exc:
            log.warning("%s: batch of %d failed (%s); isolating items", self.name, len(batch), exc)
            await self._run_alone(batch, trigger, oldest_wait, executor)
            return
        info = BatchInfo(len(batch), trigger, oldest_wait, started, time.time())
        self._observe(info)
        for item, output in zip(batch, outputs):
            _resolve(item, result=(output, info))

    async def _run_alone(self, batch: list[Pending], trigger: str, oldest_wait: float, executor: Executor) -> None:
        """Retry each item once on its own: one poison input fails only itself."""
        loop = asyncio.get_running_loop()
        if self._metrics and len(batch) > 1:
            self._metrics.retries.labels("inference", "batch_isolation").inc(len(batch))
        for item in batch:
            started = time.time()
            try:
                (output,) = await loop.run_in_executor(executor, self._checked_predict, [item.payload])
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

    def _observe_waits(self, batch: list[Pending], now: float) -> None:
        if self._metrics is None:
            return
        for item in batch:
            self._metrics.priority_wait.labels("inference", str(item.priority)).observe(now - item.arrived)

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
