"""Poison messages: a message whose processing kills the stage process (out of memory, a crash
in native code) would be redelivered after every restart and kill it again, forever. This
keeps a durable count (SQLite under the state directory, written before processing starts and
cleared when it ends) of how often each message was started without finishing.

A message that was in flight when the stage died is a suspect, but so is every neighbour that
was in flight with it (and after a restart they are redelivered together). So a suspect is
processed alone: it waits until nothing else is in flight and holds new messages back until
it is done. A crash then can only be its own; after `max_crashes` such solo crashes it is
given up: the runtime dead-letters it as `crashed_stage` instead of processing it again.

API: `await guard.enter(topic, partition, offset)` -> False when the message must be given up;
`guard.leave(...)` when its processing ended in any way short of the process dying.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from pathlib import Path

log = logging.getLogger(__name__)

FORGET_AFTER_S = 7 * 24 * 3600  # rows of messages another replica finished, eventually


class PoisonGuard:
    def __init__(self, path: Path, max_crashes: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit; WAL + NORMAL survives the crash of this process (what is counted here).
        self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS attempts (topic TEXT, partition INTEGER, message_offset INTEGER,"
            " started INTEGER NOT NULL, solo INTEGER NOT NULL, at REAL NOT NULL,"
            " PRIMARY KEY (topic, partition, message_offset))"
        )
        self._db.execute("DELETE FROM attempts WHERE at < ?", (time.time() - FORGET_AFTER_S,))
        self.max_crashes = max_crashes
        self._active = 0  # messages in processing now
        self._solo = False  # a suspect is running alone
        self._suspects_waiting = 0
        self._changed = asyncio.Condition()

    def crashes(self, topic: str, partition: int, offset: int) -> tuple[int, int]:
        """(times started, times started alone) without finishing, so far."""
        row = self._db.execute(
            "SELECT started, solo FROM attempts WHERE topic = ? AND partition = ? AND message_offset = ?",
            (topic, partition, offset),
        ).fetchone()
        return (0, 0) if row is None else (row[0], row[1])

    async def enter(self, topic: str, partition: int, offset: int) -> bool:
        started, solo = self.crashes(topic, partition, offset)
        if solo >= self.max_crashes:
            return False
        suspect = started > 0
        async with self._changed:
            if suspect:
                self._suspects_waiting += 1
                await self._changed.wait_for(lambda: self._active == 0 and not self._solo)
                self._suspects_waiting -= 1
                self._solo = True
            else:  # suspects go first, so a stream of new messages cannot starve them
                await self._changed.wait_for(lambda: not self._solo and not self._suspects_waiting)
            self._active += 1
        try:
            self._record(topic, partition, offset, solo=suspect)
        except sqlite3.Error as exc:
            # The guard is a safety net: a message it cannot count still runs (and leaves);
            # raising here would leave it unacked and freeze its partition's commits.
            log.warning("poison guard could not count %s/%d@%d (%s); processing it uncounted", topic, partition, offset, exc)
        return True

    def _record(self, topic: str, partition: int, offset: int, solo: bool) -> None:
        self._db.execute(
            "INSERT INTO attempts VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (topic, partition, message_offset)"
            " DO UPDATE SET started = started + 1, solo = solo + excluded.solo, at = excluded.at",
            (topic, partition, offset, int(solo), time.time()),
        )

    async def leave(self, topic: str, partition: int, offset: int) -> None:
        try:
            self._db.execute(
                "DELETE FROM attempts WHERE topic = ? AND partition = ? AND message_offset = ?", (topic, partition, offset)
            )
        except sqlite3.Error as exc:  # a row left behind only makes the message a suspect if it comes back
            log.warning("poison guard could not clear %s/%d@%d: %s", topic, partition, offset, exc)
        async with self._changed:
            self._active -= 1
            self._solo = False if self._active == 0 else self._solo
            self._changed.notify_all()

    def detail(self, topic: str, partition: int, offset: int) -> str:
        started, solo = self.crashes(topic, partition, offset)
        return (f"processing this message killed the stage {solo} times while it ran alone "
                f"({started} starts in all); given up instead of crash-looping")

    def close(self) -> None:
        self._db.close()
