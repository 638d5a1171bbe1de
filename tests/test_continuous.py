"""The continuous batching scheduler under a fake clock with a fake step model (ContinuousPolicy
is pure), and the async ContinuousBatcher's answers, expiry, rejection and failure handling."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from mmpipe.schemas.settings import ContinuousSettings
from mmpipe.streams.batching import Expired, ItemFailed
from mmpipe.streams.continuous import ContinuousBatcher, ContinuousPolicy, Iteration, Rejected, Sequence
from mmpipe.streams.metrics import StageMetrics

EOT = 0
PROMPT = [1, 2]


@dataclass(frozen=True)
class Job:
    name: str
    length: int  # tokens before end of text
    kv: int = 10


@dataclass
class FakeModel:
    """Emits tokens 100, 101, ... then EOT after `length`; keeps its own row table and checks
    that every step's rows, positions and inputs are the ones of the sequence in that row."""

    max_new_tokens: int = 50
    eot: int = EOT
    rows: list[Job | None] = field(default_factory=lambda: [None] * 64)
    fed: dict[str, list[int]] = field(default_factory=dict)
    steps: list[tuple[str, ...]] = field(default_factory=list)
    encoder_batches: list[tuple[str, ...]] = field(default_factory=list)
    fail_on_step: int | None = None
    step_delay_s: float = 0.0

    def immediate(self, payload: Job) -> object | None:
        return "empty" if payload.length == 0 else None

    def sequence_bytes(self, payload: Job) -> int:
        return payload.kv

    def prompt(self, payload: Job) -> list[int]:
        return list(PROMPT)

    def run_iteration(self, it: Iteration) -> list[int]:
        if self.fail_on_step is not None and len(self.steps) == self.fail_on_step:
            self.fail_on_step = None  # once
            raise RuntimeError("device fell over")
        time.sleep(self.step_delay_s)
        for src, dst in it.moves:
            self.rows[dst], self.rows[src] = self.rows[src], None
        staying = len(it.tokens) - len(it.joins)
        self.rows[staying:] = [None] * (len(self.rows) - staying)  # rows of departed sequences are free
        if it.joins:
            self.encoder_batches.append(tuple(job.name for _, job in it.joins))
        for row, job in it.joins:
            assert self.rows[row] is None, f"row {row} still holds {self.rows[row]}"
            self.rows[row] = job
            self.fed[job.name] = []
        out = []
        active = self.rows[: len(it.tokens)]
        self.steps.append(tuple(job.name for job in active))
        for job, token, position in zip(active, it.tokens, it.positions):
            fed = self.fed[job.name]
            assert position == len(fed), f"{job.name} fed at {position}, expected {len(fed)}"
            fed.append(token)
            out.append(self._next(job, position))
        return out

    def _next(self, job: Job, position: int) -> int:
        generated = position + 1 - len(PROMPT)  # tokens generated before this output
        if generated < 0:
            return 999  # the output of a forced prompt position is ignored
        return EOT if generated >= job.length else 100 + generated

    def output(self, payload: Job, tokens: list[int], reason: str) -> object:
        return {"name": payload.name, "tokens": tokens, "reason": reason}


def seq(job: Job, t: float = 0.0, deadline: float = 1e9) -> Sequence:
    return Sequence(job, job.kv, list(PROMPT), t, deadline)


def policy(budget: int = 100, rows: int = 8, queue: int = 16, join: int = 8, mode: str = "continuous",
           max_new: int = 50) -> ContinuousPolicy:
    return ContinuousPolicy(budget, rows, queue, join, EOT, max_new, mode)


def step(p: ContinuousPolicy, model: FakeModel, now: float) -> list[Sequence]:
    it = p.plan(now)
    if it is None:
        return []
    return p.advance(model.run_iteration(it), now)


def drive(p: ContinuousPolicy, model: FakeModel, arrivals: dict[int, list[Job]], steps: int = 500) -> dict[str, tuple[int, int]]:
    """Run steps 0..; jobs arrive before their step. Returns name -> (admitted step, finished step)."""
    admitted: dict[str, int] = {}
    done: dict[str, tuple[int, int]] = {}
    for t in range(steps):
        for job in arrivals.get(t, []):
            p.offer(seq(job, t))
        before = {s.payload.name for s in p.active}
        it = p.plan(float(t))
        if it is None:
            if not any(k > t for k in arrivals):
                break
            continue
        for s in p.active:
            if s.payload.name not in before:
                admitted[s.payload.name] = t
        assert p.reserved <= p.budget_bytes
        assert p.reserved == sum(s.reservation for s in p.active)
        for s in p.advance(model.run_iteration(it), float(t)):
            done[s.payload.name] = (admitted[s.payload.name], t)
    return done


def test_sequences_join_and_leave_at_every_step():
    model, p = FakeModel(), policy(rows=2)
    done = drive(p, model, {0: [Job("long", 6)], 1: [Job("short", 1)], 2: [Job("late", 1)]})
    # "short" joins at the step after "long" started, and leaves after its prompt + one token
    assert done["short"] == (1, 1 + len(PROMPT))
    # "late" waits for a free row (2 rows) and joins at the very next step after "short" left
    assert done["late"][0] == done["short"][1] + 1
    # "long" never stopped: it ran at every step from its admission to its end
    assert all("long" in names for names in model.steps[: done["long"][1] + 1])
    assert model.fed["long"] == PROMPT + [100 + i for i in range(6)]  # the last token is fed to get EOT


def test_the_last_row_moves_into_a_hole_and_keeps_its_cache_position():
    model, p = FakeModel(), policy(rows=3)
    drive(p, model, {0: [Job("a", 1), Job("b", 8), Job("c", 8)]})  # a leaves first, c moves to row 0
    assert model.steps[0] == ("a", "b", "c")
    assert model.steps[len(PROMPT) + 1] == ("c", "b")  # c moved into a's row, same positions asserted


def test_joining_sequences_share_one_encoder_pass():
    model, p = FakeModel(), policy(rows=8, join=3)
    drive(p, model, {0: [Job(f"j{i}", 2) for i in range(5)]})
    assert model.encoder_batches == [("j0", "j1", "j2"), ("j3", "j4")]


def test_token_limit_ends_a_sequence_with_reason_length():
    model, p = FakeModel(), policy(max_new=4)
    p.offer(seq(Job("endless", 100)))
    finished = []
    for t in range(20):
        finished += step(p, model, float(t))
    assert [(s.payload.name, s.reason, len(s.generated)) for s in finished] == [("endless", "length", 4)]


def test_admission_is_first_come_first_served_and_a_head_that_does_not_fit_blocks():
    p = policy(budget=10)
    p.offer(seq(Job("a", 3, kv=6)))
    p.plan(0.0)
    p.offer(seq(Job("big", 3, kv=6), 1.0))
    p.offer(seq(Job("small", 3, kv=2), 2.0))
    p.plan(1.0)
    assert [s.payload.name for s in p.active] == ["a"]  # small fits (6+2) but does not pass big
    assert [s.payload.name for s in p.waiting] == ["big", "small"]


def test_no_starvation_a_large_sequence_is_admitted_before_later_small_ones():
    model, p = FakeModel(), policy(budget=10, rows=8)
    arrivals = {0: [Job("s0", 4, kv=4), Job("s1", 4, kv=4)], 1: [Job("large", 2, kv=10)]}
    arrivals.update({t: [Job(f"later{t}", 4, kv=4)] for t in range(2, 12)})
    done = drive(p, model, arrivals)
    large_admitted, large_done = done["large"]
    assert large_admitted == max(done["s0"][1], done["s1"][1]) + 1
    assert all(done[f"later{t}"][0] > large_done for t in range(2, 12))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12), st.integers(1, 40)), min_size=1, max_size=25),
       st.integers(40, 100), st.integers(1, 6), st.sampled_from(["continuous", "request", "off"]))
def test_kv_budget_is_never_exceeded_and_every_sequence_finishes(jobs, budget, rows, mode):
    model, p = FakeModel(), policy(budget=budget, rows=rows, queue=100, mode=mode)
    arrivals: dict[int, list[Job]] = {}
    for i, (t, length, kv) in enumerate(jobs):
        arrivals.setdefault(t, []).append(Job(f"j{i}", length, kv=kv))
    done = drive(p, model, arrivals, steps=2000)  # drive() asserts reserved <= budget at every step
    assert set(done) == {f"j{i}" for i in range(len(jobs))}
    assert p.reserved == 0 and not p.active and not p.waiting
    assert max(len(names) for names in model.steps) <= (1 if mode == "off" else rows)


def test_request_mode_runs_a_batch_until_its_longest_sequence_ends():
    model, p = FakeModel(), policy(rows=4, mode="request")
    done = drive(p, model, {0: [Job("short", 1), Job("long", 6)], 1: [Job("next", 1)]})
    assert done["next"][0] == done["long"][1] + 1  # waits although a row was free
    assert done["short"][1] == done["long"][1]  # answered with its batch
    assert all(names == ("short", "long") for names in model.steps[: done["long"][1] + 1])  # stepped as padding
    assert model.fed["short"][len(PROMPT):] == [100] + [EOT] * 5  # after its end it feeds end-of-text


def test_a_deadline_expires_a_waiting_sequence():
    p = policy(budget=10)
    p.offer(seq(Job("running", 50, kv=10)))
    p.plan(0.0)
    p.offer(seq(Job("waits", 2, kv=10), t=0.0, deadline=5.0))
    assert p.wake_at() == 5.0
    assert p.pop_expired(4.9) == []
    assert [s.payload.name for s in p.pop_expired(5.0)] == ["waits"]
    assert not p.waiting and p.reserved == 10


def test_overflow_and_oversized_sequences_are_rejected_with_a_reason():
    p = policy(budget=10, queue=1)
    with pytest.raises(Rejected) as too_large:
        p.offer(seq(Job("huge", 1, kv=11)))
    assert too_large.value.reason == "kv_too_large"
    p.offer(seq(Job("one", 1)))
    with pytest.raises(Rejected) as full:
        p.offer(seq(Job("two", 1)))
    assert full.value.reason == "kv_queue_full"


# The async batcher -------------------------------------------------------------------------
def batcher(model: FakeModel, budget: int = 20, **overrides: object) -> tuple[ContinuousBatcher, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = StageMetrics("inference", registry)
    s = ContinuousSettings(**{"max_queue": 8, **overrides})
    b = ContinuousBatcher("fake", model, s, budget, 8, ThreadPoolExecutor(1), metrics)
    b.start()
    return b, registry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_batcher_answers_sequences_that_share_steps():
    model = FakeModel()
    b, metrics = batcher(model)
    try:
        deadline = time.time() + 30
        results = await asyncio.gather(*(b.submit(Job(f"j{i}", 2 + i), deadline) for i in range(3)))
    finally:
        await b.stop()
    outputs = [out for out, _ in results]
    assert [o["tokens"] for o in outputs] == [[100 + k for k in range(2 + i)] for i in range(3)]
    assert all(o["reason"] == "eot" for o in outputs)
    assert max(info.size for _, info in results) == 2  # budget 20 / 10 per sequence
    assert sample(metrics, "mm_sequences_finished_total", model="fake", reason="eot") == 3
    assert sample(metrics, "mm_generated_tokens_total", model="fake") == sum(3 + i for i in range(3))
    assert sample(metrics, "mm_kv_budget_bytes", model="fake") == 20
    assert sample(metrics, "mm_kv_reserved_bytes", model="fake") == 0
    assert sample(metrics, "mm_time_to_first_token_seconds_count", model="fake") == 3


async def test_batcher_expires_a_waiting_sequence_and_rejects_past_the_queue():
    model = FakeModel(step_delay_s=0.002)
    b, metrics = batcher(model, budget=10, max_queue=1)
    try:
        running = asyncio.ensure_future(b.submit(Job("running", 40), time.time() + 30))
        await asyncio.sleep(0.005)
        waiting = asyncio.ensure_future(b.submit(Job("waiting", 1), time.time() + 0.001))
        await asyncio.sleep(0)
        with pytest.raises(Rejected):
            await b.submit(Job("overflow", 1), time.time() + 30)
        with pytest.raises(Expired):
            await waiting
        out, _ = await running
    finally:
        await b.stop()
    assert out["reason"] == "eot"
    assert sample(metrics, "mm_sequences_finished_total", model="fake", reason="expired") == 1
    assert sample(metrics, "mm_sequences_finished_total", model="fake", reason="kv_queue_full") == 1


async def test_batcher_fails_the_running_sequences_when_the_model_fails_and_recovers():
    model = FakeModel(fail_on_step=1)
    b, _ = batcher(model)
    try:
        with pytest.raises(ItemFailed, match="device fell over"):
            await b.submit(Job("victim", 5), time.time() + 30)
        assert b.policy.reserved == 0
        model.rows = [None] * 64
        out, _ = await b.submit(Job("after", 1), time.time() + 30)
        empty, info = await b.submit(Job("silent", 0), time.time() + 30)
    finally:
        await b.stop()
    assert out["tokens"] == [100] and empty == "empty" and info.trigger == "no_decoding"
