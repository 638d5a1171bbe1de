"""The HTTP job API: submit jobs, read their status and result, or wait for a result.

    POST /v1/jobs          asynchronous: persist + publish, 202 {job_id, status, status_url}
    GET  /v1/jobs/{id}     the job's state, per-state timestamps and (when done) its result
    POST /v1/predict       synchronous: publish, wait up to timeout_s, 200 with the result
                           (or 202 with the job to poll when the wait runs out)
    GET  /healthz          liveness: the process is up
    GET  /readyz           readiness: broker, store and results listener, each reported

A job is a JSON body {modality, uri | text | data_b64, model?, deadline_s?, job_id?} or a
multipart upload (`file` plus the same fields). Every refusal is a 4xx with a JSON body
{"error": code, "detail": message}. /v1 routes need `Authorization: Bearer <api_token>` when
settings.api_token is set. Request bodies are limited before they are read whole.

Waiting does not poll the store: one consumer of the `results` topic per process resolves the
waiting requests (see mmpipe.api_runtime.ResultListener).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmpipe.api_runtime import BrokerLink, BrokerUnavailable, ResultListener, StoreWorker
from mmpipe.client import guess_modality, make_event, parse_model
from mmpipe.stages.decode.inputs import InputError, resolve_local_uri
from mmpipe.schemas.settings import Settings, load_settings, redact_url, secret
from mmpipe.stages.sink.store import JobRecord, StoreUnavailable
from mmpipe.stages.sink.store.base import TERMINAL_STATE
from mmpipe.models.base import ModelSpec, UnknownModel, WrongModality
from mmpipe.models.registry import all_specs, resolve
from mmpipe.schemas import JobResult, MediaEvent
from mmpipe.schemas.codec import unknown_modality
from mmpipe.schemas.events import JOB_ID_PATTERN, JOB_ID_RE, MODALITIES, NORMAL_PRIORITY, PRIORITY_LEVELS, TimeoutAction

log = logging.getLogger(__name__)

FINISHED_STATES = frozenset(TERMINAL_STATE.values())
# Room in a request body beyond the payload: multipart framing, the small form fields, JSON keys.
ENVELOPE_BYTES = 64 * 1024
READY_CHECK_TIMEOUT_S = 2.0
RETRY_AFTER_S = "2"


# Errors -----------------------------------------------------------------------------------------
class ApiError(Exception):
    """A refusal with a stable code; becomes {"error": code, "detail": detail}."""

    def __init__(self, status: int, code: str, detail: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra  # more fields of the body (a recorded job's job_id)


class RequestTooLarge(ApiError):
    def __init__(self, limit: int, seen: str) -> None:
        super().__init__(413, "request_too_large", f"request body {seen}; the limit is {limit} bytes")


# (status, code) per mmpipe.stages.decode.inputs refusal reason
INPUT_ERRORS = {
    "remote_uri_refused": (403, "remote_uri_refused"),
    "uri_outside_input_roots": (403, "uri_outside_input_roots"),
    "remote_uri_unsupported": (422, "remote_uri_unsupported"),
    "file_not_found": (422, "file_not_found"),
    "bad_uri": (422, "bad_uri"),
    "payload_too_large": (413, "payload_too_large"),
}

HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(status: int, code: str, detail: str, headers: dict[str, str] | None = None, **extra: Any) -> Response:
    return json_response(status, {"error": code, "detail": detail, **extra}, headers)


# Contracts (also what /openapi.json shows) ------------------------------------------------------
def _as_enum(schema: dict[str, Any], values: tuple[str, ...]) -> None:
    schema.pop("anyOf", None)
    schema.update(type="string", enum=list(values))


class JobRequest(BaseModel):
    """A job as JSON. Give exactly one payload: `uri`, `text` or `data_b64`."""

    model_config = ConfigDict(extra="forbid")

    # Checked by hand (not a Literal) so an unknown modality gets its own error code.
    modality: str | None = Field(
        None,
        description="image | audio | video | text (required; for an upload it may be told by the file name)",
        json_schema_extra=lambda schema: _as_enum(schema, MODALITIES),
    )
    uri: str | None = Field(None, description="a local file under the server's input roots (path or file://)")
    text: str | None = Field(None, description="inline text (modality text only)")
    data_b64: str | None = Field(None, description="inline media bytes, base64")
    model: str | None = Field(None, description="NAME:VERSION; default: the modality's model", examples=["resnet18:imagenet1k-v1"])
    deadline_s: float | None = Field(None, gt=0, description="seconds the job may take before it is answered as expired")
    priority: int = Field(NORMAL_PRIORITY, ge=0, le=PRIORITY_LEVELS - 1, description="0 = high .. 2 = low")
    on_timeout: TimeoutAction = Field(
        "reject", description="when the deadline passes while the job waits: reject (answer expired) or run_late"
    )
    job_id: str | None = Field(
        None, pattern=JOB_ID_PATTERN, description="your id for the job: submitting it again returns the same job"
    )


class PredictRequest(JobRequest):
    timeout_s: float | None = Field(None, gt=0, description="how long to wait for the result (bounded by the server)")


class JobAccepted(BaseModel):
    job_id: str
    status: str = Field(description="accepted")
    status_url: str


class JobView(BaseModel):
    job_id: str
    status: str = Field(description="accepted | decoding | preprocessing | inferring | done | failed | expired | rejected")
    status_url: str
    modality: str | None = None
    model: str | None = None
    created_at: float | None = None
    updated_at: float | None = None
    timestamps: dict[str, float] = Field(default_factory=dict, description="epoch seconds each state was reached")
    published: bool = Field(True, description="false while the job's event is not in Kafka: its publish is under way "
                            "or failed; if it stays false, submit the same job again")
    result: dict[str, Any] | None = Field(None, description="the JobResult, once the job has finished")


class PredictPending(BaseModel):
    job_id: str
    status: str
    status_url: str
    detail: str


class ErrorBody(BaseModel):
    error: str = Field(description="a stable code, e.g. unknown_model, uri_outside_input_roots")
    detail: str
    job_id: str | None = Field(None, description="on a 503 after the job was recorded: submit it again with this job_id")


class Liveness(BaseModel):
    status: str


class Check(BaseModel):
    ok: bool
    detail: str


class Readiness(BaseModel):
    status: str
    checks: dict[str, Check]


def _request_body(model: type[JobRequest]) -> dict[str, Any]:
    """Both accepted encodings of the body, for the OpenAPI spec (the route parses it itself)."""
    json_schema = model.model_json_schema()
    form_schema = {
        "type": "object",
        "properties": {
            "file": {"type": "string", "format": "binary", "description": "the media file"},
            **{k: v for k, v in json_schema["properties"].items() if k != "data_b64"},
        },
    }
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": json_schema}, "multipart/form-data": {"schema": form_schema}},
        }
    }


REFUSALS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": description}
    for status, description in {
        400: "malformed JSON or multipart body",
        401: "missing or wrong bearer token",
        403: "URI outside the input roots, or a remote URI",
        413: "request or payload over the limit",
        415: "neither application/json nor multipart/form-data",
        422: "invalid job: unknown modality, bad or unknown model, missing payload...",
        503: "broker or store unavailable (Retry-After)",
    }.items()
}


# Request body limit -----------------------------------------------------------------------------
class BodyLimitMiddleware:
    """Refuses a request body over the limit before it is read whole: at once when its
    Content-Length says so, else while the app reads it, by counting (a chunked client, or one
    that sends more than it declared, is cut off at the limit)."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = self.limit_for(headers.get("content-type", "").lower())
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            error = RequestTooLarge(limit, f"declares {declared} bytes")
            await error_response(error.status, error.code, error.detail, {"Connection": "close"})(scope, receive, send)
            return
        await self.app(scope, _counting_receive(receive, limit), send)


def _counting_receive(receive: Receive, limit: int) -> Receive:
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise RequestTooLarge(limit, f"passed {limit} bytes")
        return message

    return counted


def body_limits(settings: Settings) -> Callable[[str], int]:
    upload = settings.api_max_upload_bytes
    json_limit = 4 * math.ceil(upload / 3) + ENVELOPE_BYTES  # base64 makes 4 bytes of every 3

    def limit_for(content_type: str) -> int:
        return json_limit if content_type.startswith("application/json") else upload + ENVELOPE_BYTES

    return limit_for


def payload_limit(settings: Settings) -> int:
    """An inline payload must fit the upload limit and what the decode stage accepts."""
    return min(settings.api_max_upload_bytes, settings.max_payload_bytes)


# Auth -------------------------------------------------------------------------------------------
OPENAPI_URL = "/openapi.json"
bearer_scheme = HTTPBearer(auto_error=False, description="Authorization: Bearer <MMPIPE_API_TOKEN>")


def _holds_token(settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> bool:
    """True with no token configured, else only for the right bearer token."""
    token = secret(settings.api_token)
    if not token:
        return True
    return credentials is not None and hmac.compare_digest(credentials.credentials.encode(), token.encode())


def bearer_auth(token: str) -> Callable[..., Awaitable[None]]:
    expected = token.encode()

    async def require_token(credentials: HTTPAuthorizationCredentials | None = Security(bearer_scheme)) -> None:
        if credentials is None:
            raise ApiError(401, "missing_token", "this API needs an 'Authorization: Bearer <token>' header",
                           {"WWW-Authenticate": 'Bearer realm="mmpipe"'})
        # Constant time, so the comparison does not tell how much of a guess was right.
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise ApiError(401, "invalid_token", "the bearer token is not valid",
                           {"WWW-Authenticate": 'Bearer realm="mmpipe", error="invalid_token"'})

    return require_token


# Reading and checking a job ---------------------------------------------------------------------
@dataclass(frozen=True)
class Upload:
    data: bytes
    filename: str | None


async def read_job_request(
    request: Request, model: type[JobRequest], settings: Settings
) -> tuple[JobRequest, Upload | None]:
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("application/json"):
        return _validate(model, _parse_json(await request.body())), None
    if content_type.startswith("multipart/form-data"):
        return await _read_form(request, model, settings)
    raise ApiError(415, "unsupported_media_type", "send application/json or multipart/form-data")


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", f"the body must be a JSON object, not {type(data).__name__}")
    return data


def _validate(model: type[JobRequest], data: dict[str, Any]) -> JobRequest:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
        raise ApiError(422, "invalid_request", detail) from None


async def _read_form(request: Request, model: type[JobRequest], settings: Settings) -> tuple[JobRequest, Upload | None]:
    async with request.form(max_files=1, max_fields=16) as form:
        fields = {key: value for key, value in form.items() if isinstance(value, str) and key != "file"}
        job = _validate(model, fields)
        file = form.get("file")
        if file is None:
            return job, None
        if not isinstance(file, UploadFile):
            raise ApiError(422, "invalid_request", "`file` must be a file part (with a filename), not a text field")
        limit = payload_limit(settings)
        if file.size is not None and file.size > limit:
            raise ApiError(413, "payload_too_large", f"the uploaded file is {file.size} bytes; the limit is {limit}")
        return job, Upload(await file.read(), file.filename)


async def build_event(job: JobRequest, upload: Upload | None, settings: Settings) -> tuple[MediaEvent, str]:
    """The event to publish and the label of the model that will serve it; ApiError if invalid."""
    modality = _modality(job, upload)
    spec = _model_spec(job.model, modality, settings)  # before the payload: no file looked at for a bad job
    payload = await _payload(job, upload, modality, settings)
    try:
        event = make_event(
            modality, job_id=job.job_id, model=spec.ref if job.model else None, deadline_s=job.deadline_s,
            priority=job.priority, on_timeout=job.on_timeout, **payload
        )
    except ValueError as exc:
        raise ApiError(422, "invalid_job", str(exc)) from None
    return event, str(spec.ref)


def _modality(job: JobRequest, upload: Upload | None) -> str:
    modality = job.modality
    if modality is None and upload is not None and upload.filename:
        try:
            modality = guess_modality(Path(upload.filename))
        except ValueError as exc:
            raise ApiError(422, "missing_modality", str(exc).replace("--modality", "`modality`")) from None
    if modality is None:
        raise ApiError(422, "missing_modality", f"`modality` is required: one of {', '.join(MODALITIES)}")
    if modality not in MODALITIES:
        raise ApiError(422, "unknown_modality", unknown_modality(modality))
    return modality


async def _payload(job: JobRequest, upload: Upload | None, modality: str, settings: Settings) -> dict[str, Any]:
    given = [name for name, value in (("file", upload), ("uri", job.uri), ("text", job.text),
                                      ("data_b64", job.data_b64)) if value is not None]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise ApiError(422, "missing_payload" if not given else "ambiguous_payload",
                       f"give exactly one payload (a file upload, uri, text or data_b64); got {what}")
    limit = payload_limit(settings)
    if upload is not None:
        return {"data": _within(upload.data, limit, "the uploaded file")}
    if job.text is not None:
        if modality != "text":
            raise ApiError(422, "invalid_request", f"`text` is for modality text; send a {modality} as a file, uri or data_b64")
        _within(job.text.encode("utf-8"), limit, "the text")
        return {"text": job.text}
    if job.data_b64 is not None:
        return {"data": _within(_b64decode(job.data_b64), limit, "data_b64")}
    return {"uri": await _checked_uri(job.uri or "", settings)}


def _within(data: bytes, limit: int, what: str) -> bytes:
    if len(data) > limit:
        raise ApiError(413, "payload_too_large", f"{what} is {len(data)} bytes; the limit is {limit}")
    return data


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(422, "bad_base64", f"data_b64 is not valid base64: {exc}") from None


async def _checked_uri(uri: str, settings: Settings) -> str:
    """The file's real path (the rules of mmpipe.stages.decode.inputs: under an input root, no traversal, no
    symlink escape, remote only if allowed). The decode stage checks it again when it reads."""
    try:
        return str(await asyncio.to_thread(resolve_local_uri, uri, settings))
    except InputError as exc:
        status, code = INPUT_ERRORS.get(exc.reason, (422, exc.reason))
        raise ApiError(status, code, exc.detail) from None


def _model_spec(text: str | None, modality: str, settings: Settings) -> ModelSpec:
    try:
        ref = parse_model(text)
    except ValueError:
        raise ApiError(422, "bad_model", f"model must be NAME:VERSION (e.g. resnet18:imagenet1k-v1), got {text!r}") from None
    try:
        spec = resolve(ref, modality)
    except UnknownModel as exc:
        raise ApiError(422, "unknown_model", str(exc)) from None
    except WrongModality as exc:
        raise ApiError(422, "wrong_modality", str(exc)) from None
    if spec.config.name not in settings.models:
        raise ApiError(422, "model_not_served", f"{spec.ref} is not served here; served: {', '.join(settings.models)}")
    return spec


# The process's state --------------------------------------------------------------------------
class ApiRuntime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = StoreWorker(settings.store_url)
        self.link = BrokerLink(settings)
        self.listener = ResultListener(settings, self.store.get_result)
        self.sync_waiters = 0

    async def start(self) -> None:
        await asyncio.to_thread(all_specs)  # imports torch once, before the first request needs it
        try:
            await self.store.ensure_schema()
        except StoreUnavailable as exc:
            log.warning("store %s not reachable at start-up (readiness will say so): %s", redact_url(self.settings.store_url), exc)
        self.listener.start()

    async def stop(self) -> None:
        await self.listener.stop()
        await self.link.close()
        await self.store.close()

    async def submit(self, event: MediaEvent, model: str) -> bool:
        """Record and publish a new job. False, publishing nothing, when the job_id is known
        and its event reached Kafka. A job recorded whose publish failed (the store says so,
        so this holds across API restarts) is published by its resubmission; a duplicate
        event from a race here costs work, never a second result (the sink keys by job_id)."""
        await self.link.producer()  # a broker that is down refuses before anything is recorded
        created = await self.store.accept_job(event, model)
        if not created and not await self.store.is_unpublished(event.job_id):
            return False
        try:
            await self.link.publish(event)
            await self.store.mark_accepted(event.job_id)
        except (BrokerUnavailable, StoreUnavailable) as exc:
            # Recorded now: the client must learn the ID (perhaps ours) to publish it by a retry.
            code = "broker_unavailable" if isinstance(exc, BrokerUnavailable) else "store_unavailable"
            raise ApiError(503, code, f"{exc}; the job is recorded: submit it again with job_id {event.job_id!r}",
                           {"Retry-After": RETRY_AFTER_S}, job_id=event.job_id) from exc
        return True

    @contextlib.asynccontextmanager
    async def sync_slot(self) -> AsyncIterator[None]:
        """Admission for /v1/predict: a bounded number of requests wait at once."""
        if not self.listener.running:
            raise ApiError(503, "results_listener_down", "not following results right now; use POST /v1/jobs or retry",
                           {"Retry-After": RETRY_AFTER_S})
        if self.sync_waiters >= self.settings.api_max_sync_waiters:
            raise ApiError(503, "too_many_waiters",
                           f"{self.sync_waiters} requests are already waiting for results; retry later or use POST /v1/jobs",
                           {"Retry-After": "1"})
        self.sync_waiters += 1
        try:
            yield
        finally:
            self.sync_waiters -= 1

    async def readiness(self) -> dict[str, dict[str, Any]]:
        broker, store = await asyncio.gather(
            _check(self.link.check(READY_CHECK_TIMEOUT_S)), _check(self.store.check(READY_CHECK_TIMEOUT_S))
        )
        listener = {"ok": True, "detail": f"following {self.listener.topic}"} if self.listener.running else {
            "ok": False, "detail": f"not following {self.listener.topic}: {self.listener.last_error or 'connecting'}"}
        return {"broker": broker, "store": store, "results_listener": listener}


async def _check(probe: Awaitable[None]) -> dict[str, Any]:
    try:
        await probe
    except Exception as exc:  # any failure is an answer here, never a 500
        return {"ok": False, "detail": str(exc) or type(exc).__name__}
    return {"ok": True, "detail": "ok"}


# Views ------------------------------------------------------------------------------------------
def status_url(request: Request, job_id: str) -> str:
    return f"{request.scope.get('root_path', '')}/v1/jobs/{quote(job_id, safe=':@')}"


def view_of_record(request: Request, record: JobRecord, result: JobResult | None) -> dict[str, Any]:
    return {
        "job_id": record.job_id,
        "status": record.state,
        "status_url": status_url(request, record.job_id),
        "modality": record.modality,
        "model": record.model,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "timestamps": record.state_times,
        # Recorded before the publish, stamped `accepted` after it: no stamp, no event in Kafka.
        "published": record.state != "accepted" or "accepted" in record.state_times,
        "result": None if result is None else msgspec.to_builtins(result),
    }


def view_of_result(request: Request, result: JobResult) -> dict[str, Any]:
    return {
        "job_id": result.job_id,
        "status": TERMINAL_STATE[result.status],
        "status_url": status_url(request, result.job_id),
        "modality": result.modality,
        "model": None if result.model is None else str(result.model),
        "created_at": result.created_at,
        "updated_at": result.completed_at,
        "timestamps": {"finished": result.completed_at},
        "published": True,
        "result": msgspec.to_builtins(result),
    }


async def job_view(runtime: ApiRuntime, request: Request, job_id: str) -> dict[str, Any] | None:
    record = await runtime.store.get_job(job_id)
    if record is None:
        return None
    # The result row and the finished state are written in one transaction: no result before.
    result = await runtime.store.get_result(job_id) if record.state in FINISHED_STATES else None
    return view_of_record(request, record, result)


# Routes -----------------------------------------------------------------------------------------
def jobs_router(runtime: ApiRuntime) -> APIRouter:
    settings = runtime.settings
    auth = [Depends(bearer_auth(secret(settings.api_token)))] if settings.api_token else []
    router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=auth, responses=REFUSALS)

    @router.post(
        "/jobs", status_code=202, response_model=JobAccepted, summary="Submit a job (asynchronous)",
        description="Records the job and publishes it; poll `status_url`. Idempotent on `job_id`: a known "
        "job_id answers 200 with that job's current status and publishes nothing.",
        responses={200: {"model": JobView, "description": "the job_id is already known"}},
        openapi_extra=_request_body(JobRequest),
    )
    async def submit_job(request: Request) -> Response:
        job, upload = await read_job_request(request, JobRequest, settings)
        event, model = await build_event(job, upload, settings)
        if not await runtime.submit(event, model):
            return json_response(200, await job_view(runtime, request, event.job_id))
        url = status_url(request, event.job_id)
        return json_response(202, {"job_id": event.job_id, "status": "accepted", "status_url": url}, {"Location": url})

    @router.get(
        "/jobs/{job_id}", response_model=JobView, summary="A job's status and result",
        description="The job's state, the time it reached each state, and its result once finished.",
    )
    async def get_job(job_id: str, request: Request) -> Response:
        # No job can have an ID outside the pattern, and the store need not see one (NUL bytes).
        view = await job_view(runtime, request, job_id) if JOB_ID_RE.match(job_id) else None
        if view is None:
            raise ApiError(404, "unknown_job", f"no job {job_id!r}")
        return json_response(200, view)

    @router.post(
        "/predict", response_model=JobView, summary="Run a job and wait for its result (synchronous)",
        description="Same body as POST /v1/jobs plus `timeout_s`. Answers 200 with the result, or 202 with the "
        f"job to poll when the wait runs out (at most {settings.api_predict_max_timeout_s:g} s). Beyond "
        f"{settings.api_max_sync_waiters} concurrent waits: 503 with Retry-After.",
        responses={202: {"model": PredictPending, "description": "still running after timeout_s: poll status_url"}},
        openapi_extra=_request_body(PredictRequest),
    )
    async def predict(
        request: Request,
        timeout_s: float | None = Query(None, gt=0, description="seconds to wait for the result (overrides the body's)"),
    ) -> Response:
        started = time.monotonic()
        async with runtime.sync_slot():
            job, upload = await read_job_request(request, PredictRequest, settings)
            event, model = await build_event(job, upload, settings)
            asked_s = timeout_s or (job.timeout_s if isinstance(job, PredictRequest) else None)
            wait_s = min(asked_s or settings.api_predict_timeout_s, settings.api_predict_max_timeout_s)
            result = await _run_and_wait(runtime, event, model, started + wait_s)
        if result is None:
            return await _still_running(runtime, request, event.job_id, wait_s)
        return json_response(200, view_of_result(request, result))

    return router


async def _run_and_wait(runtime: ApiRuntime, event: MediaEvent, model: str, deadline: float) -> JobResult | None:
    """Submit the job and wait for its result until `deadline` (monotonic); None if it ran out."""
    # Registered before publishing, while the listener's offsets are pinned: the result cannot
    # go by unseen. A job that was already known may have finished before: ask the store once.
    waiter = runtime.listener.register(event.job_id)
    try:
        if not await runtime.submit(event, model):
            stored = await runtime.store.get_result(event.job_id)
            if stored is not None:
                return stored
        with contextlib.suppress(asyncio.TimeoutError):
            return await asyncio.wait_for(waiter, max(deadline - time.monotonic(), 0))
        return None
    finally:
        runtime.listener.release(event.job_id, waiter)


async def _still_running(runtime: ApiRuntime, request: Request, job_id: str, waited_s: float) -> Response:
    state = "accepted"
    with contextlib.suppress(StoreUnavailable):
        record = await runtime.store.get_job(job_id)
        state = record.state if record is not None else state
    url = status_url(request, job_id)
    return json_response(
        202,
        {"job_id": job_id, "status": state, "status_url": url,
         "detail": f"timed out after {waited_s:g} s waiting for the result; poll status_url"},
        {"Location": url},
    )


def health_router(runtime: ApiRuntime) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/healthz", response_model=Liveness, summary="Liveness: the process is up")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get(
        "/readyz", response_model=Readiness, summary="Readiness: broker, store and results listener",
        description="200 when the broker answers a metadata request, the store answers a query and the results "
        "listener is following the results topic; else 503 naming the failed check.",
        responses={503: {"model": Readiness, "description": "a dependency is not ready"}},
    )
    async def readyz(credentials: HTTPAuthorizationCredentials | None = Security(bearer_scheme)) -> Response:
        checks = await runtime.readiness()
        ready = all(check["ok"] for check in checks.values())
        body: dict[str, Any] = {"status": "ready" if ready else "not ready"}
        # The checks' details (hosts, exception text) only for those holding the token.
        if _holds_token(runtime.settings, credentials):
            body["checks"] = checks
        return json_response(200 if ready else 503, body)

    return router


def docs_router(app: FastAPI, settings: Settings) -> APIRouter:
    """The OpenAPI document and its two viewers. With a token set they need it like /v1 does:
    the document lists every route and field, which is a map for whoever probes the API. (A
    browser sends no bearer header by itself: read them with a client that does.)"""
    auth = [Depends(bearer_auth(secret(settings.api_token)))] if settings.api_token else []
    router = APIRouter(dependencies=auth, include_in_schema=False)

    @router.get(OPENAPI_URL)
    async def openapi_document() -> Response:
        return json_response(200, app.openapi())

    @router.get("/docs")
    async def swagger_ui() -> Response:
        return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{app.title} - docs")

    @router.get("/redoc")
    async def redoc() -> Response:
        return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{app.title} - ReDoc")

    return router


# Error handlers ---------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.code, exc.detail, exc.headers, **exc.extra)

    async def invalid_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        detail = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(422, "invalid_request", detail)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        return error_response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))

    async def unavailable(request: Request, exc: Exception) -> Response:
        code = "broker_unavailable" if isinstance(exc, BrokerUnavailable) else "store_unavailable"
        return error_response(503, code, str(exc), {"Retry-After": RETRY_AFTER_S})

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(BrokerUnavailable, unavailable)
    app.add_exception_handler(StoreUnavailable, unavailable)


# The app ----------------------------------------------------------------------------------------
def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    runtime = ApiRuntime(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(
        title="mmpipe job API",
        version="1",
        summary="Submit media jobs to the mmpipe pipeline and read their results.",
        lifespan=lifespan,
        docs_url=None, redoc_url=None, openapi_url=None,  # served by docs_router, behind the token
    )
    app.state.runtime = runtime
    app.add_middleware(BodyLimitMiddleware, limit_for=body_limits(settings))
    install_error_handlers(app)
    app.include_router(health_router(runtime))
    app.include_router(jobs_router(runtime))
    if settings.api_docs:
        app.include_router(docs_router(app, settings))
    app.add_api_route("/metrics", metrics_page, include_in_schema=False)
    return app


def metrics_page() -> Response:
    """What compose's Prometheus scrapes: the process's own metrics (CPU, memory, file
    descriptors, GC) from prometheus-client's default registry."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
