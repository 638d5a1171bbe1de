"""The result store: one result row per job_id, written idempotently.

The contract every backend keeps (SQLite embedded default, PostgreSQL in production):

* parts: first write wins. A redelivered part with the same model is a no-op; one from a
  different model version is recorded in `conflicts` and does not replace the first. A part
  of another job reusing the job ID (another payload digest) is recorded in `conflicts` and
  refused as job_id_conflict, never merged.
* results: one row per job_id. The sink assembles it from the parts inside the same
  transaction that stores the last part, so two sinks racing on one job still make one row.
  Once a result exists it never changes; later arrivals get the stored row back (to re-publish
  it if publishing had not been confirmed), and a differing one is recorded as a conflict.
* jobs: a status row per job that only moves forward (accepted -> decoding -> preprocessing
  -> inferring -> done | failed | expired | rejected), with a timestamp per state. Status
  reports (decoding, preprocessing) are a live view and may be lost; `inferring` comes from no
  report: storing a part the model ran stamps it (its batch_end), and storing the result fills
  every state time still empty from the parts' traces.
* dead letters: one row per source message (topic, partition, offset).

Backends raise StoreUnavailable for "try again later" conditions (locked, connection lost),
which the sink retries without acking, so an outage delays results and loses none.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from mmpipe.schemas.settings import redact_url, secret
from mmpipe.schemas import DeadLetter, JobResult, Prediction, Refused, decode_prediction, decode_result, to_json

STATE_RANK = {
    "accepted": 0,
    "decoding": 1,
    "preprocessing": 2,
    "inferring": 3,
    "done": 4,
    "failed": 4,
    "expired": 4,
    "rejected": 4,
}
TERMINAL_STATE = {"ok": "done", "error": "failed", "expired": "expired", "rejected": "rejected"}

Assemble = Callable[[list[Prediction]], JobResult]


class StoreUnavailable(Exception):
    """The store cannot be written right now; retry later."""


@dataclass(frozen=True)
class Final:
    """A job's stored result, and whether this call created it / it was already published."""

    result: JobResult
    created: bool
    published: bool


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    state: str
    modality: str | None
    model: str | None
    created_at: float | None
    updated_at: float
    state_times: dict[str, float]


class ResultStore(abc.ABC):
    @abc.abstractmethod
    def init_schema(self) -> None: ...

    @abc.abstractmethod
    def accept_job(self, job_id: str, modality: str, model: str | None, created_at: float) -> bool:
        """Record a newly submitted job, not yet published (no `accepted` time); False if the
        job_id is already known."""

    @abc.abstractmethod
    def mark_accepted(self, job_id: str, at: float) -> None:
        """The job's event is in Kafka: stamp its `accepted` time (once)."""

    @abc.abstractmethod
    def is_unpublished(self, job_id: str) -> bool:
        """Recorded, but its event never reached Kafka (still `accepted` with no `accepted`
        time): a resubmission publishes it, also after an API restart."""

    @abc.abstractmethod
    def record_status(self, job_id: str, state: str, at: float) -> None: ...

    @abc.abstractmethod
    def record_part(self, prediction: Prediction, assemble: Assemble) -> Final | Refused | None:
        """Store one part; if it completes the job, store and return the job's result.
        If the job already has a result, return that (created=False). A part of another job
        under the same ID (another payload digest) is recorded as a conflict and returned as
        a Refused (job_id_conflict), never stored."""

    @abc.abstractmethod
    def record_result(self, result: JobResult) -> Final:
        """Store a result that needs no parts (a dead-lettered or rejected job)."""

    @abc.abstractmethod
    def record_dead_letter(self, letter: DeadLetter) -> bool: ...

    @abc.abstractmethod
    def mark_published(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def run_group(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
        """Run several of the calls above in one transaction (group commit); returns each
        call's result or the exception it raised; raises StoreUnavailable for the group."""

    @abc.abstractmethod
    def get_result(self, job_id: str) -> JobResult | None: ...

    @abc.abstractmethod
    def get_job(self, job_id: str) -> JobRecord | None: ...

    @abc.abstractmethod
    def counts(self) -> dict[str, int]:
        """Rows per table, for reports and tests."""

    @abc.abstractmethod
    def iter_results(self) -> Iterator[JobResult]: ...

    @abc.abstractmethod
    def conflicts(self) -> list[dict[str, Any]]: ...

    def close(self) -> None:
        """Release connections."""


def part_body(prediction: Prediction) -> str:
    return to_json(prediction).decode()


def load_part(body: str | bytes) -> Prediction:
    return decode_prediction(body.encode() if isinstance(body, str) else body)


def result_body(result: JobResult) -> str:
    return to_json(result).decode()


def load_result(body: str | bytes) -> JobResult:
    return decode_result(body.encode() if isinstance(body, str) else body)


def model_label(result_or_prediction: Any) -> str | None:
    model = getattr(result_or_prediction, "model", None)
    return None if model is None else f"{model.name}:{model.version}"


def open_store(store_url: SecretStr | str) -> ResultStore:
    """sqlite:///path/to.db (embedded default) or postgresql://user:pass@host/db."""
    url = secret(store_url) or ""
    if url.startswith("sqlite:"):
        from mmpipe.stages.sink.store.sqlite import SqliteStore

        return SqliteStore(url)
    if url.startswith(("postgresql:", "postgres:")):
        from mmpipe.stages.sink.store.postgres import PostgresStore

        return PostgresStore(url)
    raise ValueError(f"unsupported store URL {redact_url(url)!r}: use sqlite:///file.db or postgresql://...")


def count_results(url: SecretStr | str) -> int:
    """Result rows in the store at `url` (opened and closed for this one question)."""
    store = open_store(url)
    try:
        return store.counts()["results"]
    finally:
        store.close()
