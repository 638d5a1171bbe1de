"""The ResultStore logic in portable SQL; SQLite and PostgreSQL only supply a connection, a
way to serialise finalisation of one job, and the mapping of their transient errors."""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mmpipe.stages.sink.store.base import (
    STATE_RANK,
    TERMINAL_STATE,
    Assemble,
    Final,
    JobRecord,
    ResultStore,
    StoreUnavailable,
    load_part,
    load_result,
    model_label,
    part_body,
    result_body,
)
from mmpipe.schemas import DeadLetter, JobResult, Prediction, Refused

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS jobs (
        job_id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        modality TEXT,
        model TEXT,
        created_at DOUBLE PRECISION,
        updated_at DOUBLE PRECISION NOT NULL,
        accepted_at DOUBLE PRECISION,
        decoding_at DOUBLE PRECISION,
        preprocessing_at DOUBLE PRECISION,
        inferring_at DOUBLE PRECISION,
        finished_at DOUBLE PRECISION)""",
    """CREATE TABLE IF NOT EXISTS parts (
        job_id TEXT NOT NULL,
        part INTEGER NOT NULL,
        parts INTEGER NOT NULL,
        model TEXT NOT NULL,
        status TEXT NOT NULL,
        body TEXT NOT NULL,
        received_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (job_id, part))""",
    """CREATE TABLE IF NOT EXISTS results (
        job_id TEXT PRIMARY KEY,
        status TEXT NOT NULL,
        model TEXT,
        body TEXT NOT NULL,
        completed_at DOUBLE PRECISION NOT NULL,
        published INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS conflicts (
        job_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        existing TEXT NOT NULL,
        incoming TEXT NOT NULL,
        at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dead_letters (
        source_topic TEXT NOT NULL,
        source_partition INTEGER NOT NULL,
        source_offset BIGINT NOT NULL,
        job_id TEXT NOT NULL,
        stage TEXT NOT NULL,
        reason TEXT NOT NULL,
        detail TEXT NOT NULL,
        failed_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (source_topic, source_partition, source_offset))""",
]

class JobIdConflict(Refused):
    """A job ID reused for a different payload: refused, recorded in `conflicts`."""


SCHEMA_LOCK = "mmpipe schema"  # a lock key no job_id can equal (job ids have no spaces)

STATE_COLUMN = {
    "accepted": "accepted_at",
    "decoding": "decoding_at",
    "preprocessing": "preprocessing_at",
    "inferring": "inferring_at",
}
# The trace stamp each state's time comes from when no status report gave it.
TRACE_OF_STATE = {"decoding": "decode_in", "preprocessing": "preprocess_in", "inferring": "batch_end"}


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    try:
        return fn(*args)
    except StoreUnavailable:
        raise
    except Exception as exc:  # returned, not raised: the caller of this one call sees it
        return exc


class SqlStore(ResultStore):
    """Portable SQL; `?` placeholders are rewritten by backends that use another style."""

    placeholder = "?"
    # Per-thread state, made by each backend's constructor: its connection (`conn`) and the
    # cursor of the group transaction open in that thread (`group_cursor`).
    _local: threading.local

    # Backend hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    def _begin(self, lock_key: str | None = None, write: bool = True) -> contextlib.AbstractContextManager[Any]:
        """A transaction (cursor-like object with execute/fetch); with lock_key, one that
        excludes other writers with the same key (finalising or advancing the same job);
        write=False for reads, which must not queue behind (or block) the sink's writes."""

    @abc.abstractmethod
    def _lock(self, cur: Any, key: str) -> None:
        """Inside an open transaction, exclude other writers of `key` until it ends."""

    @contextlib.contextmanager
    def _transaction(self, lock_key: str | None = None, write: bool = True) -> Iterator[Any]:
        """A transaction of its own, or a part of the group transaction open in this thread."""
        group = getattr(self._local, "group_cursor", None)
        if group is None:
            with self._begin(lock_key, write) as cur:
                yield cur
            return
        if lock_key is not None:
            self._lock(group, lock_key)
        yield group

    # Group commit -----------------------------------------------------------------------
    def run_group(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
        """Run several store calls in ONE transaction (one commit for many messages). If one
        call fails for a reason other than unavailability, the group is rolled back and each
        call is run on its own, so one bad call cannot fail its neighbours. Returns each call's
        result, or the exception that call raised."""
        try:
            with self._begin(lock_key=None, write=True) as cur:
                self._local.group_cursor = cur
                try:
                    results = [fn(*args) for fn, args in calls]
                finally:
                    self._local.group_cursor = None
            return results
        except StoreUnavailable:
            raise
        except Exception:
            return [_outcome(fn, args) for fn, args in calls]

    def _q(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    # Schema -----------------------------------------------------------------------------
    def init_schema(self) -> None:
        # Locked: sinks starting together would otherwise race on CREATE TABLE IF NOT EXISTS,
        # which PostgreSQL does not make atomic (duplicate key in pg_type).
        with self._transaction(lock_key=SCHEMA_LOCK) as cur:
            for statement in SCHEMA:
                cur.execute(statement)
            cur.execute("CREATE INDEX IF NOT EXISTS dead_letters_job ON dead_letters (job_id)")

    # Jobs -------------------------------------------------------------------------------
    def accept_job(self, job_id: str, modality: str, model: str | None, created_at: float) -> bool:
        now = time.time()
        with self._transaction() as cur:
            cur.execute(
                self._q(
                    "INSERT INTO jobs (job_id, state, modality, model, created_at, updated_at)"
                    " VALUES (?, 'accepted', ?, ?, ?, ?) ON CONFLICT (job_id) DO NOTHING"
                ),
                (job_id, modality, model, created_at, now),
            )
            return cur.rowcount == 1

    def mark_accepted(self, job_id: str, at: float) -> None:
        with self._transaction() as cur:
            self._stamp(cur, job_id, "accepted", at)

    def is_unpublished(self, job_id: str) -> bool:
        with self._transaction(write=False) as cur:
            cur.execute(self._q("SELECT 1 FROM jobs WHERE job_id = ? AND state = 'accepted' AND accepted_at IS NULL"), (job_id,))
            return cur.fetchone() is not None

    def record_status(self, job_id: str, state: str, at: float) -> None:
        # Locked like finalisation: _advance reads the state, then writes it, and two writers
        # interleaving there (PostgreSQL READ COMMITTED) could move the job backwards.
        with self._transaction(lock_key=job_id) as cur:
            self._advance(cur, job_id, state, at)

    def _advance(self, cur: Any, job_id: str, state: str, at: float, **fields: Any) -> None:
        """Move a job's state forward only; create the row if the job was never accepted here."""
        column = STATE_COLUMN.get(state, "finished_at")
        cur.execute(
            self._q(
                f"INSERT INTO jobs (job_id, state, updated_at, {column}, modality, model, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id) DO NOTHING"
            ),
            (job_id, state, at, at, fields.get("modality"), fields.get("model"), fields.get("created_at")),
        )
        if cur.rowcount == 1:
            return
        cur.execute(self._q("SELECT state FROM jobs WHERE job_id = ?"), (job_id,))
        (current,) = cur.fetchone()
        if STATE_RANK[state] > STATE_RANK.get(current, -1):
            cur.execute(
                self._q(f"UPDATE jobs SET state = ?, updated_at = ?, {column} = ? WHERE job_id = ?"),
                (state, at, at, job_id),
            )
        elif state == current or STATE_RANK[state] < STATE_RANK.get(current, -1):
            self._stamp(cur, job_id, state, at)

    def _stamp(self, cur: Any, job_id: str, state: str, at: float) -> None:
        """Fill a state's time if it has none (a late or redelivered report), state unchanged."""
        self._fill_times(cur, job_id, {STATE_COLUMN.get(state, "finished_at"): at})

    def _fill_times(self, cur: Any, job_id: str, times: dict[str, float]) -> None:
        """Set each time column that is still empty, in one statement; the state is unchanged."""
        if times:
            sets = ", ".join(f"{column} = COALESCE({column}, ?)" for column in times)
            cur.execute(self._q(f"UPDATE jobs SET {sets} WHERE job_id = ?"), (*times.values(), job_id))

    # Parts and results ----------------------------------------------------------------------
    def record_part(self, prediction: Prediction, assemble: Assemble) -> Final | JobIdConflict | None:
        with self._transaction(lock_key=prediction.job_id) as cur:
            conflict = self._other_job(cur, prediction)
            if conflict is not None:
                return conflict  # returned, not raised: the conflict row must be committed
            existing = self._stored_result(cur, prediction.job_id)
            if existing is not None:
                result, published = existing
                if model_label(result) not in (None, model_label(prediction)) and result.modality != "video":
                    self._conflict(cur, prediction.job_id, "part_model", model_label(result), model_label(prediction))
                return Final(result, created=False, published=published)
            cur.execute(
                self._q(
                    "INSERT INTO parts (job_id, part, parts, model, status, body, received_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, part) DO NOTHING"
                ),
                (
                    prediction.job_id, prediction.part, prediction.parts, model_label(prediction),
                    prediction.status, part_body(prediction), time.time(),
                ),
            )
            if cur.rowcount != 1:
                self._check_part_conflict(cur, prediction)
            # An expired or rejected part decides the job at once (no waiting for the others).
            if prediction.status in ("expired", "rejected"):
                return self._finalize(cur, [prediction], assemble)
            cur.execute(self._q("SELECT body FROM parts WHERE job_id = ? ORDER BY part"), (prediction.job_id,))
            parts = [load_part(row[0]) for row in cur.fetchall()]
            inferred_at = prediction.trace.get("batch_end")  # set only on parts the model ran
            if len(parts) < prediction.parts:
                if inferred_at is not None:
                    self._advance(cur, prediction.job_id, "inferring", inferred_at)
                return None
            return self._finalize(cur, parts, assemble)

    def _other_job(self, cur: Any, prediction: Prediction) -> JobIdConflict | None:
        """A part of another job that reuses this job's ID (a different payload digest) is
        recorded as a conflict and refused, never merged with this job's parts."""
        incoming = prediction.meta.get("payload_digest")
        if incoming is None:  # no digest (a message from before answers carried one): nothing to compare
            return None
        # Parts of one job share one digest (other jobs' parts are never stored): one will do.
        cur.execute(self._q("SELECT body FROM parts WHERE job_id = ? ORDER BY part LIMIT 1"), (prediction.job_id,))
        row = cur.fetchone()
        existing = None if row is None else load_part(row[0]).meta.get("payload_digest")
        if existing is None or existing == incoming:
            return None
        self._conflict(cur, prediction.job_id, "job_id_conflict", existing, incoming)
        return JobIdConflict(
            "job_id_conflict",
            f"job {prediction.job_id} exists with another payload (digest {existing}, this one {incoming})",
        )

    def _check_part_conflict(self, cur: Any, prediction: Prediction) -> None:
        cur.execute(
            self._q("SELECT model FROM parts WHERE job_id = ? AND part = ?"), (prediction.job_id, prediction.part)
        )
        row = cur.fetchone()
        if row and row[0] != model_label(prediction):
            self._conflict(cur, prediction.job_id, f"part_{prediction.part}_model", row[0], model_label(prediction))

    def _finalize(self, cur: Any, parts: list[Prediction], assemble: Assemble) -> Final:
        result = assemble(parts)
        self._insert_result(cur, result)
        self._stamp_traces(cur, result.job_id, parts)
        return Final(result, created=True, published=False)

    def _stamp_traces(self, cur: Any, job_id: str, parts: list[Prediction]) -> None:
        """Fill each state time that no status report filled, from the earliest trace of that
        state among the parts: reports are a live view and may be lost (streams/status.py), the
        traces travel with the work."""
        times = {}
        for state, key in TRACE_OF_STATE.items():
            stamps = [p.trace[key] for p in parts if key in p.trace]
            if stamps:
                times[STATE_COLUMN[state]] = min(stamps)
        self._fill_times(cur, job_id, times)

    def record_result(self, result: JobResult) -> Final:
        with self._transaction(lock_key=result.job_id) as cur:
            existing = self._stored_result(cur, result.job_id)
            if existing is not None:
                stored, published = existing
                if (stored.status, model_label(stored)) != (result.status, model_label(result)):
                    self._conflict(cur, result.job_id, "result", f"{stored.status} {model_label(stored)}",
                                   f"{result.status} {model_label(result)}")
                return Final(stored, created=False, published=published)
            self._insert_result(cur, result)
            return Final(result, created=True, published=False)

    def _insert_result(self, cur: Any, result: JobResult) -> None:
        cur.execute(
            self._q(
                "INSERT INTO results (job_id, status, model, body, completed_at, published)"
                " VALUES (?, ?, ?, ?, ?, 0)"
            ),
            (result.job_id, result.status, model_label(result), result_body(result), result.completed_at),
        )
        self._advance(
            cur, result.job_id, TERMINAL_STATE[result.status], result.completed_at,
            modality=result.modality, model=model_label(result), created_at=result.created_at,
        )

    def _stored_result(self, cur: Any, job_id: str) -> tuple[JobResult, bool] | None:
        cur.execute(self._q("SELECT body, published FROM results WHERE job_id = ?"), (job_id,))
        row = cur.fetchone()
        return None if row is None else (load_result(row[0]), bool(row[1]))

    def _conflict(self, cur: Any, job_id: str, kind: str, existing: Any, incoming: Any) -> None:
        cur.execute(
            self._q("INSERT INTO conflicts (job_id, kind, existing, incoming, at) VALUES (?, ?, ?, ?, ?)"),
            (job_id, kind, str(existing), str(incoming), time.time()),
        )

    def mark_published(self, job_id: str) -> None:
        with self._transaction() as cur:
            cur.execute(self._q("UPDATE results SET published = 1 WHERE job_id = ?"), (job_id,))

    def record_dead_letter(self, letter: DeadLetter) -> bool:
        with self._transaction() as cur:
            cur.execute(
                self._q(
                    "INSERT INTO dead_letters (source_topic, source_partition, source_offset, job_id, stage,"
                    " reason, detail, failed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (source_topic, source_partition, source_offset) DO NOTHING"
                ),
                (
                    letter.source_topic, letter.source_partition, letter.source_offset, letter.job_id,
                    letter.stage, letter.reason, letter.detail, letter.failed_at,
                ),
            )
            return cur.rowcount == 1

    # Reads ------------------------------------------------------------------------------
    def get_result(self, job_id: str) -> JobResult | None:
        with self._transaction(write=False) as cur:
            stored = self._stored_result(cur, job_id)
        return None if stored is None else stored[0]

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._transaction(write=False) as cur:
            cur.execute(
                self._q(
                    "SELECT job_id, state, modality, model, created_at, updated_at, accepted_at, decoding_at,"
                    " preprocessing_at, inferring_at, finished_at FROM jobs WHERE job_id = ?"
                ),
                (job_id,),
            )
            row = cur.fetchone()
        if row is None:
            return None
        names = ("accepted", "decoding", "preprocessing", "inferring", "finished")
        times = {name: value for name, value in zip(names, row[6:]) if value is not None}
        return JobRecord(row[0], row[1], row[2], row[3], row[4], row[5], times)

    def counts(self) -> dict[str, int]:
        counts = {}
        with self._transaction(write=False) as cur:
            for table in ("jobs", "parts", "results", "conflicts", "dead_letters"):
                cur.execute(f"SELECT COUNT(*) FROM {table}")
                counts[table] = int(cur.fetchone()[0])
        return counts

    def iter_results(self) -> Iterator[JobResult]:
        with self._transaction(write=False) as cur:
            cur.execute("SELECT body FROM results ORDER BY completed_at")
            rows = cur.fetchall()
        for (body,) in rows:
            yield load_result(body)

    def conflicts(self) -> list[dict[str, Any]]:
        with self._transaction(write=False) as cur:
            cur.execute("SELECT job_id, kind, existing, incoming, at FROM conflicts ORDER BY at")
            return [dict(zip(("job_id", "kind", "existing", "incoming", "at"), row)) for row in cur.fetchall()]

    def dead_letters(self, job_id: str | None = None) -> list[dict[str, Any]]:
        with self._transaction(write=False) as cur:
            sql = "SELECT job_id, stage, reason, detail, failed_at FROM dead_letters"
            if job_id is None:
                cur.execute(sql + " ORDER BY failed_at")
            else:
                cur.execute(self._q(sql + " WHERE job_id = ? ORDER BY failed_at"), (job_id,))
            return [dict(zip(("job_id", "stage", "reason", "detail", "failed_at"), row)) for row in cur.fetchall()]
