"""What a stage is: the contract between a stage (stages/) and the runtime that runs it.

A Stage only says what to do with one message: `handle(Incoming) -> list[Outgoing]`, raising
BadMessage for bad input, TransientError for a flaky step, DependencyUnavailable when the
database or broker is down. The runtime is cut by role, like aiokafka's consumer:

    delivery.py   consume -> handle -> produce -> ack (at-least-once, no gaps), lifecycle
    failure.py    what a failure becomes: dead letter, bounded retry, wait for a dependency
    admission.py  how much the stage may add in front of the next one (downstream lag)
    backpressure.py  the partition gate: bounded in-flight work per partition and process
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from mmpipe.schemas import ModelRef, Prediction, to_json
from mmpipe.schemas.events import JOB_ID_RE, NORMAL_PRIORITY
from mmpipe.schemas.settings import Settings
from mmpipe.streams.kafka import stage_input_topics
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.status import StatusReporter
from mmpipe.streams.topics import TopicNames

Admit = Callable[["Incoming", int], Awaitable[bool]]


class TransientError(Exception):
    """Worth retrying a few times (a flaky read, a momentary resource shortage)."""


class DependencyUnavailable(Exception):
    """A dependency (database, broker) is down: retry until it is back, never dead-letter."""


class Outgoing(NamedTuple):
    topic: str
    key: bytes
    value: bytes
    partition: int | None = None  # placed by a router (streams/routing.py); None: the key's hash


@dataclass(frozen=True)
class Incoming:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: float  # when the producer wrote it (epoch seconds)
    received_at: float  # when this stage took it

    @property
    def job_id(self) -> str:
        """Every topic is keyed by job id; a message whose key is none (or not one: NUL bytes,
        which no store column takes, or junk) gets a locator instead."""
        if self.key:
            try:
                key = self.key.decode("utf-8")
            except UnicodeDecodeError:
                key = ""
            if JOB_ID_RE.match(key):
                return key
        return f"unknown:{self.topic}:{self.partition}:{self.offset}"


class Stage(abc.ABC):
    """One step of the pipeline; subclasses live in stages/."""

    name: ClassVar[str]
    # A stage that sheds load answers jobs as rejected beyond max_backlog instead of waiting.
    sheds_load: bool = False

    def __init__(self, settings: Settings, metrics: StageMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.topics = TopicNames(settings.topic_prefix, settings.scheduling.priority_lanes)
        self.backlog = 0  # this group's lag, refreshed by the runtime, decremented per message
        self.admit: Admit | None = None  # set by the runtime (admission.py)
        self.assigned: frozenset[int] = frozenset()  # partitions of the first input topic, kept by the runtime
        self.status_reporter: StatusReporter | None = None  # set by the runtime; None: no reports

    async def wait_for_room(self, message: Incoming, priority: int = NORMAL_PRIORITY) -> bool:
        """Admission: wait until the next stage has room for this message's work (True), or
        give up at once when shedding load (False); higher priorities take room first."""
        return True if self.admit is None else await self.admit(message, priority)

    @property
    def shedding(self) -> bool:
        """Turning jobs away now: this stage sheds load and too many wait in front of it."""
        return self.sheds_load and self.backlog > self.settings.max_backlog

    @property
    def input_topics(self) -> list[str]:
        return stage_input_topics(self.settings, self.name)

    def setup(self) -> None:
        """Blocking start-up work (load models, open the store) before joining the group."""

    async def start(self) -> None:
        """Async start-up inside the worker's event loop (start batchers...)."""

    async def stop(self) -> None:
        """Release resources when the worker stops."""

    @abc.abstractmethod
    async def handle(self, message: Incoming) -> list[Outgoing]:
        """Process one message; return what to produce. Raise BadMessage for bad input."""

    async def after_send(self, outgoing: list[Outgoing]) -> None:
        """Called once the broker acknowledged every output, before the input is acked."""

    def observe_downstream_lag(self, stage: str, lag: dict[int, int]) -> None:
        """Next stage `stage`'s lag per partition of what this stage feeds it, at each read-out."""

    # Helpers for subclasses ------------------------------------------------------------
    def answer_without_work(self, status: str, *, job_id: str, part: int, parts: int, kind: str, modality: str,
                            model: ModelRef, created_at: float, trace: dict[str, float], detail: str,
                            digest: str | None, priority: int = NORMAL_PRIORITY) -> Outgoing:
        """Answer an item as expired (deadline passed) or rejected (overload): no work is done,
        the answer goes straight to the sink, which decides the whole job with it. It carries
        its job's payload digest like any part, so the answer of another job that reuses the
        ID is refused as a conflict, not taken for this job's."""
        counter = self.metrics.expired if status == "expired" else self.metrics.rejected
        counter.labels(self.name).inc()
        prediction = Prediction(
            job_id=job_id, part=part, parts=parts, kind=kind, modality=modality, model=model,
            status=status, created_at=created_at, trace=trace, error=detail, priority=priority,
            meta={} if digest is None else {"payload_digest": digest},
        )
        return Outgoing(self.topics.predictions, job_id.encode(), to_json(prediction))

    def report_status(self, job_id: str, state: str, at: float) -> None:
        """Report that work on a job started (a live view, sent coalesced: streams/status.py)."""
        if self.status_reporter is not None:
            self.status_reporter.report(job_id, state, at)
