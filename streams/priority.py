"""The queue policy of every stage (Triton's priority_levels and timeout action, made of pure
functions and two small queues), shared by decode, preprocess and the batcher.

Priority with aging. An item of priority p (0 = highest) that arrived at time t is served in
order of its rank t + p * aging_s: a virtual arrival time that puts lower priorities behind by
aging_s per level. Among items queued together the lowest rank goes first, so

  * high-priority work overtakes queued lower-priority work, and
  * the starvation bound: an item of priority p is overtaken only by work that arrived less
    than (p - q) * aging_s after it (q the other item's priority), never by anything later.
    Its wait is at most its FIFO wait plus the work that arrives in (p - q) * aging_s after it.

The rank is fixed at arrival, so a heap orders the queue; nothing is re-sorted as time passes.

Timeout action. When an item's deadline has passed before it starts a step, its on_timeout
says what happens: "reject" answers it as expired without running it (the default, today's
behaviour); "run_late" runs it all the same and its result says late.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from mmpipe.schemas.events import NORMAL_PRIORITY

T = TypeVar("T")
Verdict = Literal["run", "late", "expire"]


def rank(priority: int, arrived: float, aging_s: float) -> float:
    """Serving order of an item: its arrival, pushed back aging_s per priority level below 0."""
    return arrived + priority * aging_s


def deadline_verdict(now: float, deadline: float, on_timeout: str) -> Verdict:
    """What a step does with an item whose deadline may have passed: run it, run it marked
    late (run_late), or answer it expired without running it (reject)."""
    if now <= deadline:
        return "run"
    return "late" if on_timeout == "run_late" else "expire"


def is_late(started: float, deadline: float) -> bool:
    """A result is late when its work started after the deadline (the deadline never moves and
    the clock only advances, so an item late at any step is late at the last one)."""
    return started > deadline


class PriorityExecutor:
    """A thread pool whose queue is ordered by rank instead of FIFO: the decode and preprocess
    stages hold up to max_inflight items, and those waiting for a thread are served by priority."""

    def __init__(self, workers: int, name: str, aging_s: float, clock: Callable[[], float]) -> None:
        self._queue: queue.PriorityQueue[tuple[float, int, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._aging_s = aging_s
        self._clock = clock
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    async def run(self, priority: int, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on a worker thread when no lower-ranked job waits; await its result."""
        future: Future[T] = Future()
        self._queue.put((rank(priority, self._clock(), self._aging_s), next(self._seq), (future, fn, args)))
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self._stopped = True
        for _ in self._threads:
            self._queue.put((float("inf"), next(self._seq), None))

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            future, fn, args = job
            if self._stopped or not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # delivered to the awaiting coroutine
                future.set_exception(exc)


class PriorityWaiters:
    """Head-of-line order among coroutines waiting for the same room (decode's admission wait):
    only the lowest-ranked waiter may take room as it opens, so a high-priority job that starts
    waiting after low-priority ones still goes first. Ranks age like everywhere else."""

    def __init__(self, aging_s: float, clock: Callable[[], float]) -> None:
        self._heap: list[tuple[float, int]] = []
        self._gone: set[int] = set()
        self._seq = itertools.count()
        self._aging_s = aging_s
        self._clock = clock

    def enter(self, priority: int = NORMAL_PRIORITY) -> int:
        token = next(self._seq)
        heapq.heappush(self._heap, (rank(priority, self._clock(), self._aging_s), token))
        return token

    def is_first(self, token: int) -> bool:
        self._drop_gone()
        return bool(self._heap) and self._heap[0][1] == token

    def leave(self, token: int) -> None:
        self._gone.add(token)
        self._drop_gone()

    def __len__(self) -> int:
        return len(self._heap) - len(self._gone)

    def _drop_gone(self) -> None:
        while self._heap and self._heap[0][1] in self._gone:
            self._gone.discard(heapq.heappop(self._heap)[1])
