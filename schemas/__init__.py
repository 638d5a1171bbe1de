"""Event, work-item and result contracts (versioned) and their serialisation."""

from mmpipe.schemas.codec import (
    BadMessage,
    WorkItem,
    decode_dead_letter,
    decode_event,
    decode_prediction,
    decode_result,
    decode_status,
    decode_work_item,
    encode_event,
    encode_work_item,
    peek_header,
    to_json,
)
from mmpipe.schemas.errors import Refused
from mmpipe.schemas.events import (
    SCHEMA_VERSION,
    DeadLetter,
    JobResult,
    JobStatus,
    MediaEvent,
    ModelRef,
    Payload,
    Prediction,
    Timings,
)

__all__ = [
    "SCHEMA_VERSION",
    "BadMessage",
    "DeadLetter",
    "JobResult",
    "JobStatus",
    "MediaEvent",
    "ModelRef",
    "Payload",
    "Prediction",
    "Refused",
    "Timings",
    "WorkItem",
    "decode_dead_letter",
    "decode_event",
    "decode_prediction",
    "decode_result",
    "decode_status",
    "decode_work_item",
    "encode_event",
    "encode_work_item",
    "peek_header",
    "to_json",
]
