"""Every topic of the pipeline in one place: name, who writes it, who reads it, its config.

    events ──decode──▶ decoded ──preprocess──▶ ready ──inference──▶ predictions ──sink──▶ results
       │                  │                      │                       ▲                 (compacted)
       └──────────────────┴──────────────────────┴──▶ dead-letter ───────┘
    decode, preprocess ──▶ status ──▶ sink (job status table, a live view; coalesced reports,
                                          and the sink stamps every state's time from traces)
    high priority: events.high ──decode──▶ decoded.high ──preprocess──▶ ready.high ──inference──▶
    inference ──▶ workers ──▶ preprocess's router (compacted; only with scheduling.routing)

All work keys are job IDs (a status record's is its reporting process), so every message of
one job lands on the same partition of each topic, and the sink that assembles a job's parts
sees all of them. With routing on, preprocess picks
the `ready` partition itself (parts of one job may run on different inference workers); the
predictions are still keyed by job ID, so the sink still assembles them.

Priority lanes. A Kafka topic is FIFO, and under load the backlog of a pipeline waits in its
topics, not in the stages (each stage holds a bounded window of work; backpressure leaves the
rest in Kafka). High-priority work therefore travels in topics of its own (`lane`): each stage
reads both, and a high-priority item never queues behind a backlog of lower levels; inside the
stage the queues rank by priority (streams/priority.py). Lane topics have the same partition
count and keys, and faust assigns partition p of every input topic to the same member, so a
job's partition, ownership and routing are the same in either lane.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmpipe.schemas.events import HIGH_PRIORITY


@dataclass(frozen=True)
class TopicSpec:
    suffix: str
    description: str
    compacted: bool = False
    config: dict[str, str] = field(default_factory=dict)

    def name(self, prefix: str) -> str:
        return f"{prefix}.{self.suffix}"

    def kafka_config(self) -> dict[str, str]:
        config = dict(self.config)
        if self.compacted:
            config["cleanup.policy"] = "compact"
        return config


EVENTS = TopicSpec("events", "media events published by producers (MediaEvent JSON)")
DECODED = TopicSpec("decoded", "decoded frames, PCM and text (WorkItem binary)")
READY = TopicSpec("ready", "model-ready tensors (WorkItem binary)")
PREDICTIONS = TopicSpec("predictions", "per-part model outputs (Prediction JSON)")
RESULTS = TopicSpec("results", "one result per job_id (JobResult JSON)", compacted=True)
DEAD_LETTER = TopicSpec("dead-letter", "input that cannot be processed, with a reason")
# Not compacted: a record holds many jobs' reports under its reporting process's key.
STATUS = TopicSpec("status", "job state transitions reported by the stages (StatusReport JSON, coalesced)")
WORKERS = TopicSpec("workers", "inference workers' state for routing onto ready (WorkerState JSON)", compacted=True)
EVENTS_HIGH = TopicSpec("events.high", "high-priority media events (the events lane of priority 0)")
DECODED_HIGH = TopicSpec("decoded.high", "high-priority decoded work (the decoded lane of priority 0)")
READY_HIGH = TopicSpec("ready.high", "high-priority model-ready work (the ready lane of priority 0)")

# The work topics' high-priority lanes: priority HIGH_PRIORITY travels in these.
HIGH_LANES = {spec.suffix: high for spec, high in ((EVENTS, EVENTS_HIGH), (DECODED, DECODED_HIGH), (READY, READY_HIGH))}

ALL_TOPICS = (EVENTS, DECODED, READY, PREDICTIONS, RESULTS, DEAD_LETTER, STATUS, WORKERS, *HIGH_LANES.values())


def lane(spec: TopicSpec, priority: int) -> TopicSpec:
    """The topic that carries `spec`'s work of this priority: its high lane for the highest
    level (where it has one), itself otherwise."""
    return HIGH_LANES.get(spec.suffix, spec) if priority <= HIGH_PRIORITY else spec


def with_lanes(spec: TopicSpec) -> tuple[TopicSpec, ...]:
    """`spec` and its high lane (if any): what a stage reads, what a lag covers."""
    return (spec, HIGH_LANES[spec.suffix]) if spec.suffix in HIGH_LANES else (spec,)


@dataclass(frozen=True)
class TopicNames:
    """Resolved topic names for one deployment prefix."""

    prefix: str
    lanes: bool = True  # scheduling.priority_lanes: False sends every priority through the main topics

    @property
    def events(self) -> str:
        return EVENTS.name(self.prefix)

    @property
    def decoded(self) -> str:
        return DECODED.name(self.prefix)

    @property
    def ready(self) -> str:
        return READY.name(self.prefix)

    @property
    def predictions(self) -> str:
        return PREDICTIONS.name(self.prefix)

    @property
    def results(self) -> str:
        return RESULTS.name(self.prefix)

    @property
    def dead_letter(self) -> str:
        return DEAD_LETTER.name(self.prefix)

    @property
    def status(self) -> str:
        return STATUS.name(self.prefix)

    @property
    def workers(self) -> str:
        return WORKERS.name(self.prefix)

    def lane(self, spec: TopicSpec, priority: int) -> str:
        return (lane(spec, priority) if self.lanes else spec).name(self.prefix)

    def all(self) -> list[tuple[str, TopicSpec]]:
        return [(spec.name(self.prefix), spec) for spec in ALL_TOPICS]
