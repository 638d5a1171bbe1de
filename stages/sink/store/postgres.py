"""PostgreSQL backend (production): psycopg 3, one connection per thread, READ COMMITTED.

Finalisation of a job is serialised by a transaction-scoped advisory lock on the job_id
(pg_advisory_xact_lock), taken before anything else in the transaction; under READ COMMITTED
every later statement then sees what the previous lock holder committed, so the sink that
stores a job's last part always sees all the others. Connection loss, admin shutdown, a
server that is starting or full, serialization failures and deadlocks become StoreUnavailable;
a broken connection is dropped and the next call opens a new one.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from mmpipe.stages.sink.store.base import StoreUnavailable
from mmpipe.stages.sink.store.sql import SqlStore

CONNECT_TIMEOUT_S = 5  # a dead server must surface as StoreUnavailable soon, not hang the sink

# "Try again later": OperationalError covers connection failures and loss (class 08),
# admin/crash shutdown and "starting up" (57P0x), too many connections, disk full, and
# transaction rollbacks (40001 serialization failure, 40P01 deadlock). A read-only
# transaction means we reached a standby (e.g. mid-failover); an idle-in-transaction
# timeout means the server dropped our session.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    psycopg.OperationalError,
    psycopg.errors.ReadOnlySqlTransaction,
    psycopg.errors.IdleInTransactionSessionTimeout,
)


class PostgresStore(SqlStore):
    placeholder = "%s"

    def __init__(self, url: str, connect_timeout_s: int = CONNECT_TIMEOUT_S) -> None:
        self.url = url
        self._conninfo = _with_defaults(url, connect_timeout_s)
        self._local = threading.local()
        # The live connections of every thread, so close() can release them all; weak, so the
        # connection of a thread that has ended is closed with it instead of piling up.
        self._all: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
        self._all_lock = threading.Lock()

    def _connection(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            # autocommit: transactions are explicit (BEGIN/COMMIT in _transaction), as in SQLite.
            conn = psycopg.connect(self._conninfo, autocommit=True)
            self._local.conn = conn
            with self._all_lock:
                self._all.add(conn)
        return conn

    @contextlib.contextmanager
    def _begin(self, lock_key: str | None = None, write: bool = True) -> Iterator[Any]:
        conn = None
        try:
            conn = self._connection()
            cur = conn.cursor()
            # READ COMMITTED pinned, not left to the server's default: under REPEATABLE READ the
            # snapshot would be taken before the advisory lock is granted, hiding the parts the
            # previous holder just committed, and a job could be left without its result.
            cur.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
            if lock_key is not None:
                # Waits for whoever holds the key; released by COMMIT/ROLLBACK, never leaked.
                self._lock(cur, lock_key)
            yield cur
            cur.execute("COMMIT")
        except TRANSIENT_ERRORS as exc:
            # If COMMIT itself was cut off the transaction may have committed or not; the
            # caller retries and the idempotent writes make either outcome right.
            self._rollback(conn)
            raise StoreUnavailable(f"postgresql: {exc}") from exc
        except BaseException:
            self._rollback(conn)  # never leave the thread's connection inside a failed transaction
            raise

    def _rollback(self, conn: psycopg.Connection[Any] | None) -> None:
        """End a failed transaction, keeping the connection only if it is still healthy."""
        if conn is None:
            return  # the connection was never made
        if conn.broken or conn.closed:
            self._discard(conn)
            return
        try:
            conn.execute("ROLLBACK")
        except psycopg.Error:
            self._discard(conn)

    def _discard(self, conn: psycopg.Connection[Any] | None) -> None:
        """Close a connection that can no longer be trusted; the next call opens a new one."""
        if conn is None:
            return
        with contextlib.suppress(psycopg.Error):
            conn.close()
        with self._all_lock:
            self._all.discard(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def _lock(self, cur: Any, key: str) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))

    def close(self) -> None:
        with self._all_lock:
            connections, self._all = list(self._all), weakref.WeakSet()
        for conn in connections:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self._local.conn = None


def _with_defaults(url: str, connect_timeout_s: int) -> str:
    """The URL as a conninfo string, with timeouts added where the URL sets none."""
    params = conninfo_to_dict(url)
    params.setdefault("connect_timeout", str(connect_timeout_s))
    params.setdefault("application_name", "mmpipe")
    # A server that vanishes without closing the socket (host down, network cut) must become
    # a connection error, not a call that hangs the sink's store thread: TCP keepalives find
    # it while we wait for a reply, tcp_user_timeout while our data goes unacknowledged.
    for name, value in (("keepalives", "1"), ("keepalives_idle", "30"), ("keepalives_interval", "10"),
                        ("keepalives_count", "3"), ("tcp_user_timeout", "60000")):
        params.setdefault(name, value)
    return make_conninfo(**params)
