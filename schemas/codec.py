"""Serialisation of the contracts: JSON for results, a binary envelope for work items that
carry tensors, and events in either (JSON, or a JSON header and the payload's raw bytes).

JSON is decoded in one typed pass (msgspec.json.decode with the target type): a syntax error
says where, a type error names the path of the bad field. Both become Refused with a reason
code, so a stage can send the input to the dead-letter topic with that reason. Work items are
checked against their own size before any tensor is copied: shapes are non-negative with a
bounded element count, and the tensors exactly fill the message after the header.
"""

from __future__ import annotations

import hashlib
import math
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
    MediaEvent,
    ModelRef,
    Prediction,
    StatusReport,
)

from mmpipe.schemas.errors import BadMessage, Refused  # noqa: F401  (BadMessage: re-exported)

T = TypeVar("T")


def to_json(obj: Any) -> bytes:
    return orjson.dumps(msgspec.to_builtins(obj), option=orjson.OPT_SERIALIZE_NUMPY)


class _Envelope(msgspec.Struct):
    """The fields that name a refusal's reason, read only when typed decoding failed."""

    schema_version: Any = None
    modality: Any = None


def from_json(raw: bytes, type_: type[T]) -> T:
    try:
        obj = msgspec.json.decode(raw, type=type_, strict=False)
    except msgspec.ValidationError as exc:
        raise _refusal(raw, exc) from None
    except msgspec.DecodeError as exc:
        raise Refused("malformed_json", str(exc)) from None
    _check_version(getattr(obj, "schema_version", None))
    return obj


def _check_version(version: object) -> None:
    if version is not None and version != SCHEMA_VERSION:
        raise Refused(
            "unsupported_schema_version",
            f"schema_version {version!r} is not supported; this build reads {SCHEMA_VERSION}",
        )


def _refusal(raw: bytes, exc: msgspec.ValidationError) -> Refused:
    """The reason a well-formed JSON document was refused: a version or modality this build
    does not know says so; any other type error is a malformed event (with the field path)."""
    try:
        envelope = msgspec.json.decode(raw, type=_Envelope)
    except msgspec.DecodeError:  # not an object at all
        return Refused("malformed_event", str(exc))
    try:
        _check_version(envelope.schema_version)
    except Refused as refused:
        return refused
    modality = envelope.modality
    if modality is not None and modality not in MODALITIES:
        return Refused("unknown_modality", unknown_modality(modality))
    return Refused("malformed_event", str(exc))


def unknown_modality(modality: object) -> str:
    return f"modality {modality!r} is not one of {', '.join(MODALITIES)}"


# Events: JSON, or (what this project's producers write for inline bytes) the event's JSON as a
# header followed by the payload's raw bytes: no base64 (a third more bytes through the broker)
# to write, carry and parse. Its payload in the header is {"data": ""}; the bytes follow.
_EVENT_MAGIC = b"MME1"


def decode_event(raw: bytes) -> MediaEvent:
    if raw is None:
        raise Refused("malformed_event", "empty message (tombstone)")
    if raw[:4] != _EVENT_MAGIC:
        return from_json(raw, MediaEvent)
    _, offset = _envelope_header(raw, "malformed_event", "event envelope")
    event = from_json(memoryview(raw)[_HEADER.size:offset], MediaEvent)
    if event.payload.data != b"":
        raise Refused("malformed_event", 'an event envelope\'s header must say payload {"data": ""}: its bytes follow it')
    return msgspec.structs.replace(event, payload=msgspec.structs.replace(event.payload, data=raw[offset:]))


def payload_digest(event: MediaEvent) -> str:
    """What a job asks for (modality, model, payload; a URI by its text), as a short hash: the
    sink refuses a job ID reused for a different one (job_id_conflict) instead of merging."""
    digest = hashlib.blake2b(digest_size=16)
    for field_ in (event.modality, str(event.model), event.payload.uri or "", event.payload.text or ""):
        digest.update(field_.encode() + b"\0")
    digest.update(event.payload.data or b"")
    return digest.hexdigest()


def encode_event(event: MediaEvent) -> bytes:
    """Inline bytes as an envelope (JSON header, then the raw bytes); text and URIs as JSON."""
    data = event.payload.data
    if data is None:
        return to_json(event)
    header = to_json(msgspec.structs.replace(event, payload=msgspec.structs.replace(event.payload, data=b"")))
    return b"".join([_HEADER.pack(_EVENT_MAGIC, len(header)), header, data])


def decode_prediction(raw: bytes) -> Prediction:
    return from_json(raw, Prediction)


def decode_dead_letter(raw: bytes) -> DeadLetter:
    return from_json(raw, DeadLetter)


def decode_result(raw: bytes) -> JobResult:
    return from_json(raw, JobResult)


def decode_status(raw: bytes) -> StatusReport:
    return from_json(raw, StatusReport)


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


def failed_part(item: WorkItem, refused: Refused) -> Prediction:
    """The answer for one part of a multi-part job that failed on its own (a bad frame): the
    job completes with this part's error beside the other parts' outputs."""
    return Prediction(
        job_id=item.job_id, part=item.part, parts=item.parts, kind=item.kind,  # type: ignore[arg-type]
        modality=item.modality, model=item.model, status="error",  # type: ignore[arg-type]
        created_at=item.created_at, trace=item.trace, meta=item.meta,
        error=f"{refused.reason}: {refused.detail}",
    )


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
        if raw[:4] in (_MAGIC, _EVENT_MAGIC) and len(raw) >= _HEADER.size:
            _, header_len = _HEADER.unpack_from(raw)
            data = orjson.loads(raw[_HEADER.size : _HEADER.size + header_len])
        else:
            data = orjson.loads(raw)
    except (orjson.JSONDecodeError, struct.error):
        return {}
    return data if isinstance(data, dict) else {}


class _TensorSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]


class _ItemHeader(msgspec.Struct):
    job_id: str
    part: int
    parts: int
    kind: str
    modality: str
    model: tuple[str, str]
    created_at: float
    deadline: float
    trace: dict[str, float]
    meta: dict[str, Any]
    tensors: list[_TensorSpec]
    priority: int = NORMAL_PRIORITY
    on_timeout: str = "reject"


def _envelope_header(raw: bytes, reason: str, what: str) -> tuple[bytes, int]:
    """(magic, end of the JSON header) of an envelope (magic, header length, JSON header, then
    bytes), checked against the message's own size before anything is read from it."""
    if len(raw) < _HEADER.size:
        raise Refused(reason, f"{what} shorter than its header")
    magic, header_len = _HEADER.unpack_from(raw)
    offset = _HEADER.size + header_len
    if offset > len(raw):
        raise Refused(reason, f"{what} header of {header_len} bytes runs past the message end")
    return magic, offset


def decode_work_item(raw: bytes) -> WorkItem:
    if raw is None:
        raise Refused("malformed_item", "work item shorter than its header")
    magic, offset = _envelope_header(raw, "malformed_item", "work item")
    if magic != _MAGIC:
        raise Refused("malformed_item", f"bad magic {magic!r}")
    try:
        header = msgspec.json.decode(memoryview(raw)[_HEADER.size : offset], type=_ItemHeader)
    except msgspec.DecodeError as exc:
        raise Refused("malformed_item", str(exc)) from None
    if not 0 <= header.part < header.parts:
        raise Refused("malformed_item", f"part {header.part} is not within parts {header.parts}")
    layout = _tensor_layout(header.tensors, offset, len(raw))
    # Copy: torch wants writable memory and the Kafka buffer is immutable bytes.
    tensors = {
        spec.name: np.frombuffer(raw, dtype, count, start).reshape(spec.shape).copy()
        for spec, dtype, count, start in layout
    }
    name, version = header.model
    return WorkItem(
        job_id=header.job_id,
        part=header.part,
        parts=header.parts,
        kind=header.kind,
        modality=header.modality,
        model=ModelRef(name, version),
        created_at=header.created_at,
        deadline=header.deadline,
        trace=header.trace,
        meta=header.meta,
        tensors=tensors,
        priority=header.priority,
        on_timeout=header.on_timeout,
    )


def _tensor_layout(specs: list[_TensorSpec], offset: int, size: int) -> list[tuple[_TensorSpec, np.dtype, int, int]]:
    """Where each tensor lies in the message, checked before anything is copied: known dtypes,
    dimensions >= 0, and tensors that exactly fill the bytes after the header (so no spec can
    claim more memory than the message itself brought)."""
    layout = []
    for spec in specs:
        if spec.dtype not in _ALLOWED_DTYPES:
            raise Refused("malformed_item", f"tensor {spec.name!r}: dtype {spec.dtype!r} not allowed")
        if any(not 0 <= d <= size for d in spec.shape):
            raise Refused("malformed_item", f"tensor {spec.name!r}: dimension out of range in {spec.shape}")
        dtype = np.dtype(spec.dtype)
        count = math.prod(spec.shape)  # exact integer: no overflow to a small or negative count
        end = offset + count * dtype.itemsize
        if end > size:
            raise Refused("malformed_item", f"tensor {spec.name!r} {spec.shape} runs past the message end")
        layout.append((spec, dtype, count, offset))
        offset = end
    if offset != size:
        raise Refused("malformed_item", f"{size - offset} bytes after the last tensor")
    return layout
