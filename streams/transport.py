"""faust's aiokafka transport with nine changes, registered as the `mmkafka://` broker scheme.

1. A configurable fetch max wait. faust hard-codes fetch_max_wait_ms=1500. The embedded broker
   holds a fetch for the whole wait even when records are available, which put up to 750 ms on
   every hop at light load (measured: a 20-message trickle saw 25-750 ms per hop at 1500 ms,
   2-6 ms at 100 ms and below).
2. Pausing never drops records. faust's getmany skips records of a partition that left the
   active set while the fetched batch was being delivered; the fetch position has already
   moved past them, so they would never arrive (found by the backpressure test: a partition
   paused mid-batch stalled for good). Records of partitions marked "buffered" are still
   delivered, so a pause marks them so; and faust's buffer-drain callback must not undo a pause.
3. Resuming is prompt. With every partition paused faust's fetch loop sleeps a whole second
   before looking again, so each pause of a busy one-partition stage cost >= 1 s of idle model
   (found by the overload test); it now looks again after IDLE_POLL_S.
4. The commit never passes unfinished work. faust's head check (`min(acked) - committed > 1`)
   is off by one: with the committed offset c unacked and c+1 acked it commits past c. Stages
   finish messages out of order (a batch answers its items together), so a message still in
   the batcher could be committed, and a SIGKILL then lost it (found by the fault runs: one
   image job per partition lost at an inference kill). See `first_committable_run`.
5. An idle consumer stops polling 50 times a second: the fetch wait backs off while nothing
   arrives and snaps back on the first records (see streams/fetch_wait.py); faust's wait for
   records follows it, so neither thread wakes more often than the broker answers.
6. With wake-ups (streams/wakeup.py), a consumer whose producers are co-located stages asks for
   fetches answered at once and waits for a producer's wake-up (or the fallback) before the
   next, unless the broker's last answer already reported records past its offsets
   (`records_known`): it fetches when records are there, not 50 times a second, nor once more
   after each answer to find nothing.
7. One event loop per process (unless `consumer_in_thread`). faust runs the aiokafka consumer
   on a thread with a loop of its own and hands every fetch, commit and seek across with a
   method queue and a future on each side; each hand-off wakes the other loop through its
   self-pipe, and two keep-alive timers wake both loops every second. A stage's own work is
   on the process's main loop, its blocking work on threads and processes of its own, so the
   consumer can share that loop: InlineConsumerThread is faust's consumer thread without the
   thread (the profile of every stage: benchmarks/results/profile-stages-2026-12-06.txt).
8. An idle consumer's loop wakes less (counted by callback on an idle preprocess stage: about
   100 loop turns a second): aiokafka's fetch routine re-plans every 0.2 s even while its fetch
   is pending and every event it waits for wakes it anyway (FETCHER_TICK_S), and faust's
   livelock check yields to the loop once per assigned partition every 1.25 s.
9. A fetch the broker cut short is retried at once with a longer wait. The embedded broker lists
   every stored batch of a partition to answer a fetch and stops when the fetch's max wait runs
   out; past 30-45 thousand records in a partition every 20 ms fetch came back empty while the
   broker reported records past it, and the stage stalled for good
   (benchmarks/broker_partition_growth.py). See `fetch_cut_short` and ShortFetchWait.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import functools
import logging
import time
from typing import Any

from aiokafka import TopicPartition
from faust.transport.consumer import ensure_TPset
from faust.types import TP
from faust.utils.functional import consecutive_numbers
from mode.utils.futures import maybe_async

from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka

from pathlib import Path

from mmpipe.streams.fetch_wait import AdaptiveFetchWait, ShortFetchWait
from mmpipe.streams.wakeup import FetchGate, WakeListener

log = logging.getLogger(__name__)

SCHEME = "mmkafka"
IDLE_POLL_S = 0.01
# One faust app (one stage consumer) per process: register() sets its fetch-wait policy.
FETCH_WAIT = AdaptiveFetchWait(base_ms=20, idle_max_ms=20, idle_after_s=1.0)
# Where this process's consumer listens for wake-ups, and how long it waits for one after an
# empty fetch (register()); None: no wake-ups, plain (adaptive) polling.
WAKE_FOLDER: Path | None = None
WAKE_FALLBACK_MS = 200
WAKE: WakeListener | None = None  # the running listener, on the consumer's loop
CONSUMER_IN_THREAD = False  # faust's own threaded consumer (True) or InlineConsumerThread
# How often aiokafka's fetch routine looks again with nothing to wake it (aiokafka: 0.2 s). A
# fetch's answer, records taken, a pause, a resume and an assignment change each wake it.
FETCHER_TICK_S = 1.0


class ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_consumer(self, loop: Any) -> Any:
        consumer = super()._create_consumer(loop)
        # Read by aiokafka when it builds its fetcher in start(), which comes after this.
        # With wake-ups the broker answers fetches at once and the gate does the waiting
        # (FetchGate.fetch_max_wait_ms).
        consumer._fetch_max_wait_ms = 1 if WAKE_FOLDER is not None else FETCH_WAIT.wait_ms  # noqa: SLF001
        return consumer

    async def on_start(self) -> None:
        global WAKE
        await super().on_start()
        gate = None
        if WAKE_FOLDER is not None:
            gate = FetchGate(WAKE_FALLBACK_MS, hold_ms=FETCH_WAIT.base_ms,
                             known_end=functools.partial(known_end, self._consumer._subscription))  # noqa: SLF001
            WAKE = WakeListener(WAKE_FOLDER, gate)
            WAKE.start()
        adapt_fetch_wait(self._consumer._fetcher, FETCH_WAIT, gate)  # noqa: SLF001

    async def on_thread_stop(self) -> None:
        global WAKE
        if WAKE is not None:
            WAKE.close()
            WAKE = None
        await super().on_thread_stop()


class InlineConsumerThread(ConsumerThread):
    """faust's consumer thread run on the loop that owns it: the same service (the aiokafka
    consumer, its rebalance listener, faust's fetch and commit bookkeeping) with each
    cross-thread call made a plain await. mode's ServiceThread starts a thread that runs the
    service's start and, at stop, its shutdown; here start and stop run them in place."""

    def __init__(self, consumer: Any, *, loop: Any, beacon: Any) -> None:
        super().__init__(consumer, loop=loop, thread_loop=loop, beacon=beacon)

    async def start(self) -> None:
        self._thread_started.set()
        await self._default_start()
        await self.on_thread_started()

    async def stop(self) -> None:
        if self._started.is_set() and not self._stopped.is_set():
            self._stopped.set()
            await self.on_stop()
            await self._shutdown_thread()  # the consumer's own stop, children, futures
            await self.on_shutdown()

    async def call_thread(self, fun: Any, *args: Any, **kwargs: Any) -> Any:
        return await maybe_async(fun(*args, **kwargs))

    async def cast_thread(self, fun: Any, *args: Any, **kwargs: Any) -> None:
        self.add_future(maybe_async(fun(*args, **kwargs)))

    async def on_thread_started(self) -> None:
        pass  # the method queue is for calls from another thread: none come

    @ConsumerThread.task
    async def _thread_keepalive(self) -> None:
        pass  # mode's check that the thread's loop still turns: there is no second loop here


def adapt_fetch_wait(fetcher: Any, policy: AdaptiveFetchWait, gate: FetchGate | None = None) -> None:
    """Feed every fetch's outcome to `policy` and send the next fetch with its wait; with a
    `gate`, every fetch is answered at once and waits, before it goes, for a wake-up or the
    wait the previous fetch's outcome set. aiokafka builds each fetch request from
    `_fetch_max_wait_ms`, looks `_proc_fetch_request` up on the instance every round, sends a
    node no new fetch while one is in flight, and hands records on only when the call returns:
    so the wait goes before the fetch, never after records."""
    process = fetcher._proc_fetch_request  # noqa: SLF001
    fetcher._fetcher_timeout = FETCHER_TICK_S  # noqa: SLF001

    short = ShortFetchWait()

    async def proc_fetch_request(assignment: Any, node_id: int, request: Any) -> bool:
        if gate is not None:
            if records_known(assignment, request):
                gate.fetch_at_once()  # the last answer reported more than this fetch's offsets
            if not await gate.wait():
                return False  # cancelled: the fetcher is closing or the assignment changed
        got_records = await process(assignment, node_id, request)
        now = time.monotonic()
        poll_ms = policy.after_fetch(got_records, now)
        if gate is None:
            wait_ms = poll_ms
        else:
            gate.after_fetch(got_records, poll_ms, now)
            wait_ms = gate.fetch_max_wait_ms(poll_ms)
        cut_short = fetch_cut_short(fetcher, assignment, request)
        fetcher._fetch_max_wait_ms = short.after_fetch(cut_short, wait_ms)  # noqa: SLF001
        if cut_short:
            if short.warning_due(now):
                log.warning(
                    "the broker returned no records where it reports some (fetches cut short); the next"
                    " fetch may wait %d ms. On the embedded broker this means partitions too large for its"
                    " storage to list in time: see the README's known limits", short.wait_ms)
            if gate is not None:
                gate.fetch_at_once()  # the records are there: no wake-up will announce them again
        return got_records

    fetcher._proc_fetch_request = proc_fetch_request  # noqa: SLF001


def known_end(subscriptions: Any, topic: str, partition: int) -> int | None:
    """A partition's high watermark in the broker's last answer to this consumer (None: not
    assigned here, or not fetched yet)."""
    subscription = subscriptions.subscription
    if subscription is None or subscription.assignment is None:
        return None
    state = subscription.assignment.state_value(TopicPartition(topic, partition))
    return None if state is None else state.highwater


def _behind(assignment: Any, request: Any) -> Iterator[tuple[TopicPartition, Any, int]]:
    """(partition, its state, the request's offset) for each partition of a fetch request whose
    high watermark in the broker's last answer lies past that offset."""
    for topic, partitions in request.topics:
        for partition, offset, _max_bytes in partitions:
            tp = TopicPartition(topic, partition)
            state = assignment.state_value(tp)
            if state is not None and state.highwater is not None and state.highwater > offset:
                yield tp, state, offset


def records_known(assignment: Any, request: Any) -> bool:
    """Whether the broker's last answer reported records at or past a partition's offset in this
    request (its high watermark is beyond it): a fetch size limit left them, or more came while
    the last ones were handled. A partition whose consumer caught up has nothing known: records
    after that are announced by a wake-up."""
    return any(_behind(assignment, request))


def fetch_cut_short(fetcher: Any, assignment: Any, request: Any) -> bool:
    """Whether the broker reported records past a fetched partition's offset (its high
    watermark) and returned none for it. Read right after the fetch, before anything is
    consumed: a partition that got records has them buffered in the fetcher."""
    buffered = fetcher._records  # noqa: SLF001
    return any(tp not in buffered and state.has_valid_position and state.position == offset
               for tp, state, offset in _behind(assignment, request))


def first_committable_run(acked: list[int], committed: int | None, lowest_unacked: int | None) -> list[int]:
    """The offsets (ascending, consecutive) that may be committed now, given the sorted acked
    offsets, the committed offset (the next offset to consume; None before the first commit)
    and the lowest offset delivered but not yet acked. Empty when the next message to commit
    is not done yet."""
    if not acked:
        return []
    head = acked[0]
    if committed is not None and head != committed:
        return []  # the message at the committed offset is still being worked on
    if committed is None and lowest_unacked is not None and lowest_unacked < head:
        return []
    return list(next(consecutive_numbers(acked)))


class Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> ConsumerThread:
        kind = ConsumerThread if CONSUMER_IN_THREAD else InlineConsumerThread
        return kind(self, loop=self.loop, beacon=self.beacon)

    def pause_partitions(self, tps: Iterable[TP]) -> None:
        tpset = ensure_TPset(tps)
        super().pause_partitions(tpset)
        self._buffered_partitions.update(tpset)  # records already fetched are still delivered

    def resume_partitions(self, tps: Iterable[TP]) -> None:
        tpset = ensure_TPset(tps)
        super().resume_partitions(tpset)
        self._buffered_partitions.difference_update(tpset)
        if WAKE is not None:
            WAKE.poke()  # records may be waiting there: fetch now, not after the gate's wait

    async def _getmany(self, active_partitions: Any, timeout: float) -> Any:
        # faust waits up to 1 s for records of the partitions that were active when the wait
        # began; a partition resumed meanwhile is only looked at after that wait.
        return await super()._getmany(active_partitions, min(timeout, FETCH_WAIT.wait_ms / 1000 + IDLE_POLL_S))

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        if not self.flow_active:
            await self.wait(self.can_resume_flow)
        try:
            self.not_waiting_next_records.set()
            active_partitions = None if self.app.client_only else self._get_active_partitions()
            if self.app.client_only or active_partitions:
                records = await self._getmany(active_partitions=active_partitions, timeout=timeout)
                return records, active_partitions
            await self.sleep(IDLE_POLL_S)  # everything paused: look again soon, not in 1 s
            return {}, active_partitions
        finally:
            self.not_waiting_next_records.set()

    async def verify_all_partitions_active(self) -> None:
        # faust's yields to the loop before each partition; the check itself is a few lookups.
        now = time.monotonic()
        for tp in self.assignment():
            if self.should_stop:
                return
            self.verify_event_path(now, tp)

    def _new_offset(self, tp: TP) -> int | None:
        acked = self._acked[tp]
        if not acked:
            return None
        self._merge_gaps(tp, acked)
        acked.sort()
        committed = self._committed_offset[tp]
        if committed is not None and acked[0] < committed:
            stale = [o for o in acked if o < committed]  # re-deliveries of committed work
            del acked[: len(stale)]
            self._acked_index[tp].difference_update(stale)
        run = first_committable_run(acked, committed, self._lowest_unacked(tp))
        if not run:
            return None
        del acked[: len(run)]
        self._acked_index[tp].difference_update(run)
        return run[-1] + 1

    def _merge_gaps(self, tp: TP, acked: list[int]) -> None:
        """Offsets the log does not have (faust's gap records) count as done, as in faust."""
        gap = self._gap[tp]
        if not gap:
            return
        max_offset = max(acked)
        spans = sorted(gap.overlap(0, max_offset), key=lambda span: span.begin)
        if spans:
            filled = [o for span in spans for o in range(span.begin, span.end)]
            acked.extend(filled)
            gap.chop(0, max(filled[-1], max_offset + 1))

    def _lowest_unacked(self, tp: TP) -> int | None:
        pending = [m.offset for m in list(self._unacked_messages) if m.tp == tp and not m.acked]
        return min(pending, default=None)

    async def _add_gap(self, tp: TP, offset_from: int, offset_to: int) -> None:
        # faust treats offsets it never saw as done; on a log without holes that means records
        # were skipped, which would be lost from this group: make it visible.
        log.warning("consumer skipped offsets %d-%d of %s/%d (treated as a gap)", offset_from, offset_to, tp.topic, tp.partition)
        await super()._add_gap(tp, offset_from, offset_to)

    def on_buffer_drop(self, tp: TP) -> None:
        if tp in self._paused_partitions:
            return  # paused by backpressure: only resume_partitions may re-activate it
        super().on_buffer_drop(tp)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer


def register(fetch_max_wait_ms: int, idle_max_wait_ms: int | None = None, idle_after_s: float = 1.0,
             wake_folder: Path | None = None, wake_fallback_ms: int = 200, consumer_in_thread: bool = False) -> str:
    """Install the transport; the fetch wait backs off to `idle_max_wait_ms` (None: never);
    with a `wake_folder` the consumer fetches on wake-ups (streams/wakeup.py); the consumer
    runs on a thread of its own only with `consumer_in_thread`."""
    global FETCH_WAIT, WAKE_FOLDER, WAKE_FALLBACK_MS, CONSUMER_IN_THREAD
    FETCH_WAIT = AdaptiveFetchWait(fetch_max_wait_ms, idle_max_wait_ms or fetch_max_wait_ms, idle_after_s)
    WAKE_FOLDER, WAKE_FALLBACK_MS = wake_folder, wake_fallback_ms
    CONSUMER_IN_THREAD = consumer_in_thread
    TRANSPORTS.aliases[SCHEME] = f"{__name__}:Transport"
    return SCHEME
