"""The queue policy under a fake clock: the timeout action (reject / run_late) in the batcher
and the deadline verdict, priority levels in batching, the starvation bound of aging, the
priority-ordered thread pool and admission waiters."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpipe.schemas import MediaEvent, decode_event, decode_work_item, encode_event, encode_work_item
from mmpipe.schemas.codec import BadMessage, WorkItem
from mmpipe.schemas.events import ModelRef, Payload
from mmpipe.streams.batching import BatchPolicy, Pending
from mmpipe.streams.priority import PriorityExecutor, PriorityWaiters, deadline_verdict, is_late, rank


def item(name: str, t: float, priority: int = 1, key: object = "a", deadline: float = 1e9,
         on_timeout: str = "reject") -> Pending:
    return Pending(payload=name, key=key, arrived=t, deadline=deadline, priority=priority, on_timeout=on_timeout)


def names(batch) -> list[str]:
    return [p.payload for p in batch]


# Timeout action -------------------------------------------------------------------------------
def test_deadline_verdict_runs_in_time_and_applies_the_action_after():
    assert deadline_verdict(now=1.0, deadline=2.0, on_timeout="reject") == "run"
    assert deadline_verdict(now=1.0, deadline=2.0, on_timeout="run_late") == "run"
    assert deadline_verdict(now=3.0, deadline=2.0, on_timeout="reject") == "expire"
    assert deadline_verdict(now=3.0, deadline=2.0, on_timeout="run_late") == "late"
    assert is_late(started=3.0, deadline=2.0) and not is_late(started=2.0, deadline=2.0)


def test_batcher_expires_reject_items_and_keeps_run_late_items_to_run():
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.010)
    policy.add(item("rejects", 0.0, deadline=0.005))
    policy.add(item("runs-late", 0.0, deadline=0.005, on_timeout="run_late"))
    assert policy.wake_at() == pytest.approx(0.005)
    assert names(policy.pop_expired(now=0.006)) == ["rejects"]
    # a run_late item's passed deadline is no reason to wake: only its max wait is
    assert policy.wake_at() == pytest.approx(0.010)
    batch, trigger = policy.next_batch(now=0.010)
    assert names(batch) == ["runs-late"] and trigger == "max_wait"
    assert policy.size == 0


def test_schema_defaults_to_normal_priority_and_reject_and_round_trips_the_fields():
    event = MediaEvent(job_id="j1", modality="text", payload=Payload(text="x"), schema_version=1, created_at=1.0)
    assert (event.priority, event.on_timeout) == (1, "reject")
    assert b"priority" not in encode_event(event)  # defaults stay off the wire: older readers unaffected
    urgent = msgspec.structs.replace(event, priority=0, on_timeout="run_late")
    assert decode_event(encode_event(urgent)) == urgent
    work = WorkItem("j1", 0, 1, "text", "text", ModelRef("m", "1"), 1.0, 2.0, priority=2, on_timeout="run_late")
    back = decode_work_item(encode_work_item(work))
    assert (back.priority, back.on_timeout) == (2, "run_late")


@pytest.mark.parametrize("field, value", [("priority", 3), ("priority", -1), ("on_timeout", "retry")])
def test_out_of_range_scheduling_fields_are_bad_input(field, value):
    raw = encode_event(MediaEvent(job_id="j1", modality="text", payload=Payload(text="x"), schema_version=1,
                                  created_at=1.0))
    import orjson

    data = orjson.loads(raw) | {field: value}
    with pytest.raises(BadMessage) as err:
        decode_event(orjson.dumps(data))
    assert err.value.reason == "malformed_event" and field in err.value.detail


# Priority levels in the batcher --------------------------------------------------------------
def test_high_priority_items_form_the_batch_before_older_low_priority_ones():
    policy = BatchPolicy(max_batch_size=2, max_wait_s=0.010, aging_s=1.0)
    policy.add(item("low-1", 0.000, priority=2))
    policy.add(item("low-2", 0.001, priority=2))
    policy.add(item("high", 0.002, priority=0))
    batch, trigger = policy.next_batch(now=0.002)
    assert names(batch) == ["high", "low-1"] and trigger == "full"
    batch, _ = policy.next_batch(now=0.011)
    assert names(batch) == ["low-2"]


def test_the_due_bucket_with_the_highest_priority_item_goes_first():
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.010, aging_s=1.0)
    policy.add(item("low", 0.000, priority=2, key="A"))
    policy.add(item("high", 0.005, priority=0, key="B"))
    batch, _ = policy.next_batch(now=0.020)
    assert names(batch) == ["high"]


def test_max_wait_counts_from_the_oldest_item_whatever_its_priority():
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.010, aging_s=1.0)
    policy.add(item("low", 0.000, priority=2))
    policy.add(item("high", 0.008, priority=0))
    assert policy.next_batch(now=0.009) is None
    assert policy.wake_at() == pytest.approx(0.010)
    batch, trigger = policy.next_batch(now=0.010)
    assert names(batch) == ["high", "low"] and trigger == "max_wait"


def test_aging_lets_a_low_priority_item_overtake_high_priority_work_that_came_much_later():
    policy = BatchPolicy(max_batch_size=1, max_wait_s=0.0, aging_s=0.5)
    policy.add(item("low-old", 0.0, priority=2))  # rank 1.0
    policy.add(item("high-soon", 0.9, priority=0))  # rank 0.9: within the bound, overtakes
    policy.add(item("high-late", 1.1, priority=0))  # rank 1.1: beyond it, waits
    order = [names(policy.next_batch(now=2.0)[0])[0] for _ in range(3)]
    assert order == ["high-soon", "low-old", "high-late"]


def test_an_expedited_item_runs_at_once_in_a_batch_of_its_own_level():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.010, aging_s=1.0, expedite_priority=0)
    policy.add(item("low-1", 0.000, priority=2))
    policy.add(item("low-2", 0.001, priority=2))
    assert policy.wake_at() == pytest.approx(0.010)
    policy.add(item("high", 0.002, priority=0))
    assert policy.wake_at() == pytest.approx(0.002)
    batch, trigger = policy.next_batch(now=0.002)
    assert names(batch) == ["high"] and trigger == "expedite"  # no wait for a fuller batch, no low items
    assert policy.next_batch(now=0.009) is None  # the low items keep their max wait
    batch, trigger = policy.next_batch(now=0.010)
    assert names(batch) == ["low-1", "low-2"] and trigger == "max_wait"


def test_an_expedited_batch_takes_the_leading_urgent_items_only():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.010, aging_s=1.0, expedite_priority=1)
    for name, t, prio in [("low", 0.0, 2), ("high", 0.001, 0), ("normal", 0.002, 1)]:
        policy.add(item(name, t, priority=prio))
    batch, trigger = policy.next_batch(now=0.002)
    assert names(batch) == ["high", "normal"] and trigger == "expedite"
    assert policy.next_batch(now=0.002) is None  # the low item keeps its max wait


def test_a_full_bucket_runs_full_with_urgent_items_first_when_expediting():
    """At saturation a full batch is queued anyway: running the urgent item alone would cost
    throughput, so it leads the full batch instead."""
    policy = BatchPolicy(max_batch_size=2, max_wait_s=0.010, aging_s=1.0, expedite_priority=0)
    policy.add(item("low-1", 0.000, priority=2))
    policy.add(item("low-2", 0.001, priority=2))
    policy.add(item("high", 0.002, priority=0))
    batch, trigger = policy.next_batch(now=0.002)
    assert names(batch) == ["high", "low-1"] and trigger == "full"


def test_a_low_priority_item_aged_past_the_urgent_one_leads_and_nothing_is_expedited():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.010, aging_s=0.1, expedite_priority=0)
    policy.add(item("low-old", 0.0, priority=2))  # rank 0.2
    policy.add(item("high-late", 0.3, priority=0))  # rank 0.3: beyond the bound, so it does not lead
    assert policy.next_batch(now=0.3) is not None  # due by max wait (the low item's), not expedite
    policy.add(item("low-older", 0.30, priority=2))
    policy.add(item("high-later", 0.61, priority=0))
    batch, trigger = policy.next_batch(now=0.61)
    assert trigger == "max_wait" and names(batch) == ["low-older", "high-later"]


arrivals = st.lists(
    st.tuples(st.floats(0, 2), st.integers(0, 2), st.sampled_from(["a", "b"]), st.booleans()),
    min_size=1, max_size=60,
)


def test_the_urgent_slot_takes_the_leading_urgent_items_only_when_one_ranks_first():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.010, aging_s=1.0, expedite_priority=0)
    for name, t, prio in [("low-1", 0.0, 2), ("high-1", 0.001, 0), ("low-2", 0.002, 2), ("high-2", 0.003, 0)]:
        policy.add(item(name, t, priority=prio))
    assert names(policy.next_urgent_batch()) == ["high-1", "high-2"]
    assert policy.size == 2 and policy.next_urgent_batch() is None  # only low work left

    aged = BatchPolicy(max_batch_size=4, max_wait_s=0.010, aging_s=0.1, expedite_priority=0)
    aged.add(item("low-old", 0.0, priority=2))  # rank 0.2
    aged.add(item("high-late", 0.3, priority=0, key="b"))  # rank 0.3, another bucket
    assert aged.next_urgent_batch() is None  # the low item ranks first: it is not overtaken
    assert BatchPolicy(max_batch_size=4, max_wait_s=0.01).next_urgent_batch() is None  # nothing queued


@settings(max_examples=200, deadline=None)
@given(arrivals=arrivals, max_batch=st.integers(1, 6), max_wait=st.floats(0.0, 0.05), aging=st.floats(0.01, 1.0),
       service=st.floats(0.0005, 0.02), expedite=st.sampled_from([None, 0, 1]), urgent_slot=st.booleans())
def test_priorities_lose_nothing_and_hold_the_starvation_bound(arrivals, max_batch, max_wait, aging, service, expedite,
                                                               urgent_slot):
    """A server under a fake clock (with the urgent slot: a second one that takes the urgent
    work first whenever it is free): every item leaves exactly once (expired only if reject and past
    its deadline), and an item is never overtaken by one that arrived more than (its priority -
    the other's) x aging after it, whether or not urgent levels are expedited."""
    policy = BatchPolicy(max_batch_size=max_batch, max_wait_s=max_wait, aging_s=aging, expedite_priority=expedite)
    pending = sorted((t, n, prio, key, late) for n, (t, prio, key, late) in enumerate(arrivals))
    served: list[Pending] = []
    expired: list[Pending] = []
    now, step = 0.0, 0.0005
    busy_until = urgent_busy_until = 0.0
    while pending or policy.size:
        while pending and pending[0][0] <= now:
            t, n, prio, key, late = pending.pop(0)
            policy.add(Pending(f"i{n}", key, t, t + 0.05, None, prio, "run_late" if late else "reject"))
        expired.extend(policy.pop_expired(now))
        if urgent_slot and expedite is not None and now >= urgent_busy_until:
            urgent = policy.next_urgent_batch()
            if urgent is not None:
                served.extend(urgent)
                urgent_busy_until = now + service
        ready = policy.next_batch(now) if now >= busy_until else None
        if ready is not None:
            served.extend(ready[0])
            busy_until = now + service  # the server is busy; arrivals queue meanwhile
        now += step
    assert sorted(p.payload for p in served + expired) == sorted(f"i{n}" for n in range(len(arrivals)))
    assert all(p.on_timeout == "reject" for p in expired)
    position = {p.payload: i for i, p in enumerate(served)}
    by_batch_order = sorted(served, key=lambda p: position[p.payload])
    for i, earlier in enumerate(by_batch_order):
        for later in by_batch_order[i + 1:]:
            if later.arrived < earlier.arrived and later.key == earlier.key:
                # `earlier` overtook `later` (same bucket): only within the aging bound
                assert earlier.arrived - later.arrived <= (later.priority - earlier.priority) * aging + 1e-9


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.tuples(st.floats(0, 10), st.integers(0, 2)), min_size=1, max_size=40), aging=st.floats(0.01, 2))
def test_rank_order_is_priority_first_within_the_aging_window(items, aging):
    ranked = sorted(items, key=lambda it: rank(it[1], it[0], aging))
    for i, (t1, p1) in enumerate(ranked):
        for t2, p2 in ranked[i + 1:]:
            if t2 < t1:  # overtaken: only by bounded head start
                assert t1 - t2 <= (p2 - p1) * aging + 1e-9


async def test_the_running_batcher_expedites_a_high_priority_item_past_queued_low_ones():
    """A model busy on a first batch; low items queue behind it, then a high one arrives. When the
    model frees, the high item runs alone (trigger expedite), the low ones after it."""
    from concurrent.futures import ThreadPoolExecutor

    from mmpipe.schemas.settings import BatchingSettings
    from mmpipe.streams.batching import DynamicBatcher

    gate, batches = threading.Event(), []

    def predict(batch):
        if batch == ["first"]:
            gate.wait(5)
        batches.append(list(batch))
        return batch

    batcher = DynamicBatcher("m", predict, bucket_key=lambda _: 0, model_limit=64, executor=ThreadPoolExecutor(1),
                             settings=BatchingSettings(max_batch_size=8, max_wait_ms=10_000))
    batcher.start()
    try:
        first = asyncio.ensure_future(batcher.submit("first", 1e12, priority=0))
        await asyncio.sleep(0.05)
        lows = [asyncio.ensure_future(batcher.submit(f"low-{i}", 1e12, priority=2)) for i in range(3)]
        high = asyncio.ensure_future(batcher.submit("high", 1e12, priority=0))
        await asyncio.sleep(0.05)
        gate.set()
        (_, info), (_, first_info) = await asyncio.wait_for(high, 5), await first
        assert info.trigger == first_info.trigger == "expedite" and info.size == 1
        assert not any(task.done() for task in lows)  # the low items keep their (long) max wait
    finally:
        await batcher.stop()
    assert batches == [["first"], ["high"]]


def test_the_highest_priority_travels_in_the_high_lane_of_each_work_topic_unless_lanes_are_off():
    from mmpipe.streams.topics import ALL_TOPICS, DECODED, EVENTS, PREDICTIONS, READY, TopicNames
    from mmpipe.streams.topology import stage_spec

    names = TopicNames("mm")
    assert [names.lane(spec, 0) for spec in (EVENTS, DECODED, READY)] == ["mm.events.high", "mm.decoded.high", "mm.ready.high"]
    assert [names.lane(spec, p) for spec in (EVENTS, READY) for p in (1, 2)] == ["mm.events"] * 2 + ["mm.ready"] * 2
    assert names.lane(PREDICTIONS, 0) == "mm.predictions"  # no lane: the sink's inputs stay one topic
    assert TopicNames("mm", lanes=False).lane(READY, 0) == "mm.ready"
    for stage, main in (("decode", EVENTS), ("preprocess", DECODED), ("inference", READY)):
        inputs = [t.suffix for t in stage_spec(stage).inputs]
        assert inputs == [main.suffix, f"{main.suffix}.high"]  # the main input first: partitions, admission
    assert {f"{t}.high" for t in ("events", "decoded", "ready")} <= {t.suffix for t in ALL_TOPICS}  # created with the rest


# The priority-ordered thread pool and admission waiters ----------------------------------------
async def test_priority_executor_serves_waiting_jobs_by_rank():
    clock = iter(range(100)).__next__  # each submission one tick later
    pool = PriorityExecutor(1, "test", aging_s=10.0, clock=lambda: float(clock()))
    gate = threading.Event()
    order: list[str] = []
    try:
        blocker = asyncio.ensure_future(pool.run(1, gate.wait, 5))
        await asyncio.sleep(0.05)  # the one thread is busy now; the rest queue
        jobs = [asyncio.ensure_future(pool.run(p, order.append, name))
                for name, p in [("low", 2), ("normal", 1), ("high", 0), ("high-2", 0)]]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, *jobs)
    finally:
        pool.shutdown()
    assert order == ["high", "high-2", "normal", "low"]


async def test_priority_executor_delivers_exceptions():
    pool = PriorityExecutor(1, "test", aging_s=1.0, clock=lambda: 0.0)
    try:
        with pytest.raises(ZeroDivisionError):
            await pool.run(1, lambda: 1 / 0)
    finally:
        pool.shutdown()


def test_waiters_let_the_best_ranked_go_first_and_skip_those_who_left():
    now = [0.0]
    waiters = PriorityWaiters(aging_s=1.0, clock=lambda: now[0])
    low = waiters.enter(2)
    now[0] = 0.5
    high = waiters.enter(0)
    assert waiters.is_first(high) and not waiters.is_first(low)
    waiters.leave(high)
    assert waiters.is_first(low) and len(waiters) == 1
    now[0] = 5.0
    late_high = waiters.enter(0)  # arrived 5 s later: beyond the 2 s bound, waits behind `low`
    assert waiters.is_first(low) and not waiters.is_first(late_high)
    waiters.leave(low)
    assert waiters.is_first(late_high)
