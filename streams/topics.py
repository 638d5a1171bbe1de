"""Every topic of the pipeline in one place: name, who writes it, who reads it, its config.

    events ──decode──▶ decoded ──preprocess──▶ ready ──inference──▶ predictions ──sink──▶ results
       │                  │                      │                       ▲                 (compacted)
       └──────────────────┴──────────────────────┴──▶ dead-letter ───────┘
    every stage ──▶ status ──▶ sink (job status table)
    inference ──▶ workers ──▶ preprocess's router (compacted; only with scheduling.routing)

All keys are job IDs, so every message of one job lands on the same partition of each topic,
and the sink that assembles a job's parts sees all of them. With routing on, preprocess picks
the `ready` partition itself (parts of one job may run on different inference workers); the
predictions are still keyed by job ID, so the sink still assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
STATUS = TopicSpec("status", "job state transitions reported by the stages", compacted=True)
WORKERS = TopicSpec("workers", "inference workers' state for routing onto ready (WorkerState JSON)", compacted=True)

ALL_TOPICS = (EVENTS, DECODED, READY, PREDICTIONS, RESULTS, DEAD_LETTER, STATUS, WORKERS)


@dataclass(frozen=True)
class TopicNames:
    """Resolved topic names for one deployment prefix."""

    prefix: str

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

    def all(self) -> list[tuple[str, TopicSpec]]:
        return [(spec.name(self.prefix), spec) for spec in ALL_TOPICS]
