"""How long a consumer asks the broker to hold a fetch that finds no records.

The embedded broker (Tansu) holds an empty fetch for its whole max wait and only looks for new
records at a few points inside it, so the wait is the per-hop latency floor at light load: a
short wait (20 ms) keeps hops fast but makes every idle consumer poll 50 times a second (measured:
60-90 ms of CPU per second per stage process, 120-280 for the broker, with nothing to do).

AdaptiveFetchWait keeps the short wait while records flow and for a grace period after the last
ones, so steady and bursty traffic see the same latency as before; only a consumer that found
nothing for `idle_after_s` doubles its wait per empty fetch, up to `idle_max_ms`. The first
fetch that returns records snaps it back. The cost: the first job after a long quiet spell
pays up to about one idle wait per hop.

Pure logic with the clock passed in (tests drive it with a fake clock); the transport feeds it
the outcome of every fetch and reads the next wait from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveFetchWait:
    base_ms: int
    idle_max_ms: int
    idle_after_s: float
    wait_ms: int = field(init=False)
    last_records_at: float | None = field(init=False, default=None)
    _empty_since: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.idle_max_ms = max(self.idle_max_ms, self.base_ms)
        self.wait_ms = self.base_ms

    def after_fetch(self, got_records: bool, now: float) -> int:
        """Record one fetch's outcome; returns the max wait of the next fetch."""
        if got_records:
            self.last_records_at = now
            self._empty_since = None
            self.wait_ms = self.base_ms
            return self.wait_ms
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since >= self.idle_after_s:
            self.wait_ms = min(self.wait_ms * 2, self.idle_max_ms)
        return self.wait_ms

    @property
    def idle(self) -> bool:
        """True once the wait has started to back off (nothing fetched for idle_after_s)."""
        return self.wait_ms > self.base_ms

    def records_since(self, then: float | None) -> bool:
        """Whether any fetch returned records after `then` (None: ever)."""
        if self.last_records_at is None:
            return False
        return then is None or self.last_records_at > then


@dataclass
class LagReadSchedule:
    """When a stage's periodic lag read-out (its group's lag and the next stage's) is worth its
    requests. After a read-out that found this stage with no lag of its own (nothing unfetched,
    nothing in flight) and no partition held for the next stage's lag, nothing it reads can
    matter until its consumer fetches records again: its own figures change only by records it
    will fetch, and the next stage's lag only falls until this stage sends more, which it
    admits against a fresh read-out. So reads pause until then, with one read every
    `idle_interval_s` regardless (a stage that only forwards an idle stage's figures, decode's
    bypass leaving preprocess without work, stops reading at once). Clock: the one the fetch
    wait is fed with."""

    idle_interval_s: float
    _quiet_read_at: float | None = None  # the last read-out that found nothing to do here

    def due(self, fetch_wait: AdaptiveFetchWait, now: float) -> bool:
        quiet_at = self._quiet_read_at
        if quiet_at is None or fetch_wait.records_since(quiet_at):
            return True
        return now - quiet_at >= self.idle_interval_s

    def read(self, own_lag: int, holding: bool, now: float) -> None:
        """`holding`: a partition is paused for the next stage's lag; only a read releases it."""
        self._quiet_read_at = now if own_lag <= 0 and not holding else None


@dataclass
class ShortFetchWait:
    """A fetch the broker cut short: it reported records past a partition's fetch offset and
    returned none of them. The embedded broker (Tansu, memory storage) lists every batch of a
    partition to answer a fetch that has records, and stops listing when the fetch's max wait
    runs out; past about 30-45 thousand records in a partition a 20 ms fetch comes back empty
    every time (benchmarks/broker_partition_growth.py), and the stage would stall. So each fetch
    cut short doubles the next one's max wait, up to `max_ms`, until one comes back whole. (The
    listing's cost per fetch still grows with the partition: see the README's known limits.)"""

    max_ms: int = 2000
    wait_ms: int = 0  # 0: the last fetch was whole
    # Fetches cut short in a row. One alone is not the embedded broker's listing: Apache Kafka
    # leaves partitions out of a fetch that reached its size limit, and the next one has them.
    streak: int = 0
    warn_every_s: float = 60.0
    _warned_at: float = field(init=False, default=float("-inf"))

    def after_fetch(self, cut_short: bool, wait_ms: int) -> int:
        """The next fetch's max wait, given the wait the other policies chose."""
        if not cut_short:
            self.wait_ms = self.streak = 0
            return wait_ms
        self.streak += 1
        self.wait_ms = min(max(self.wait_ms, wait_ms, 1) * 2, self.max_ms)
        return max(self.wait_ms, wait_ms)

    def warning_due(self, now: float) -> bool:
        """Whether to log the fetches cut short now: two or more in a row, at most once a
        `warn_every_s` (the stall it warns of lasts)."""
        if self.streak < 2 or now - self._warned_at < self.warn_every_s:
            return False
        self._warned_at = now
        return True
