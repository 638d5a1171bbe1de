"""SQLite backend (the embedded default): WAL mode, one connection per thread per store object.

Finalisation of a job is serialised by BEGIN IMMEDIATE (SQLite has one writer at a time), so
several sink processes may share one database file. Outages are told by SQLite's result code
(exc.sqlite_errorcode), not by message text: busy/locked beyond the busy timeout, a file that
cannot be opened, I/O errors, a read-only or full disk become StoreUnavailable.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from mmpipe.schemas.settings import secret
from mmpipe.streams.retry import poll_until
from mmpipe.stages.sink.store.base import StoreUnavailable
from mmpipe.stages.sink.store.sql import SqlStore


# Primary result codes that mean the database is unavailable for now, not misused.
OUTAGE_CODES = frozenset({
    sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR,
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_FULL, sqlite3.SQLITE_PROTOCOL,
})


def sqlite_path(store_url: SecretStr | str) -> str:
    # sqlite:///relative/path.db, sqlite:////absolute/path.db, sqlite:///:memory:
    url = secret(store_url) or ""
    if not url.startswith("sqlite:///"):
        raise ValueError(f"SQLite URLs look like sqlite:///path/to.db, got {url!r}")
    return url[len("sqlite:///") :]


class SqliteStore(SqlStore):
    def __init__(self, url: str, busy_timeout_s: float = 5.0) -> None:
        self.path = sqlite_path(url)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()

    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
            self._use_wal(conn)
            # FULL: a commit is on disk before the sink acks its input. With NORMAL an OS crash
            # or power loss could drop the last commits after their offsets were committed to
            # Kafka, and nothing would replay them.
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn = conn
        return conn

    def _use_wal(self, conn: sqlite3.Connection) -> None:
        """WAL is a property of the file, kept once set. Switching a fresh file takes an exclusive
        lock, and while other connections open the same fresh file SQLite may answer BUSY at once
        without waiting out the busy timeout, so the switch is retried up to that timeout."""
        try:
            poll_until(lambda: conn.execute("PRAGMA journal_mode=WAL"), every_s=0.01,
                       deadline_s=self.busy_timeout_s, retry_if=_is_busy)
        except sqlite3.OperationalError:
            conn.close()
            raise

    @contextlib.contextmanager
    def _begin(self, lock_key: str | None = None, write: bool = True) -> Iterator[Any]:
        try:
            conn = self._connection()
            cur = conn.cursor()
            # Writers take the write lock up front (no upgrade deadlocks); in WAL mode readers
            # need no lock at all and see the last committed state.
            cur.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        except sqlite3.OperationalError as exc:
            self._drop_connection()
            raise self._classified(exc) from exc
        try:
            yield cur
            cur.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            _rollback(conn)
            raise self._classified(exc) from exc
        except BaseException:
            _rollback(conn)
            raise

    def _classified(self, exc: sqlite3.OperationalError) -> Exception:
        """An outage (locked, busy, file missing or unwritable, I/O, disk full) becomes
        StoreUnavailable; anything else (no such column, syntax) stays what it is, a bug the
        sink reports loudly (it still waits, never dead-letters a good prediction for it)."""
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in OUTAGE_CODES:  # extended codes carry the primary in the low byte
            return StoreUnavailable(f"sqlite {self.path}: {getattr(exc, 'sqlite_errorname', code)}: {exc}")
        return exc

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            self._local.conn = None

    def _lock(self, cur: Any, key: str) -> None:
        """BEGIN IMMEDIATE already excludes every other writer: nothing more to take."""

    def close(self) -> None:
        self._drop_connection()


def _is_busy(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _rollback(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")
