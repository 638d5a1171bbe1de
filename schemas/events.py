"""Versioned contracts of every message that crosses a topic.

External contract (producers write it):  MediaEvent                        -> topic `events`
Internal contracts (stages write them):   WorkItem (binary, carries tensors) -> `decoded`, `ready`
                                          Prediction                         -> `predictions`
                                          DeadLetter                         -> `dead-letter`
                                          StatusReport (JobStatus entries)   -> `status`
                                          WorkerState                        -> `workers`
Output contract (downstream reads it):    JobResult                          -> `results` + store

Every struct is a msgspec Struct: decoding validates types and reports the path of the first
bad field, and unknown fields are ignored so a newer producer can add optional fields.

Schema 1 history (additive, optional fields only, so the version number stays 1):
  1.1  MediaEvent.priority and .on_timeout (scheduling); Prediction/JobResult .priority and
       .late. Older producers omit them and get the defaults (normal priority, reject).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, get_args

import msgspec

SCHEMA_VERSION = 1

Modality = Literal["image", "audio", "video", "text"]
MODALITIES: tuple[str, ...] = get_args(Modality)
ItemKind = Literal["image", "audio", "text"]
PredictionStatus = Literal["ok", "error", "expired", "rejected"]
ResultStatus = Literal["ok", "error", "expired", "rejected"]
JobState = Literal[
    "accepted", "decoding", "preprocessing", "inferring", "done", "failed", "expired", "rejected"
]

# Scheduling (Triton's priority_levels and queue policy): 0 is the highest of PRIORITY_LEVELS.
PRIORITY_LEVELS = 3
HIGH_PRIORITY, NORMAL_PRIORITY, LOW_PRIORITY = 0, 1, 2
Priority = Annotated[int, msgspec.Meta(ge=0, le=PRIORITY_LEVELS - 1)]
# What happens when a job's deadline passes while it waits: answered `expired` without being
# run (reject), or run all the same with its result marked late (run_late).
TimeoutAction = Literal["reject", "run_late"]
TIMEOUT_ACTIONS: tuple[str, ...] = get_args(TimeoutAction)

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
JOB_ID_RE = re.compile(JOB_ID_PATTERN)


# Model names and versions: what the registry can hold, and text every store accepts (no NUL).
_MODEL_PART = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")]


class ModelRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: _MODEL_PART
    version: _MODEL_PART

    def __str__(self) -> str:
        return f"{self.name}:{self.version}"


class Payload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Exactly one of: inline bytes (base64 in JSON; raw after the header in the envelope that
    codec.encode_event writes), inline text, or a URI to a local file."""

    data: bytes | None = None  # msgspec encodes bytes as base64 in JSON
    text: str | None = None
    uri: str | None = None
    content_type: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("data", "text", "uri") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"payload must have exactly one of data, text, uri; got {given or 'none'}"
            )


class MediaEvent(msgspec.Struct, frozen=True, omit_defaults=True):
    """A job as a producer publishes it. Keyed by job_id on the `events` topic."""

    job_id: str
    modality: Modality
    payload: Payload
    schema_version: int
    created_at: float  # epoch seconds, set by the producer
    model: ModelRef | None = None  # None: the modality's default model
    deadline: float | None = None  # epoch seconds; None: created_at + default budget
    attributes: dict[str, str] = {}
    priority: Priority = NORMAL_PRIORITY
    on_timeout: TimeoutAction = "reject"

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema_version {self.schema_version}; this build reads {SCHEMA_VERSION}"
            )
        if not JOB_ID_RE.match(self.job_id):
            raise ValueError(f"job_id must match {JOB_ID_PATTERN}")
        if self.modality == "text" and self.payload.text is None and self.payload.data is None:
            if self.payload.uri is None:
                raise ValueError("a text job needs payload.text, payload.data or payload.uri")
        if self.modality != "text" and self.payload.text is not None:
            # Decoders open a str as a path: inline text on a media job would bypass the URI rules.
            raise ValueError(f"payload.text is for text jobs; send {self.modality} as payload.data or payload.uri")
        if not math.isfinite(self.created_at) or (self.deadline is not None and not math.isfinite(self.deadline)):
            raise ValueError("created_at and deadline must be finite epoch seconds")


class Timings(msgspec.Struct, omit_defaults=True):
    """Milliseconds spent on one path through the pipeline (queue = waiting, others = work)."""

    queue_decode_ms: float = 0.0
    decode_ms: float = 0.0
    queue_preprocess_ms: float = 0.0
    preprocess_ms: float = 0.0
    queue_inference_ms: float = 0.0
    batch_wait_ms: float = 0.0
    execute_ms: float = 0.0
    queue_sink_ms: float = 0.0
    sink_ms: float = 0.0
    end_to_end_ms: float = 0.0
    batch_size: int = 0


class Prediction(msgspec.Struct, frozen=True):
    """One part of a job as the inference stage answers it."""

    job_id: str
    part: int
    parts: int
    kind: ItemKind
    modality: Modality
    model: ModelRef
    status: PredictionStatus
    created_at: float
    trace: dict[str, float]
    output: Any = None
    error: str | None = None
    meta: dict[str, Any] = {}
    weights: str = "pretrained"
    schema_version: int = SCHEMA_VERSION
    priority: int = NORMAL_PRIORITY
    late: bool = False  # ran although its deadline had passed (on_timeout = run_late)


class DeadLetter(msgspec.Struct, frozen=True):
    """Input a stage could not process, with the reason. The sink turns it into a failed job."""

    job_id: str  # "unknown:<topic>:<partition>:<offset>" when the event had no readable id
    stage: str
    reason: str  # machine-readable code, e.g. "malformed_event", "undecodable_media"
    detail: str  # human-readable explanation
    source_topic: str
    source_partition: int
    source_offset: int
    failed_at: float
    created_at: float | None = None
    modality: str | None = None
    payload_excerpt: bytes = b""  # first bytes of the raw message, for diagnosis
    schema_version: int = SCHEMA_VERSION


class JobStatus(msgspec.Struct, frozen=True):
    """A stage reporting that it has started work on a job."""

    job_id: str
    state: JobState
    at: float
    stage: str


class StatusReport(msgspec.Struct, frozen=True):
    """One stage process's status reports of one flush window (streams/status.py)."""

    entries: list[JobStatus]
    schema_version: int = SCHEMA_VERSION


class WorkerState(msgspec.Struct, frozen=True):
    """An inference worker's own report, for the router placing work onto `ready` (keyed by
    worker, on a compacted topic): what it owns, whether it can serve, how fast it drains."""

    worker: str  # host-pid
    partitions: list[int]  # of the ready topic, assigned to it now
    ready: bool  # started, models loaded, partitions assigned
    models: list[str]  # model names loaded
    item_s: float | None  # measured execute seconds per item (EWMA of batch time / size)
    waits_s: dict[str, float]  # measured queue wait per partition (EWMA), keys are partitions
    at: float  # epoch seconds of the report
    schema_version: int = SCHEMA_VERSION
    # Items the worker holds at `at` (taken from `ready`, not yet answered): its queue, exact,
    # where the group's committed lag also counts work finished since the last commit.
    # None from a writer that does not report it (the router then uses the lag).
    backlog: int | None = None


class JobResult(msgspec.Struct):
    """The one result per job_id: what the store holds and the `results` topic carries."""

    job_id: str
    status: ResultStatus
    modality: str
    model: ModelRef | None
    prediction: Any
    timings: Timings
    created_at: float
    completed_at: float
    error: dict[str, str] | None = None
    weights: str = "pretrained"
    parts: int = 1
    schema_version: int = SCHEMA_VERSION
    priority: int = NORMAL_PRIORITY
    late: bool = False  # some part ran after the job's deadline (on_timeout = run_late)
