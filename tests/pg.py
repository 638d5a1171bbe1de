"""A real, throwaway PostgreSQL server for the tests (Debian package `postgresql`).

The server listens on 127.0.0.1 only (plus a unix socket inside its own temp dir), trusts
local connections, and skips durability work (fsync off): its data dies with the session.
PostgreSQL refuses to run as root, so as root (tests and CI) initdb and pg_ctl run as the
`postgres` OS user; otherwise they run as the current user.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from mmpipe.streams.broker import free_port
from tests.system_tools import missing_tool, tool_expected

SUPERUSER = "postgres"
START_ATTEMPTS = 3  # a free port picked here can be taken by someone else before the server binds it


def find_pg_bin() -> Path | None:
    """The bin dir of the newest installed PostgreSQL that has initdb and pg_ctl."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_major_version, reverse=True)
    for candidate in candidates:
        bin_dir = Path(candidate)
        if (bin_dir / "initdb").exists() and (bin_dir / "pg_ctl").exists():
            return bin_dir
    return None


def _major_version(bin_dir: str) -> int:
    version = Path(bin_dir).parent.name
    return int(version) if version.isdigit() else 0


class PostgresServer:
    """One postmaster with its own data dir, socket dir and log, in a fresh temp dir."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.run_as = _os_user_for_server()
        # Not under pytest's basetemp: that tree is root-only (0700), so the postgres user
        # could not reach its data dir there. mkdtemp in /tmp is ours alone (0700) until chowned.
        self.base = Path(tempfile.mkdtemp(prefix="mmpipe-pg-"))
        self.data_dir = self.base / "data"
        self.socket_dir = self.base / "sock"
        self.log_path = self.base / "server.log"
        self.port = 0
        self.running = False

    # Lifecycle --------------------------------------------------------------------------------
    def init(self) -> None:
        self.socket_dir.mkdir()
        if self.run_as is not None:
            shutil.chown(self.base, self.run_as, self.run_as)
            shutil.chown(self.socket_dir, self.run_as, self.run_as)
        self._run(
            "initdb", "--pgdata", str(self.data_dir), "--username", SUPERUSER, "--auth", "trust",
            "--encoding", "UTF8", "--no-locale", "--no-sync",
        )

    def start(self, port: int | None = None) -> None:
        """Start on `port` (a restart keeps the URL) or on a free one."""
        for attempt in range(START_ATTEMPTS):
            self.port = port or free_port()
            try:
                self._run(
                    "pg_ctl", "start", "--wait", "--timeout", "60", "--pgdata", str(self.data_dir),
                    "--log", str(self.log_path), "--options", self._server_options(),
                )
                self.running = True
                return
            except RuntimeError:
                if port is not None or attempt == START_ATTEMPTS - 1:
                    raise

    def stop(self) -> None:
        if not self.running:
            return
        try:
            self._run("pg_ctl", "stop", "--wait", "--mode", "fast", "--pgdata", str(self.data_dir))
        except RuntimeError:
            self._run("pg_ctl", "stop", "--wait", "--mode", "immediate", "--pgdata", str(self.data_dir))
        self.running = False

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    # Databases ------------------------------------------------------------------------------
    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; returns its URL."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def terminate_connections(self, database: str) -> int:
        """Kill every backend connected to `database` (what an admin or a failover does)."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (database,),
            ).fetchone()
        return int(row[0])

    def connections(self, database: str) -> int:
        """How many backends are connected to `database` now."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)).fetchone()
        return int(row[0])

    # Internals ------------------------------------------------------------------------------
    def _server_options(self) -> str:
        return " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.socket_dir}",
                # Throwaway data: no durability work, so tests stay fast on a shared machine.
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=100",
            ]
        )

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin_dir / tool), *args]
        if self.run_as is not None:
            command = ["runuser", "-u", self.run_as, "--", *command]
        # cwd: the postgres user may not be allowed into the caller's working directory.
        done = subprocess.run(command, cwd=self.base, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(
                f"{tool} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}\n"
                f"server log:\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _os_user_for_server() -> str | None:
    """The OS user to run the server as: `postgres` when we are root, else ourselves (None)."""
    return "postgres" if os.geteuid() == 0 else None


def postgres_expected() -> bool:
    """PostgreSQL must be there in CI (CI=true, MMPIPE_REQUIRE_POSTGRES=1) and where its Debian
    package is installed (./dev installs it): a missing server there fails the tests."""
    return tool_expected("MMPIPE_REQUIRE_POSTGRES", package_installed=Path("/usr/lib/postgresql").is_dir())


def _missing(reason: str) -> None:
    missing_tool("PostgreSQL", reason, postgres_expected())


def start_server() -> PostgresServer:
    """A started server; without PostgreSQL a failure where it is expected, else a skip."""
    bin_dir = find_pg_bin()
    if bin_dir is None:
        _missing("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin (apt package `postgresql`; ./dev installs it)")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        _missing("running as root needs `runuser` to start PostgreSQL as the postgres user")
    server = PostgresServer(bin_dir)
    try:
        server.init()
        server.start()
    except BaseException:
        server.destroy()
        raise
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One server for the whole session; stopped and deleted at the end."""
    server = start_server()
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """A database on the session server, shared by the tests that ask for it."""
    return postgres_server.create_database("mmpipe")


@pytest.fixture
def fresh_postgres_url(postgres_server: PostgresServer) -> str:
    """An empty database of its own for one test (cheap: created from template1)."""
    return postgres_server.create_database()


@pytest.fixture
def own_postgres_server() -> Iterator[PostgresServer]:
    """A server of the test's own, for tests that stop or restart it."""
    server = start_server()
    try:
        yield server
    finally:
        server.destroy()
