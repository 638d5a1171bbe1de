"""The batcher's two limits, buckets and deadlines under a fake clock (BatchPolicy is pure),
and the async DynamicBatcher's failure isolation with a real executor."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmpipe.schemas.settings import BatchingSettings
from mmpipe.streams.batching import BatchPolicy, DynamicBatcher, Expired, ItemFailed, Pending


def item(name: str, t: float, key: object = "a", deadline: float = 1e9) -> Pending:
    return Pending(payload=name, key=key, arrived=t, deadline=deadline)


def names(batch) -> list[str]:
    return [p.payload for p in batch]


def test_full_batch_flushes_at_once():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.010)
    for i in range(4):
        policy.add(item(f"x{i}", t=0.0))
    batch, trigger = policy.next_batch(now=0.0)
    assert names(batch) == ["x0", "x1", "x2", "x3"] and trigger == "full"
    assert policy.size == 0


def test_lone_item_flushes_at_max_wait_of_the_oldest():
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.010)
    policy.add(item("first", t=0.000))
    policy.add(item("second", t=0.008))
    assert policy.next_batch(now=0.0099) is None
    assert policy.wake_at() == pytest.approx(0.010)  # measured from the oldest, not the newest
    batch, trigger = policy.next_batch(now=0.010)
    assert names(batch) == ["first", "second"] and trigger == "max_wait"


def test_limits_are_independent_batch_size_caps_a_due_bucket():
    policy = BatchPolicy(max_batch_size=3, max_wait_s=0.010)
    for i in range(5):
        policy.add(item(f"x{i}", t=0.0))
    first, _ = policy.next_batch(now=0.0)
    assert names(first) == ["x0", "x1", "x2"]
    assert policy.next_batch(now=0.005) is None  # the rest waits for its own max wait
    second, trigger = policy.next_batch(now=0.010)
    assert names(second) == ["x3", "x4"] and trigger == "max_wait"


def test_buckets_are_kept_apart_and_a_small_bucket_flushes_at_max_wait():
    policy = BatchPolicy(max_batch_size=2, max_wait_s=0.010)
    policy.add(item("short-1", 0.000, key=16))
    policy.add(item("long-1", 0.001, key=128))
    policy.add(item("short-2", 0.002, key=16))
    batch, trigger = policy.next_batch(now=0.002)
    assert names(batch) == ["short-1", "short-2"] and trigger == "full"
    assert policy.next_batch(now=0.005) is None
    batch, trigger = policy.next_batch(now=0.011)
    assert names(batch) == ["long-1"] and trigger == "max_wait"


def test_oldest_due_bucket_goes_first():
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.010)
    policy.add(item("b", 0.002, key="B"))
    policy.add(item("a", 0.001, key="A"))
    batch, _ = policy.next_batch(now=0.020)
    assert names(batch) == ["a"]


def test_expired_items_are_removed_not_run():
    policy = BatchPolicy(max_batch_size=8, max_wait_s=0.010)
    policy.add(item("late", 0.0, deadline=0.005))
    policy.add(item("fine", 0.0, deadline=1.0))
    assert policy.wake_at() == pytest.approx(0.005)  # wakes for the deadline, before max wait
    assert names(policy.pop_expired(now=0.006)) == ["late"]
    batch, _ = policy.next_batch(now=0.010)
    assert names(batch) == ["fine"]


def test_static_mode_waits_for_full_batch_then_timeout():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.010, mode="static", static_timeout_s=0.5)
    policy.add(item("x", 0.0))
    assert policy.next_batch(now=0.1) is None  # dynamic would have flushed at 10 ms
    batch, trigger = policy.next_batch(now=0.5)
    assert names(batch) == ["x"] and trigger == "timeout"


def test_off_mode_runs_items_one_by_one():
    policy = BatchPolicy.from_settings(BatchingSettings(mode="off", max_batch_size=16), model_limit=64)
    for i in range(3):
        policy.add(item(f"x{i}", 0.0))
    assert [names(policy.next_batch(0.0)[0]) for _ in range(3)] == [["x0"], ["x1"], ["x2"]]


def test_model_limit_caps_configured_batch_size():
    policy = BatchPolicy.from_settings(BatchingSettings(max_batch_size=512), model_limit=64)
    assert policy.max_batch_size == 64


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["a", "b", "c"])), min_size=1, max_size=60),
    max_batch=st.integers(1, 8),
    max_wait=st.floats(0.001, 0.1),
)
def test_policy_never_loses_or_duplicates_and_respects_limits(arrivals, max_batch, max_wait):
    """Driven by a fake clock over random arrivals: every item leaves exactly once, batches hold
    one bucket, never exceed max_batch, and no item waits past max_wait (+ the step size)."""
    policy = BatchPolicy(max_batch_size=max_batch, max_wait_s=max_wait)
    pending = sorted((t, key, f"i{n}") for n, (t, key) in enumerate(arrivals))
    out: list[str] = []
    now, step = 0.0, 0.0005
    while pending or policy.size:
        while pending and pending[0][0] <= now:
            t, key, name = pending.pop(0)
            policy.add(Pending(name, key, t, 1e9))
        while (ready := policy.next_batch(now)) is not None:
            batch, _ = ready
            assert 1 <= len(batch) <= max_batch and len({p.key for p in batch}) == 1
            assert now - min(p.arrived for p in batch) <= max_wait + step + 1e-9
            out.extend(p.payload for p in batch)
        now += step
    assert sorted(out) == sorted(f"i{n}" for n in range(len(arrivals)))


async def test_poison_item_fails_alone_and_others_succeed():
    calls: list[int] = []

    def predict(batch):
        calls.append(len(batch))
        if "poison" in batch:
            raise ValueError("cannot handle poison")
        return [x.upper() for x in batch]

    batcher = DynamicBatcher("m", predict, bucket_key=lambda _: 0, settings=BatchingSettings(max_batch_size=4, max_wait_ms=20),
                             model_limit=64, executor=ThreadPoolExecutor(1))
    batcher.start()
    try:
        results = await asyncio.gather(*(batcher.submit(x, deadline_wall=1e12) for x in ["a", "poison", "b"]),
                                       return_exceptions=True)
    finally:
        await batcher.stop()
    assert results[0][0] == "A" and results[2][0] == "B"
    assert isinstance(results[1], ItemFailed) and "poison" in str(results[1])
    assert calls[0] == 3 and sorted(calls[1:]) == [1, 1, 1]  # one batch, then each item alone once


async def test_output_count_mismatch_is_a_failure_not_a_silent_misalignment():
    batcher = DynamicBatcher("m", lambda batch: batch[:-1] if len(batch) > 1 else batch, bucket_key=lambda _: 0,
                             settings=BatchingSettings(max_batch_size=2, max_wait_ms=50), model_limit=64,
                             executor=ThreadPoolExecutor(1))
    batcher.start()
    try:
        results = await asyncio.gather(*(batcher.submit(x, 1e12) for x in ["a", "b"]))
    finally:
        await batcher.stop()
    # the 2-item batch returned 1 output: both items were re-run alone and answered correctly
    assert [r[0] for r in results] == ["a", "b"] and all("isolated" in r[1].trigger for r in results)


async def test_deadline_passing_in_the_queue_answers_expired():
    import time

    batcher = DynamicBatcher("m", lambda b: b, bucket_key=lambda _: 0,
                             settings=BatchingSettings(mode="static", max_batch_size=8, static_timeout_ms=5000),
                             model_limit=64, executor=ThreadPoolExecutor(1))
    batcher.start()
    try:
        with pytest.raises(Expired):
            await asyncio.wait_for(batcher.submit("x", deadline_wall=time.time() + 0.05), 2.0)
    finally:
        await batcher.stop()


@pytest.mark.parametrize("urgent_slot", [True, False])
async def test_an_urgent_item_runs_beside_a_running_batch_on_the_urgent_slot(urgent_slot):
    """The urgent slot: an urgent item that arrives while a slow batch runs is answered before
    that batch ends, in a batch of its own; without the slot it waits for the model."""
    import time

    def predict(batch):
        time.sleep(0.05 if batch == ["urgent"] else 0.6)
        return [x.upper() for x in batch]

    batcher = DynamicBatcher("m", predict, bucket_key=lambda _: 0,
                             settings=BatchingSettings(max_batch_size=2, max_wait_ms=0, expedite_priority=0),
                             model_limit=64, executor=ThreadPoolExecutor(1),
                             urgent_executor=ThreadPoolExecutor(1) if urgent_slot else None)
    batcher.start()
    finished: dict[str, float] = {}

    async def submit(x, priority):
        result = await batcher.submit(x, 1e12, priority=priority)
        finished[x] = time.monotonic()
        return result

    try:
        slow = asyncio.ensure_future(asyncio.gather(submit("low-1", 2), submit("low-2", 2)))
        await asyncio.sleep(0.1)  # the low batch is running now
        output, info = await submit("urgent", 0)
        await slow
    finally:
        await batcher.stop()
    assert output == "URGENT" and info.size == 1
    if urgent_slot:  # it ran on the slot, not in the full batch of low items queued behind it
        assert info.trigger == "urgent_slot" and finished["urgent"] < finished["low-1"]
    else:
        assert finished["urgent"] > finished["low-1"]


@pytest.mark.parametrize("urgent_slot", [True, False])
async def test_an_urgent_item_does_not_ride_in_a_full_batch_when_the_slot_is_free(urgent_slot):
    batcher = DynamicBatcher("m", lambda batch: batch, bucket_key=lambda _: 0,
                             settings=BatchingSettings(max_batch_size=2, max_wait_ms=1000, expedite_priority=0),
                             model_limit=64, executor=ThreadPoolExecutor(1),
                             urgent_executor=ThreadPoolExecutor(1) if urgent_slot else None)
    batcher.start()
    try:  # queued in one turn of the loop: a full bucket of low items and an urgent one
        results = await asyncio.gather(batcher.submit("low-1", 1e12, priority=2), batcher.submit("low-2", 1e12, priority=2),
                                       batcher.submit("urgent", 1e12, priority=0))
    finally:
        await batcher.stop()
    (_, low_info), _, (_, urgent_info) = results
    if urgent_slot:
        assert (urgent_info.size, urgent_info.trigger) == (1, "urgent_slot") and (low_info.size, low_info.trigger) == (2, "full")
    else:  # the full-batch rule: it leads the full batch
        assert (urgent_info.size, urgent_info.trigger) == (2, "full")


def test_predict_on_two_threads_at_once_answers_like_one_after_the_other(tmp_path):
    """The urgent slot runs predict beside a running batch (ModelConfig.reentrant_predict): the
    frozen graph must give each thread its own answers."""
    import numpy as np

    from mmpipe.models.image_classifier import resnet18_spec

    spec = resnet18_spec()
    assert spec.config.reentrant_predict
    model = spec.load("cpu", str(tmp_path), allow_random=True)
    model.freeze_graph()
    rng = np.random.default_rng(4)
    batches = [[{"pixels": rng.integers(0, 256, (3, 224, 224), dtype=np.uint8)} for _ in range(n)] for n in (4, 1, 3, 1)]
    alone = [model.predict(batch) for batch in batches]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(model.predict, batches))
    for a, b in zip(alone, together):
        assert [r["labels"][0]["index"] for r in a] == [r["labels"][0]["index"] for r in b]
        assert all(abs(x["p"] - y["p"]) < 1e-4 for ra, rb in zip(a, b) for x, y in zip(ra["labels"], rb["labels"]))


# The commit rule (streams/transport.py): never commit past unfinished work ------------------
from mmpipe.streams.transport import first_committable_run  # noqa: E402


def test_commit_waits_for_the_message_at_the_committed_offset():
    # faust's own check let this through and committed 43, past the unfinished offset 41
    assert first_committable_run([42], committed=41, lowest_unacked=41) == []
    assert first_committable_run([41, 42, 44], committed=41, lowest_unacked=43) == [41, 42]


def test_before_the_first_commit_the_lowest_unfinished_message_bounds_the_commit():
    assert first_committable_run([5, 6], committed=None, lowest_unacked=4) == []
    assert first_committable_run([5, 6, 8], committed=None, lowest_unacked=7) == [5, 6]
    assert first_committable_run([5, 6], committed=None, lowest_unacked=None) == [5, 6]


@settings(max_examples=300, deadline=None)
@given(done=st.sets(st.integers(0, 40)), committed=st.integers(0, 20))
def test_committed_offset_never_passes_an_unfinished_message(done, committed):
    acked = sorted(o for o in done if o >= committed)
    unfinished = [o for o in range(committed, 41) if o not in done]
    run = first_committable_run(acked, committed, min(unfinished, default=None))
    new_committed = run[-1] + 1 if run else committed
    assert all(o >= new_committed for o in unfinished)
    assert all(o in done for o in range(committed, new_committed))
