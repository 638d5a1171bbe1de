"""PostgreSQL backend (production): psycopg 3 through a psycopg_pool connection pool, READ
COMMITTED.

Finalisation of a job is serialised by a transaction-scoped advisory lock on the job_id
(pg_advisory_xact_lock), taken before anything else in the transaction; under READ COMMITTED
every later statement then sees what the previous lock holder committed, so the sink that
stores a job's last part always sees all the others. Connection loss, admin shutdown, a
server that is starting or full, no connection from the pool in time, serialization failures
and deadlocks become StoreUnavailable. The pool checks a connection before lending it and
drops a broken one when it comes back, so the next call gets a healthy one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

from mmpipe.schemas import Refused
from mmpipe.stages.sink.store.base import StoreUnavailable
from mmpipe.stages.sink.store.sql import SqlStore

CONNECT_TIMEOUT_S = 5  # a dead server must surface as StoreUnavailable soon, not hang the sink
ACQUIRE_TIMEOUT_S = 3.0  # the longest a call waits for a connection from the pool
POOL_MAX_SIZE = 4  # the sink's store thread, the API's readers, a few spare

# "Try again later": OperationalError covers connection failures and loss (class 08),
# admin/crash shutdown and "starting up" (57P0x), too many connections, disk full, no
# connection from the pool in time (PoolTimeout), and transaction rollbacks (40001
# serialization failure, 40P01 deadlock). A read-only transaction means we reached a standby
# (e.g. mid-failover); an idle-in-transaction timeout means the server dropped our session.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    psycopg.OperationalError,
    psycopg.errors.ReadOnlySqlTransaction,
    psycopg.errors.IdleInTransactionSessionTimeout,
)


class PostgresStore(SqlStore):
    placeholder = "%s"

    def __init__(self, url: str, connect_timeout_s: int = CONNECT_TIMEOUT_S, max_size: int = POOL_MAX_SIZE) -> None:
        self.url = url
        self._local = threading.local()  # the group transaction's cursor, per thread
        # autocommit: transactions are explicit (BEGIN/COMMIT in _begin), as in SQLite.
        self._pool = ConnectionPool(
            _with_defaults(url, connect_timeout_s),
            kwargs={"autocommit": True},
            # Connections made on demand (none at open: a background fill racing the first call
            # would open two for one caller) and kept until idle for max_idle.
            min_size=0,
            max_size=max_size,
            timeout=ACQUIRE_TIMEOUT_S,
            check=ConnectionPool.check_connection,
            name="mmpipe-store",
            open=False,
        )
        self._pool.open(wait=False)  # a server that is down now is an outage later, not an error here

    @contextlib.contextmanager
    def _begin(self, lock_key: str | None = None, write: bool = True) -> Iterator[Any]:
        try:
            with self._pool.connection() as conn, conn.cursor() as cur:
                # READ COMMITTED pinned, not left to the server's default: under REPEATABLE READ
                # the snapshot would be taken before the advisory lock is granted, hiding the
                # parts the previous holder just committed, and a job could be left without its
                # result.
                cur.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
                try:
                    if lock_key is not None:
                        # Waits for whoever holds the key; released by COMMIT/ROLLBACK.
                        self._lock(cur, lock_key)
                    yield cur
                    cur.execute("COMMIT")
                except BaseException:
                    _rollback(conn)  # never return a connection inside a failed transaction
                    raise
        except TRANSIENT_ERRORS as exc:
            # If COMMIT itself was cut off the transaction may have committed or not; the
            # caller retries and the idempotent writes make either outcome right.
            raise StoreUnavailable(f"postgresql: {exc}") from exc
        except psycopg.DataError as exc:
            # A value this server will not store (a NUL byte in text, a number out of range):
            # the message's fault, never an outage to wait out.
            raise Refused("unstorable_value", f"postgresql refused a value: {exc}") from exc

    def _lock(self, cur: Any, key: str) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))

    def close(self) -> None:
        self._pool.close()


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """End a failed transaction; a broken connection is left for the pool to discard."""
    if not (conn.broken or conn.closed):
        with contextlib.suppress(psycopg.Error):
            conn.execute("ROLLBACK")


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
