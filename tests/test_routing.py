"""The router onto `ready` under a fake clock: lowest expected wait from stale signals, sticky
choices, hysteresis, the share cap, and partitions whose owner is not ready, is stale or lacks
the model are never chosen."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpipe.schemas.events import WorkerState
from mmpipe.schemas.settings import SchedulingSettings
from mmpipe.streams.routing import Router
from mmpipe.streams.worker_state import ServiceClock

MODEL = "resnet18"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def state(worker: str, partitions: list[int], item_s: float | None, at: float, ready: bool = True,
          models: tuple[str, ...] = (MODEL,), backlog: int | None = None) -> WorkerState:
    return WorkerState(worker=worker, partitions=partitions, ready=ready, models=list(models), item_s=item_s,
                       waits_s={}, at=at, backlog=backlog)


def router(clock: Clock, **overrides: object) -> Router:
    base = dict(route_sticky_s=1.0, route_hysteresis=0.3, route_min_gain_s=0.05, route_max_share=1.0,
                route_share_window=64, worker_state_stale_s=3.0)
    return Router(SchedulingSettings(**{**base, **overrides}), clock)


def two_workers(r: Router, clock: Clock, fast_s: float = 0.01, slow_s: float = 0.01) -> None:
    r.observe_worker(state("fast", [0, 2], fast_s, clock.now))
    r.observe_worker(state("slow", [1, 3], slow_s, clock.now))


def test_expected_wait_is_the_owners_backlog_times_its_service_time():
    clock = Clock()
    r = router(clock)
    two_workers(r, clock, fast_s=0.01, slow_s=0.1)
    r.observe_lag({0: 10, 1: 2, 2: 5, 3: 0})
    waits = r.expected_waits(MODEL)
    assert waits[0] == waits[2] == pytest.approx((10 + 5 + 1) * 0.01)  # one batcher drains both
    assert waits[1] == waits[3] == pytest.approx((2 + 0 + 1) * 0.1)
    assert r.choose(MODEL) in (0, 2)  # 0.16 s beats 0.3 s although its lag is longer


def test_what_it_sent_since_the_read_out_counts_until_the_next_read_out():
    clock = Clock()
    r = router(clock, route_sticky_s=0.0, route_hysteresis=0.0, route_min_gain_s=0.0)
    two_workers(r, clock)
    r.observe_lag({0: 0, 1: 0, 2: 0, 3: 0})
    picks = [r.choose(MODEL) for _ in range(10)]
    owners = Counter("fast" if p in (0, 2) else "slow" for p in picks)
    assert owners == {"fast": 5, "slow": 5}  # balanced by its own sends, not by stale lag
    r.observe_lag({0: 0, 1: 0, 2: 0, 3: 0})
    assert sum(r.sent.values()) == 0


def test_a_reported_backlog_counts_sends_since_the_report_and_drains_at_the_measured_rate():
    clock = Clock()
    r = router(clock, route_sticky_s=0.0, route_hysteresis=0.0, route_min_gain_s=0.0)
    r.observe_worker(state("w", [0, 1], 0.1, clock.now, backlog=10))
    r.observe_lag({0: 500, 1: 500})  # committed lag, finished work included: not used
    assert r.expected_waits(MODEL)[0] == pytest.approx((10 + 1) * 0.1)
    for _ in range(4):
        r.choose(MODEL)
    assert r.expected_waits(MODEL)[0] == pytest.approx((10 + 4 + 1) * 0.1)
    clock.now += 0.5  # five items' time: drained
    assert r.expected_waits(MODEL)[1] == pytest.approx((10 + 4 - 5 + 1) * 0.1)
    clock.now += 60  # long drained, but the report is stale by now ...
    r.observe_worker(state("w", [0, 1], 0.1, clock.now, backlog=0))  # ... so a fresh one
    r.choose(MODEL)
    clock.now += 0.05
    # Never below what was sent within the last item time: that item cannot have run yet.
    assert r.expected_waits(MODEL)[0] == pytest.approx((1 + 1) * 0.1)


def test_a_fast_worker_whose_lag_still_counts_finished_work_is_preferred_by_its_reported_backlog():
    """The committed lag of a fast worker counts what it finished since its last commit; its
    own count says its queue is short, and the router believes the count."""
    clock = Clock()
    r = router(clock, route_sticky_s=0.0)
    r.observe_worker(state("fast", [0, 2], 0.05, clock.now, backlog=1))
    r.observe_worker(state("slow", [1, 3], 0.2, clock.now, backlog=0))
    r.observe_lag({0: 6, 2: 5, 1: 0, 3: 0})  # fast committed 0.5 s ago at 20 items/s
    assert {r.choose(MODEL) for _ in range(2)} <= {0, 2}


def test_a_choice_is_sticky_for_its_window_and_then_switches():
    clock = Clock()
    r = router(clock, route_sticky_s=1.0, route_min_gain_s=0.0, route_escape_ratio=3.0)
    two_workers(r, clock)
    r.observe_lag({0: 0, 1: 5, 2: 0, 3: 5})
    first = r.choose(MODEL)
    assert first in (0, 2)
    r.observe_lag({0: 1, 1: 0, 2: 1, 3: 0})  # now worse (0.03 s vs 0.01 s), within the window
    clock.now += 0.5
    assert r.choose(MODEL) == first and r.flips == 0
    r.observe_lag({0: 1, 1: 0, 2: 1, 3: 0})
    clock.now += 0.6
    assert r.choose(MODEL) in (1, 3) and (r.flips, r.escapes) == (1, 0)


def test_a_choice_far_worse_than_the_best_ends_its_window_early():
    clock = Clock()
    r = router(clock, route_sticky_s=10.0, route_escape_ratio=3.0)
    two_workers(r, clock)
    first = r.choose(MODEL)
    r.observe_lag({first: 20})  # a burst landed on it: 0.21 s against 0.01 s
    clock.now += 0.1
    second = r.choose(MODEL)
    assert (second in (0, 2)) != (first in (0, 2))  # the other worker's partition
    assert (r.flips, r.escapes) == (1, 1)


def test_an_unmeasured_worker_counts_as_fast_as_the_fastest_so_it_gets_tried():
    clock = Clock()
    r = router(clock)
    two_workers(r, clock, fast_s=None, slow_s=0.2)
    assert r.choose(MODEL) in (0, 2)


def test_hysteresis_keeps_a_choice_that_is_only_a_little_worse():
    clock = Clock()
    r = router(clock, route_sticky_s=0.0, route_hysteresis=0.3, route_min_gain_s=0.05)
    two_workers(r, clock)
    r.observe_lag({0: 0, 1: 1, 2: 0, 3: 1})
    first = r.choose(MODEL)
    r.observe_lag({0: 12, 1: 10, 2: 0, 3: 0})  # 0.13 s vs 0.11 s: 15% better, under 30%
    clock.now += 5
    r.observe_worker(state("fast", [0, 2], 0.01, clock.now))
    r.observe_worker(state("slow", [1, 3], 0.01, clock.now))
    assert r.choose(MODEL) == first and r.flips == 0
    r.observe_lag({0: 40, 1: 10, 2: 0, 3: 0})  # 0.41 s vs 0.11 s: clearly better
    assert r.choose(MODEL) in (1, 3) and r.flips == 1


def test_no_partition_takes_more_than_its_share_of_recent_decisions():
    clock = Clock()
    r = router(clock, route_max_share=0.5, route_share_window=20)
    r.observe_worker(state("only", [0, 1], 0.01, clock.now))
    r.observe_lag({0: 0, 1: 1000})  # partition 1 looks terrible by its lag, same owner though
    picks = [r.choose(MODEL) for _ in range(100)]
    window = Counter(picks[-20:])
    assert max(window.values()) <= 10
    assert set(picks) == {0, 1}


def test_partitions_whose_owner_is_not_ready_stale_or_without_the_model_are_avoided():
    clock = Clock()
    r = router(clock)
    r.observe_worker(state("busy", [0], 0.001, clock.now, ready=False))
    r.observe_worker(state("other-model", [1], 0.001, clock.now, models=("silero-vad",)))
    r.observe_worker(state("gone", [2], 0.001, clock.now - 10))
    r.observe_worker(state("fine", [3], 0.5, clock.now))
    r.observe_lag({0: 0, 1: 0, 2: 0, 3: 100})
    assert set(r.expected_waits(MODEL)) == {3}
    assert {r.choose(MODEL) for _ in range(20)} == {3}


def test_a_not_ready_choice_is_left_at_once_even_inside_the_sticky_window():
    clock = Clock()
    r = router(clock, route_sticky_s=60.0)
    two_workers(r, clock, fast_s=0.01, slow_s=1.0)
    first = r.choose(MODEL)
    assert first in (0, 2)
    clock.now += 0.1
    r.observe_worker(state("fast", [], None, clock.now, ready=False))  # revoked in a rebalance
    assert r.choose(MODEL) in (1, 3)


def test_with_no_eligible_partition_the_item_keeps_its_hash_partition():
    clock = Clock()
    r = router(clock)
    assert r.choose(MODEL) is None
    r.observe_worker(state("old", [0, 1], 0.01, clock.now - 60))
    assert r.choose(MODEL, fallback=7) == 7


def test_an_older_report_never_replaces_a_newer_one():
    clock = Clock()
    r = router(clock)
    r.observe_worker(state("w", [0], 0.01, clock.now))
    r.observe_worker(state("w", [0], 0.01, clock.now - 1, ready=False))
    assert r.expected_waits(MODEL)


def test_service_clock_measures_per_item_time_and_waits_per_partition():
    clock = ServiceClock()
    clock.item_done(0.8, 8)
    assert clock.item_s == pytest.approx(0.1)
    for _ in range(30):
        clock.item_done(0.4, 8)
    assert clock.item_s == pytest.approx(0.05, rel=0.01)
    clock.waited(3, 0.2)
    assert clock.waits_s == {3: pytest.approx(0.2)}


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(st.tuples(st.floats(0.0, 0.3), st.dictionaries(st.integers(0, 3), st.integers(0, 200))),
                   min_size=1, max_size=80),
    sticky=st.floats(0.1, 2.0),
)
def test_flips_are_bounded_by_the_sticky_window_and_choices_are_eligible(steps, sticky):
    """Whatever the lag does, the preferred partition changes at most once per sticky window,
    and every choice is a partition whose owner is ready."""
    clock = Clock()
    r = router(clock, route_sticky_s=sticky, route_max_share=0.75, route_share_window=16)
    start = clock.now
    for dt, lag in steps:
        clock.now += dt
        r.observe_worker(state("a", [0, 2], 0.01, clock.now))
        r.observe_worker(state("b", [1], 0.05, clock.now))
        r.observe_worker(state("c", [3], 0.01, clock.now, ready=False))
        r.observe_lag(lag)
        assert r.choose(MODEL) in (0, 1, 2)
    assert r.flips - r.escapes <= (clock.now - start) / sticky + 1


def test_workers_silent_for_twice_the_staleness_bound_are_forgotten():
    """Worker names are host-pid: every restart adds one, and the compacted topic keeps all of
    them. The router keeps only those that could still matter to a decision."""
    clock = Clock()
    r = router(clock)
    for pid in range(100):  # a crash loop: each incarnation reports once, then dies
        r.observe_worker(state(f"host-{pid}", [0, 1], 0.01, clock.now))
        clock.now += 1.0
    assert set(r.workers) == {f"host-{pid}" for pid in range(93, 100)}  # silent for at most 2 x 3 s
    assert r.choose(MODEL) in (0, 1)  # the fresh ones still own their partitions
    r.observe_worker(state("late-report", [2], 0.01, clock.now - 60))  # a report replayed from the topic
    assert "late-report" not in r.workers


def test_a_stopped_workers_tombstone_takes_its_partitions_out_at_once():
    """A worker that stops cleanly leaves a tombstone (streams/worker_state.py): its partitions
    go back to the hash partition at once, not after the staleness bound."""
    clock = Clock()
    r = router(clock)
    r.observe_worker(state("fast", [0], 0.01, clock.now))
    r.observe_worker(state("slow", [1], 0.5, clock.now))
    assert set(r.expected_waits(MODEL)) == {0, 1}
    r.forget_worker("fast")
    assert set(r.expected_waits(MODEL)) == {1}
    r.forget_worker("never-seen")  # a tombstone replayed from the compacted topic
    assert set(r.workers) == {"slow"}
