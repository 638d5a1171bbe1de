"""Poison messages: the crash count survives SIGKILL of the process that counted; neighbours
that were in flight at a crash are run alone and finish, while the message that kills its
process each time it runs alone is given up after max_crashes."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

from mmpipe.streams.poison import PoisonGuard

K = 2
# A stage process: enter the messages given, then die by SIGKILL with them in flight.
CRASHING_STAGE = """
import asyncio, os, signal, sys
from pathlib import Path
from mmpipe.streams.poison import PoisonGuard

async def main():
    guard = PoisonGuard(Path(sys.argv[1]), max_crashes=int(sys.argv[2]))
    for offset in map(int, sys.argv[3:]):
        if not await guard.enter("t.events", 0, offset):
            print("given up", offset, flush=True)
            return
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def _crash_with(path: Path, *offsets: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CRASHING_STAGE, str(path), str(K), *map(str, offsets)],
                          capture_output=True, text=True, timeout=60)


def test_a_message_that_kills_its_stage_alone_k_times_is_given_up(tmp_path):
    path = tmp_path / "poison.db"
    assert _crash_with(path, 5, 6).returncode == -9  # 5 and 6 in flight at the first crash
    assert _crash_with(path, 5).returncode == -9  # a suspect now: runs alone, crash 1
    assert _crash_with(path, 5).returncode == -9  # crash 2
    given_up = _crash_with(path, 5)
    assert given_up.returncode == 0 and "given up 5" in given_up.stdout

    guard = PoisonGuard(path, max_crashes=K)

    async def neighbour() -> None:
        assert await guard.enter("t.events", 0, 6)  # in flight at the first crash, never alone
        await guard.leave("t.events", 0, 6)

    asyncio.run(neighbour())
    assert guard.crashes("t.events", 0, 6) == (0, 0)  # finished: forgotten
    assert "killed the stage 2 times" in guard.detail("t.events", 0, 5)


def test_a_suspect_runs_alone_and_new_messages_wait_for_it(tmp_path):
    path = tmp_path / "poison.db"
    assert _crash_with(path, 7).returncode == -9
    guard = PoisonGuard(path, max_crashes=K)
    order: list[str] = []

    async def run(offset: int, name: str, hold_s: float) -> None:
        assert await guard.enter("t.events", 0, offset)
        order.append(f"{name} in")
        await asyncio.sleep(hold_s)
        order.append(f"{name} out")
        await guard.leave("t.events", 0, offset)

    async def scenario() -> None:
        first = asyncio.create_task(run(1, "new", 0.2))
        await asyncio.sleep(0.05)
        suspect = asyncio.create_task(run(7, "suspect", 0.2))
        await asyncio.sleep(0.05)
        later = asyncio.create_task(run(8, "later", 0.0))
        await asyncio.gather(first, suspect, later)

    asyncio.run(scenario())
    assert order == ["new in", "new out", "suspect in", "suspect out", "later in", "later out"]
    assert guard.crashes("t.events", 0, 7) == (0, 0)


class FailingWrites:
    """The guard's SQLite connection, with every write failing (a locked or full disk)."""

    def __init__(self, db) -> None:
        self.db = db

    def execute(self, sql: str, *args):
        if sql.startswith(("INSERT", "DELETE")):
            raise sqlite3.OperationalError("database is locked")
        return self.db.execute(sql, *args)


def test_a_guard_that_cannot_write_still_lets_every_message_through(tmp_path):
    """Its counters must not leak when its database fails: a suspect that could not be counted
    would otherwise hold every later message back for ever."""
    path = tmp_path / "poison.db"
    assert _crash_with(path, 3).returncode == -9  # offset 3 is a suspect from now on

    async def run() -> list[bool]:
        guard = PoisonGuard(path, max_crashes=K)
        guard._db = FailingWrites(guard._db)
        entered = []
        for offset in (3, 4, 3, 5):  # the suspect, a new message, the suspect again, another
            entered.append(await asyncio.wait_for(guard.enter("t.events", 0, offset), 5))
            await guard.leave("t.events", 0, offset)
        return entered

    assert asyncio.run(run()) == [True, True, True, True]
