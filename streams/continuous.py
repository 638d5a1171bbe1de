"""Continuous (iteration-level) batching of autoregressive models, with KV-cache admission.

ContinuousPolicy is the pure scheduler (no asyncio, clock passed in), tested under a fake
clock; ContinuousBatcher runs it against real time and a model on an executor thread.

Every iteration is one call into the model: apply the row moves left by the previous step's
departures, run the encoder once for the sequences joining now (batched together), then one
decoder forward over all active rows, each sequence at its own position. A sequence leaves as
soon as it emits end-of-text or reaches the token limit, and its row is refilled at once.

Memory: each sequence reserves its whole KV cache (self-attention up to the token limit plus
cross-attention over the encoder frames) when it is admitted, so a running sequence never runs
out of memory. A sequence is admitted only when its whole reservation fits the budget; until
then it waits in a bounded FIFO queue (first come, first served: a large head is never passed
by smaller ones, so nothing starves), where its deadline still applies. Past the queue bound,
or asking for more than the whole budget, it is rejected with a reason.

Policies (mode): "continuous" joins at every step; "request" forms a batch only when the
running set is empty and runs it until its longest sequence ends (finished rows are stepped as
padding and the batch is answered together, as a static batch runs); "off" runs one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from mmpipe.schemas.events import NORMAL_PRIORITY
from mmpipe.schemas.settings import ContinuousSettings
from mmpipe.streams.batching import BatcherLoop, BatchInfo, Expired, ItemFailed
from mmpipe.streams.metrics import StageMetrics

log = logging.getLogger(__name__)


class Rejected(Exception):
    """The sequence cannot be admitted: the waiting queue is full, or it needs more than the budget."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Iteration:
    """One model call: moves, then the joining sequences' encoder pass, then one decoder step."""

    moves: tuple[tuple[int, int], ...]  # (from row, to row), applied in order
    joins: tuple[tuple[int, Any], ...]  # (row, payload) of the sequences admitted now
    tokens: tuple[int, ...]  # the token each active row feeds at this step, rows 0..n-1
    positions: tuple[int, ...]  # its position in the sequence
    begin: tuple[bool, ...]  # the row samples its first token now (e.g. suppress a blank start)


class StepModel(Protocol):
    """What an autoregressive model offers the scheduler."""

    eot: int
    max_new_tokens: int

    def immediate(self, payload: Any) -> Any | None:
        """The output when nothing needs generating (e.g. silence), else None."""

    def sequence_bytes(self, payload: Any) -> int:
        """KV-cache bytes the sequence needs at most; raises on input the model cannot take."""

    def prompt(self, payload: Any) -> list[int]:
        """Forced tokens fed before the first sampled one."""

    def run_iteration(self, iteration: Iteration) -> list[int]:
        """The next token of every active row."""

    def output(self, payload: Any, tokens: list[int], reason: str) -> Any:
        """The sequence's answer from its generated tokens and why it stopped."""


@dataclass(eq=False)
class Sequence:
    payload: Any
    reservation: int
    prompt: list[int]
    arrived: float  # scheduler clock
    deadline: float  # scheduler clock
    future: asyncio.Future | None = None
    generated: list[int] = field(default_factory=list)
    row: int = -1
    position: int = 0  # the index of the token this sequence feeds at the next step
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    reason: str | None = None  # eot | length once finished
    peak_rows: int = 0  # the most sequences that shared a step with this one
    admitted_wall: float = 0.0  # wall clock, for traces

    def next_input(self, eot: int) -> int:
        if self.position < len(self.prompt):
            return self.prompt[self.position]
        index = self.position - len(self.prompt)
        return self.generated[index] if index < len(self.generated) else eot  # a finished, padded row

    @property
    def samples_now(self) -> bool:
        """The output of this step is a generated token (not a forced prompt token, nor the
        output of a finished row kept as padding)."""
        return self.reason is None and self.position + 1 >= len(self.prompt)


@dataclass
class ContinuousPolicy:
    budget_bytes: int
    max_rows: int
    max_queue: int
    max_join: int
    eot: int
    max_new_tokens: int
    mode: str = "continuous"
    waiting: deque[Sequence] = field(default_factory=deque)
    active: list[Sequence] = field(default_factory=list)
    reserved: int = 0
    _moves: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode == "off":
            self.max_rows = 1

    @classmethod
    def from_settings(cls, s: ContinuousSettings, budget_bytes: int, max_rows: int, eot: int,
                      max_new_tokens: int) -> ContinuousPolicy:
        return cls(budget_bytes, max_rows, s.max_queue, s.max_join_per_step, eot, max_new_tokens, s.mode)

    def offer(self, seq: Sequence) -> None:
        if seq.reservation > self.budget_bytes:
            raise Rejected("kv_too_large", f"needs {seq.reservation} KV-cache bytes; the budget is {self.budget_bytes}")
        if len(self.waiting) >= self.max_queue:
            raise Rejected("kv_queue_full", f"{len(self.waiting)} sequences already wait for KV-cache memory")
        self.waiting.append(seq)

    def pop_expired(self, now: float) -> list[Sequence]:
        """Waiting sequences whose deadline passed (a running one finishes: its memory is held)."""
        expired = [s for s in self.waiting if s.deadline <= now]
        if expired:
            self.waiting = deque(s for s in self.waiting if s.deadline > now)
        return expired

    def wake_at(self) -> float | None:
        return min((s.deadline for s in self.waiting), default=None)

    def plan(self, now: float) -> Iteration | None:
        """Admit what fits (first come, first served), then the step over all active rows."""
        joined = self._admit(now)
        if not self.active:
            return None
        for seq in self.active:
            seq.peak_rows = max(seq.peak_rows, len(self.active))
        moves, self._moves = tuple(self._moves), []
        return Iteration(
            moves=moves,
            joins=tuple((s.row, s.payload) for s in joined),
            tokens=tuple(s.next_input(self.eot) for s in self.active),
            positions=tuple(s.position for s in self.active),
            begin=tuple(s.position + 1 == len(s.prompt) for s in self.active),
        )

    def _admit(self, now: float) -> list[Sequence]:
        if self.mode == "request" and self.active:
            return []  # the running batch ends before a new one forms
        joined: list[Sequence] = []
        while self.waiting and len(joined) < self.max_join and len(self.active) < self.max_rows:
            head = self.waiting[0]
            if self.reserved + head.reservation > self.budget_bytes:
                break  # strict FCFS: nobody passes a head that does not fit yet
            self.waiting.popleft()
            self.reserved += head.reservation
            head.row, head.admitted_at = len(self.active), now
            self.active.append(head)
            joined.append(head)
        return joined

    def advance(self, next_tokens: list[int], now: float) -> list[Sequence]:
        """Take the step's tokens; finished sequences leave and free their reservation."""
        if len(next_tokens) != len(self.active):
            raise ValueError(f"model returned {len(next_tokens)} tokens for {len(self.active)} rows")
        finished = []
        for seq, token in zip(self.active, next_tokens):
            sampled = seq.samples_now
            seq.position += 1
            if not sampled:
                continue  # a prompt position, or a padded row of a request-level batch
            if seq.first_token_at is None:
                seq.first_token_at = now
            if token == self.eot:
                seq.reason = "eot"
            else:
                seq.generated.append(int(token))
                if len(seq.generated) >= self.max_new_tokens:
                    seq.reason = "length"
            if seq.reason:
                seq.finished_at = now
                finished.append(seq)
        if self.mode == "request":
            # Request-level batching: a finished row stays in the step as padding, and the whole
            # batch is answered when its longest sequence ends.
            if any(seq.reason is None for seq in self.active):
                return []
            finished = list(self.active)
            for seq in finished:
                seq.finished_at = now
        self._leave(finished)
        return finished

    def abort_all(self) -> list[Sequence]:
        """The model failed mid-step: every active sequence ends, its memory is freed."""
        failed, self.active, self.reserved, self._moves = self.active, [], 0, []
        return failed

    def _leave(self, finished: list[Sequence]) -> None:
        """Free the rows, keeping the active rows a contiguous prefix: the last row moves into
        each hole (descending, so a row that moves is never one that is leaving)."""
        for seq in sorted(finished, key=lambda s: s.row, reverse=True):
            last = len(self.active) - 1
            if seq.row != last:
                mover = self.active[last]
                self._moves.append((last, seq.row))
                mover.row = seq.row
                self.active[seq.row] = mover
            self.active.pop()
            self.reserved -= seq.reservation


def run_to_completion(model: StepModel, payloads: list[Any], policy: ContinuousPolicy,
                      clock: Callable[[], float] = time.monotonic) -> list[Any]:
    """Drive the scheduler synchronously until every payload is answered (no deadlines):
    the one-shot path (warm-up, tests, the benchmark's policies)."""
    outputs: dict[int, Any] = {}
    sequences = []
    for index, payload in enumerate(payloads):
        immediate = model.immediate(payload)
        if immediate is not None:
            outputs[index] = immediate
            continue
        seq = Sequence(payload, model.sequence_bytes(payload), model.prompt(payload), clock(), float("inf"))
        sequences.append((index, seq))
        policy.waiting.append(seq)  # every payload is queued: the bound is for live traffic
    while policy.waiting or policy.active:
        iteration = policy.plan(clock())
        if iteration is None:
            raise RuntimeError("a waiting sequence can never be admitted (reservation above the budget)")
        policy.advance(model.run_iteration(iteration), clock())
    for index, seq in sequences:
        outputs[index] = model.output(seq.payload, seq.generated, seq.reason or "length")
    return [outputs[i] for i in range(len(payloads))]


class ContinuousBatcher(BatcherLoop):
    """Serves one autoregressive model: submit() resolves with (output, BatchInfo) when the
    sequence finishes, or raises Expired / Rejected / ItemFailed."""

    def __init__(
        self,
        name: str,
        model: StepModel,
        settings: ContinuousSettings,
        budget_bytes: int,
        max_rows: int,
        executor: Executor,
        metrics: StageMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.model = model
        self.policy = ContinuousPolicy.from_settings(settings, budget_bytes, max_rows, model.eot, model.max_new_tokens)
        self._executor = executor
        self._metrics = metrics
        self._clock = clock
        self._wakeup = asyncio.Event()
        if metrics:
            metrics.kv_budget.labels(name).set(budget_bytes)

    async def submit(
        self, payload: Any, deadline_wall: float, priority: int = NORMAL_PRIORITY, on_timeout: str = "reject",
    ) -> tuple[Any, BatchInfo]:
        """Queue one sequence; resolves with (output, batch info) when it finishes. Admission is
        first come, first served (a KV reservation is never overtaken, so `priority` does not
        reorder it); a `run_late` sequence is never expired while it waits."""
        if on_timeout == "run_late":
            deadline_wall = math.inf
        now_wall = time.time()
        immediate = self.model.immediate(payload)
        if immediate is not None:
            self._finished("no_decoding")
            return immediate, BatchInfo(0, "no_decoding", 0.0, now_wall, now_wall)
        try:
            reservation = self.model.sequence_bytes(payload)
        except Exception as exc:
            raise ItemFailed(f"{type(exc).__name__}: {exc}") from None
        now = self._clock()
        seq = Sequence(payload, reservation, self.model.prompt(payload), now, now + (deadline_wall - now_wall),
                       asyncio.get_running_loop().create_future())
        try:
            self.policy.offer(seq)
        except Rejected as exc:
            self._finished(exc.reason)
            raise
        self._publish()
        self._wakeup.set()
        return await seq.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._expire()
            iteration = self.policy.plan(self._clock())
            self._publish()
            if iteration is None:
                await self._sleep_until(self.policy.wake_at())
                continue
            self._joined(iteration)
            sampled = sum(1 for seq in self.policy.active if seq.samples_now)
            try:
                tokens = await loop.run_in_executor(self._executor, self.model.run_iteration, iteration)
                finished = self.policy.advance(tokens, self._clock())
            except Exception as exc:
                log.exception("%s: decoder step failed; failing its %d sequences", self.name, len(self.policy.active))
                for seq in self.policy.abort_all():
                    self._finished("failed")
                    _resolve(seq, exc=ItemFailed(f"decoder step failed: {type(exc).__name__}: {exc}"))
                continue
            if self._metrics:
                self._metrics.decode_step_rows.labels(self.name).observe(len(iteration.tokens))
                self._metrics.generated_tokens.labels(self.name).inc(sampled)
            for seq in finished:
                self._answer(seq)

    def _expire(self) -> None:
        now = self._clock()
        for seq in self.policy.pop_expired(now):
            self._finished("expired")
            if self._metrics:
                self._metrics.expired.labels("inference").inc()
            _resolve(seq, exc=Expired(f"deadline passed after {now - seq.arrived:.3f}s waiting for KV-cache memory"))

    def _joined(self, iteration: Iteration) -> None:
        if not iteration.joins:
            return
        wall = time.time()
        for seq in self.policy.active[iteration.joins[0][0]:]:
            seq.admitted_wall = wall
            if self._metrics and seq.admitted_at is not None:
                self._metrics.admission_wait.labels(self.name).observe(seq.admitted_at - seq.arrived)

    def _answer(self, seq: Sequence) -> None:
        self._finished(seq.reason or "length")
        if self._metrics and seq.first_token_at is not None and seq.finished_at is not None:
            self._metrics.time_to_first_token.labels(self.name).observe(seq.first_token_at - seq.arrived)
            if len(seq.generated) > 1:
                per_token = (seq.finished_at - seq.first_token_at) / (len(seq.generated) - 1)
                self._metrics.time_per_output_token.labels(self.name).observe(per_token)
        try:
            output = self.model.output(seq.payload, seq.generated, seq.reason or "length")
        except Exception as exc:
            _resolve(seq, exc=ItemFailed(f"{type(exc).__name__}: {exc}"))
            return
        wait = (seq.admitted_at or seq.arrived) - seq.arrived
        info = BatchInfo(seq.peak_rows, self.policy.mode, wait, seq.admitted_wall, time.time())
        _resolve(seq, result=(output, info))

    def _finished(self, reason: str) -> None:
        if self._metrics:
            self._metrics.sequences_finished.labels(self.name, reason).inc()

    def _publish(self) -> None:
        if self._metrics:
            self._metrics.active_sequences.labels(self.name).set(len(self.policy.active))
            self._metrics.kv_reserved.labels(self.name).set(self.policy.reserved)
            self._metrics.batcher_queue.labels(self.name).set(len(self.policy.waiting))


def _resolve(seq: Sequence, result: Any = None, exc: BaseException | None = None) -> None:
    if seq.future is None or seq.future.done():
        return
    if exc is not None:
        seq.future.set_exception(exc)
    else:
        seq.future.set_result(result)
