"""Serialisation of the contracts: JSON (orjson) for events and results, a binary envelope for
work items that carry tensors.

JSON decoding is two steps on purpose: orjson parses (a syntax error says where), then msgspec
converts the dict into the typed struct (a type error says which field). Both become BadMessage
with a reason code, so a stage can send the input to the dead-letter topic with that reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np
import orjson

from mmpipe.schemas.events import (
    MODALITIES,
    NORMAL_PRIORITY,
    SCHEMA_VERSION,
    DeadLetter,
    JobResult,
    JobStatus,
    MediaEvent,
    ModelRef,
    Prediction,
)

T = TypeVar("T")


class BadMessage(ValueError):
    """A message that can never be processed; `reason` is a stable code for the DLQ."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def to_json(obj: Any) -> bytes:
    return orjson.dumps(msgspec.to_builtins(obj), option=orjson.OPT_SERIALIZE_NUMPY)


def from_json(raw: bytes, type_: type[T]) -> T:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadMessage("malformed_json", str(exc)) from None
    if not isinstance(data, dict):
        raise BadMessage("malformed_event", f"expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version is not None and version != SCHEMA_VERSION:
        raise BadMessage(
            "unsupported_schema_version",
            f"schema_version {version!r} is not supported; this build reads {SCHEMA_VERSION}",
        )
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        raise BadMessage("malformed_event", str(exc)) from None


def unknown_modality(modality: object) -> str:
    return f"modality {modality!r} is not one of {', '.join(MODALITIES)}"


def decode_event(raw: bytes) -> MediaEvent:
    if raw is None:
        raise BadMessage("malformed_event", "empty message (tombstone)")
    try:
        return from_json(raw, MediaEvent)
    except BadMessage as exc:
        modality = _peek_modality(raw)
        if modality is not None and modality not in MODALITIES:
            raise BadMessage("unknown_modality", unknown_modality(modality)) from exc
        raise


def _peek_modality(raw: bytes) -> object:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data.get("modality") if isinstance(data, dict) else None


def encode_event(event: MediaEvent) -> bytes:
    return to_json(event)


def decode_prediction(raw: bytes) -> Prediction:
    return from_json(raw, Prediction)


def decode_dead_letter(raw: bytes) -> DeadLetter:
    return from_json(raw, DeadLetter)


def decode_result(raw: bytes) -> JobResult:
    return from_json(raw, JobResult)


def decode_status(raw: bytes) -> JobStatus:
    return from_json(raw, JobStatus)


# --------------------------------------------------------------------------------------------
# Work items: a small JSON header followed by raw tensor bytes (no base64, no pickle).

_MAGIC = b"MMW1"
_HEADER = struct.Struct("!4sI")
_ALLOWED_DTYPES = {"uint8", "int16", "int32", "int64", "float16", "float32"}


@dataclass
class WorkItem:
    """One unit of model work: a frame, an audio clip or a text, with its job's context."""

    job_id: str
    part: int
    parts: int
    kind: str  # image | audio | text
    modality: str  # the job's modality (a video yields image and audio items)
    model: ModelRef
    created_at: float
    deadline: float
    trace: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    priority: int = NORMAL_PRIORITY  # scheduling, from the job's MediaEvent
    on_timeout: str = "reject"

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def encode_work_item(item: WorkItem) -> bytes:
    specs = []
    blobs = []
    for name, array in item.tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype.name not in _ALLOWED_DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {array.dtype}")
        specs.append({"name": name, "dtype": array.dtype.name, "shape": list(array.shape)})
        blobs.append(array.tobytes())
    header = orjson.dumps(
        {
            "v": SCHEMA_VERSION,
            "job_id": item.job_id,
            "part": item.part,
            "parts": item.parts,
            "kind": item.kind,
            "modality": item.modality,
            "model": [item.model.name, item.model.version],
            "created_at": item.created_at,
            "deadline": item.deadline,
            "trace": item.trace,
            "meta": item.meta,
            "tensors": specs,
            "priority": item.priority,
            "on_timeout": item.on_timeout,
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    return b"".join([_HEADER.pack(_MAGIC, len(header)), header, *blobs])


def peek_header(raw: bytes | None) -> dict[str, Any]:
    """Best effort, never raises: the JSON object of an event/record, or a work item's header
    (used to label dead letters with the job's modality and creation time)."""
    if not raw:
        return {}
    try:
        if raw[:4] == _MAGIC and len(raw) >= _HEADER.size:
            _, header_len = _HEADER.unpack_from(raw)
            data = orjson.loads(raw[_HEADER.size : _HEADER.size + header_len])
        else:
            data = orjson.loads(raw)
    except (orjson.JSONDecodeError, struct.error):
        return {}
    return data if isinstance(data, dict) else {}


def decode_work_item(raw: bytes) -> WorkItem:
    if raw is None or len(raw) < _HEADER.size:
        raise BadMessage("malformed_item", "work item shorter than its header")
    magic, header_len = _HEADER.unpack_from(raw)
    if magic != _MAGIC:
        raise BadMessage("malformed_item", f"bad magic {magic!r}")
    try:
        header = orjson.loads(raw[_HEADER.size : _HEADER.size + header_len])
        offset = _HEADER.size + header_len
        tensors: dict[str, np.ndarray] = {}
        for spec in header["tensors"]:
            dtype = np.dtype(spec["dtype"])
            if dtype.name not in _ALLOWED_DTYPES:
                raise ValueError(f"dtype {dtype} not allowed")
            shape = tuple(int(d) for d in spec["shape"])
            count = int(np.prod(shape)) if shape else 1
            nbytes = count * dtype.itemsize
            if offset + nbytes > len(raw):
                raise ValueError(f"tensor {spec['name']!r} runs past the message end")
            # Copy: torch wants writable memory and the Kafka buffer is immutable bytes.
            tensors[spec["name"]] = np.frombuffer(raw, dtype, count, offset).reshape(shape).copy()
            offset += nbytes
        name, version = header["model"]
        return WorkItem(
            job_id=header["job_id"],
            part=int(header["part"]),
            parts=int(header["parts"]),
            kind=header["kind"],
            modality=header["modality"],
            model=ModelRef(name, version),
            created_at=float(header["created_at"]),
            deadline=float(header["deadline"]),
            trace=dict(header["trace"]),
            meta=dict(header["meta"]),
            tensors=tensors,
            priority=int(header.get("priority", NORMAL_PRIORITY)),
            on_timeout=str(header.get("on_timeout", "reject")),
        )
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
        raise BadMessage("malformed_item", str(exc)) from None
