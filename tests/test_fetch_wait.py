"""The idle back-off of the fetch wait and the lag read-out schedule, under a fake clock, and
the longer wait after a fetch the broker cut short."""

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition

from mmpipe.streams.fetch_wait import AdaptiveFetchWait, LagReadSchedule, ShortFetchWait
from mmpipe.streams.transport import adapt_fetch_wait, fetch_cut_short, records_known
from mmpipe.streams.wakeup import FetchGate


def empty_fetches(policy: AdaptiveFetchWait, start: float, until: float) -> float:
    """Empty fetches back to back, each lasting its own wait; returns the clock at the end."""
    now = start
    while now < until:
        now += policy.wait_ms / 1000
        policy.after_fetch(False, now)
    return now


def test_wait_stays_short_while_records_flow_and_within_the_grace_period():
    policy = AdaptiveFetchWait(base_ms=20, idle_max_ms=500, idle_after_s=1.0)
    assert policy.after_fetch(True, 0.0) == 20
    empty_fetches(policy, 0.0, 0.9)
    assert policy.wait_ms == 20 and not policy.idle


def test_wait_doubles_after_the_grace_period_up_to_the_cap_and_snaps_back():
    policy = AdaptiveFetchWait(base_ms=20, idle_max_ms=500, idle_after_s=1.0)
    policy.after_fetch(True, 0.0)
    now = empty_fetches(policy, 0.0, 1.02)
    assert policy.wait_ms == 40
    waits = [policy.after_fetch(False, now + i) for i in range(1, 6)]
    assert waits == [80, 160, 320, 500, 500]
    assert policy.idle
    assert policy.after_fetch(True, now + 7) == 20
    assert not policy.idle


def test_no_backoff_when_disabled():
    policy = AdaptiveFetchWait(base_ms=20, idle_max_ms=20, idle_after_s=0.0)
    empty_fetches(policy, 0.0, 30.0)
    assert policy.wait_ms == 20


def test_lag_reads_pause_only_after_a_read_with_nothing_to_do_here_and_resume_on_records():
    fetches = AdaptiveFetchWait(base_ms=20, idle_max_ms=500, idle_after_s=1.0)
    schedule = LagReadSchedule(idle_interval_s=10.0)
    assert schedule.due(fetches, 0.0)
    schedule.read(own_lag=3, holding=False, now=0.0)
    assert schedule.due(fetches, 0.5)  # work of its own: keep reading
    schedule.read(own_lag=0, holding=True, now=0.6)
    assert schedule.due(fetches, 1.0)  # a partition held for the next stage: only a read frees it
    schedule.read(own_lag=0, holding=False, now=1.0)
    assert not schedule.due(fetches, 1.5)  # whatever the next stage's lag: nothing here to admit
    assert not schedule.due(fetches, 10.9)
    assert schedule.due(fetches, 11.0)  # the periodic read while idle
    schedule.read(own_lag=0, holding=False, now=11.0)
    fetches.after_fetch(True, 11.2)
    assert schedule.due(fetches, 11.5)  # records arrived since the quiet read


# A fetch cut short (the broker reports records past the offset and returned none) ---------------
def test_a_fetch_cut_short_doubles_the_next_wait_up_to_a_cap_and_a_whole_one_resets_it():
    short = ShortFetchWait(max_ms=100)
    assert short.after_fetch(False, 20) == 20
    assert [short.after_fetch(True, 20) for _ in range(4)] == [40, 80, 100, 100]
    assert short.streak == 4
    assert short.warning_due(now=100.0) and not short.warning_due(now=159.0)  # once a minute
    assert short.warning_due(now=160.0)
    assert short.after_fetch(False, 20) == 20 and short.wait_ms == short.streak == 0
    assert short.after_fetch(True, 500) == 500  # never shorter than what the other policies chose
    assert not short.warning_due(now=1000.0)  # one alone: Apache Kafka's size limit, say


class PartitionState(SimpleNamespace):
    has_valid_position = True


class Assignment:
    def __init__(self, **states: PartitionState) -> None:
        self.states = {TopicPartition("t", int(p[1:])): s for p, s in states.items()}

    def state_value(self, tp: TopicPartition) -> PartitionState | None:
        return self.states.get(tp)


def request(*offsets: tuple[int, int]) -> SimpleNamespace:
    return SimpleNamespace(topics=[("t", [(partition, offset, 1 << 20) for partition, offset in offsets])])


def test_cut_short_means_records_reported_past_the_offset_and_none_returned():
    fetcher = SimpleNamespace(_records={})
    caught_up = Assignment(p0=PartitionState(position=5, highwater=5))
    assert not fetch_cut_short(fetcher, caught_up, request((0, 5)))
    behind = Assignment(p0=PartitionState(position=5, highwater=5), p1=PartitionState(position=7, highwater=9))
    assert fetch_cut_short(fetcher, behind, request((0, 5), (1, 7)))
    fetcher._records[TopicPartition("t", 1)] = object()  # records for it came back: not cut short
    assert not fetch_cut_short(fetcher, behind, request((0, 5), (1, 7)))
    moved = Assignment(p1=PartitionState(position=8, highwater=9))  # seeked meanwhile: not this fetch's
    assert not fetch_cut_short(SimpleNamespace(_records={}), moved, request((1, 7)))
    assert not fetch_cut_short(SimpleNamespace(_records={}), Assignment(), request((1, 7)))  # revoked


def test_the_transport_fetches_again_at_once_with_a_longer_wait_after_a_fetch_cut_short():
    class Fetcher:
        def __init__(self) -> None:
            self._fetch_max_wait_ms = 20
            self._records: dict = {}
            self.state = PartitionState(position=3, highwater=3)
            self.fetched = 0

        async def _proc_fetch_request(self, assignment, node_id, req) -> bool:
            self.fetched += 1
            if self.fetched == 1:
                self.state.highwater = 4  # a record the broker did not list in time
                return False
            self._records[TopicPartition("t", 0)] = object()
            return True

    async def run() -> None:
        fetcher = Fetcher()
        gate = FetchGate(fallback_ms=60_000)
        adapt_fetch_wait(fetcher, AdaptiveFetchWait(20, 500, 1.0), gate)
        assignment = Assignment(p0=fetcher.state)
        assert not await fetcher._proc_fetch_request(assignment, 0, request((0, 3)))
        assert fetcher._fetch_max_wait_ms == 40 and gate.next_wait_ms == 0  # no wake-up to wait for
        assert await asyncio.wait_for(fetcher._proc_fetch_request(assignment, 0, request((0, 3))), 1)
        assert fetcher._fetch_max_wait_ms == gate.hold_ms  # whole again: back to the usual hold

    asyncio.run(run())


def test_records_known_means_a_high_watermark_past_the_requested_offset():
    assert not records_known(Assignment(p0=PartitionState(position=5, highwater=5)), request((0, 5)))
    assert not records_known(Assignment(p0=PartitionState(position=5, highwater=None)), request((0, 5)))
    assert records_known(Assignment(p0=PartitionState(position=5, highwater=5),
                                    p1=PartitionState(position=7, highwater=9)), request((0, 5), (1, 7)))
    assert not records_known(Assignment(), request((1, 7)))  # revoked meanwhile


def test_after_records_the_transport_waits_for_a_wake_up_unless_the_broker_reported_more():
    class Fetcher:
        def __init__(self) -> None:
            self._fetch_max_wait_ms = 20
            self._records: dict = {}
            self.fetched = 0

        async def _proc_fetch_request(self, assignment, node_id, req) -> bool:
            self.fetched += 1
            self._records[TopicPartition("t", 0)] = object()  # records came back
            return True

    async def run() -> None:
        fetcher = Fetcher()
        gate = FetchGate(fallback_ms=60_000)
        adapt_fetch_wait(fetcher, AdaptiveFetchWait(20, 500, 1.0), gate)
        state = PartitionState(position=3, highwater=4)
        assignment = Assignment(p0=state)
        assert await fetcher._proc_fetch_request(assignment, 0, request((0, 3)))  # the first goes at once
        # The answer reported a record past offset 3 that it did not carry: fetch it at once.
        assert await asyncio.wait_for(fetcher._proc_fetch_request(assignment, 0, request((0, 3))), 1)
        # Caught up (offset 4 = high watermark 4): the next fetch waits for a wake-up ...
        waiting = asyncio.ensure_future(fetcher._proc_fetch_request(assignment, 0, request((0, 4))))
        await asyncio.sleep(0.05)
        assert not waiting.done() and fetcher.fetched == 2
        gate.wake(0.0)  # ... which a producer's datagram ends
        assert await asyncio.wait_for(waiting, 1) and fetcher.fetched == 3

    asyncio.run(run())
