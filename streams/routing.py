"""Lag-aware placement of work items onto the ready topic (placement, not execution).

The preprocess stage asks a Router which partition of `ready` each work item goes to; the
inference workers that own those partitions execute and report what happened (WorkerState on
the `workers` topic: partitions, readiness, loaded models, measured service and queue times).
The router works from those slightly stale signals and counts what it sent itself since, so
it does not pile onto one partition between two reports.

Expected wait of partition p = backlog of p's owner x the owner's measured seconds per item.
A worker drains all its partitions through one batcher, so the owner's whole backlog is what
an item waits behind. The backlog now is estimated as a fluid queue from the owner's last
report: the items it held then, plus what this router sent to its partitions since, less what
it drained since at its measured rate (never below what was sent in the last item time). The
worker's own count is exact where the group's committed lag is not: lag also counts work
finished since the last commit (up to commit_interval_s of it), which made a fast worker look
as backed up as a slow one. A worker that reports no backlog (an older writer) is estimated
from the lag read-out plus what was sent since it.

Guardrails, because chasing the lowest queue thrashes:
  * only partitions whose owner reported recently, is ready and has the model loaded;
    with none, the item keeps its hash partition (today's behaviour) - nothing is held back;
  * sticky: a choice is kept for route_sticky_s, so noise changes the preferred partition at
    most once per window (flips/minute <= 60 / route_sticky_s); inside the window only a
    partition expected to wait route_escape_ratio times less (a burst sent to the current one,
    a worker that slowed down) ends the window early, and a not-ready one is left at once;
  * hysteresis: after the window the router switches only to a partition that is better by
    route_hysteresis (relative) and route_min_gain_s (absolute);
  * a share cap: no partition takes more than route_max_share of the last route_share_window
    decisions; beyond it the item goes to the next best eligible partition.

Backpressure is unchanged: preprocess still pauses its input partition p while ready
partition p lags past downstream_lag_high (with routing that is conservative: the router
already steers away from a lagging partition, so it drains).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mmpipe.schemas.events import WorkerState
from mmpipe.schemas.settings import SchedulingSettings


@dataclass
class _Choice:
    partition: int
    since: float


@dataclass
class Router:
    settings: SchedulingSettings
    clock: Callable[[], float]  # epoch seconds, like WorkerState.at
    workers: dict[str, WorkerState] = field(default_factory=dict)
    lag: dict[int, int] = field(default_factory=dict)  # the inference group's, per partition
    sent: Counter[int] = field(default_factory=Counter)  # routed here since the lag read-out
    _sends: deque[tuple[float, int]] = field(default_factory=deque)  # (when, partition), recent
    flips: int = 0  # changes of the preferred partition ...
    escapes: int = 0  # ... of which inside a sticky window (route_escape_ratio)
    _choices: dict[str, _Choice] = field(default_factory=dict)  # per model
    _recent: deque[int] = field(default_factory=deque)

    # Signals ------------------------------------------------------------------------------
    def observe_worker(self, state: WorkerState) -> None:
        current = self.workers.get(state.worker)
        if current is None or current.at <= state.at:
            self.workers[state.worker] = state
        # Workers are named host-pid, so every restart adds one, and the compacted topic keeps
        # them all: forget those silent for twice the staleness bound (no decision reads them).
        horizon = self.clock() - 2 * self.settings.worker_state_stale_s
        for name in [name for name, known in self.workers.items() if known.at < horizon]:
            del self.workers[name]

    def forget_worker(self, worker: str) -> None:
        """The worker stopped (its tombstone): no longer a partition's owner."""
        self.workers.pop(worker, None)

    def observe_lag(self, lag: dict[int, int]) -> None:
        """A fresh read-out of the inference group's lag: it includes what we sent before it."""
        self.lag = dict(lag)
        self.sent.clear()

    # Decisions ----------------------------------------------------------------------------
    def expected_waits(self, model: str) -> dict[int, float]:
        """Expected wait (seconds) per eligible partition for an item of `model`."""
        owners = self._owners(model)
        known = [s.item_s for s in owners.values() if s.item_s]
        # Unmeasured (new, or never sent anything): as fast as the fastest, so it gets tried.
        default_item_s = min(known) if known else 1.0
        item_s = {state.worker: state.item_s or default_item_s for state in owners.values()}
        backlog = self._backlogs(owners, item_s)
        return {partition: (backlog[state.worker] + 1) * item_s[state.worker] for partition, state in owners.items()}

    def choose(self, model: str, fallback: int | None = None) -> int | None:
        """The partition for one item of `model`; `fallback` (None: the key's hash partition)
        when no partition is eligible."""
        waits = self.expected_waits(model)
        if not waits:
            return fallback
        now = self.clock()
        partition = self._capped(self._preferred(model, waits, now), waits)
        self._record(partition)
        return partition

    def measured_waits(self) -> dict[int, float]:
        """The queue wait each partition's current owner last measured, beside expected_waits."""
        horizon = self.clock() - self.settings.worker_state_stale_s
        waits: dict[int, float] = {}
        for state in sorted(self.workers.values(), key=lambda s: s.at):
            if state.at >= horizon:
                waits.update({int(p): w for p, w in state.waits_s.items() if int(p) in state.partitions})
        return waits

    @property
    def models(self) -> list[str]:
        """The models this router has placed work for."""
        return sorted(self._choices)

    def shares(self) -> dict[int, float]:
        total = len(self._recent)
        return {p: n / total for p, n in Counter(self._recent).items()} if total else {}

    # ---------------------------------------------------------------------------------------
    def _owners(self, model: str) -> dict[int, WorkerState]:
        """partition -> the freshest ready worker claiming it, among recent reports."""
        horizon = self.clock() - self.settings.worker_state_stale_s
        owners: dict[int, WorkerState] = {}
        for state in self.workers.values():
            if state.at < horizon or not state.ready or model not in state.models:
                continue
            for partition in state.partitions:
                if partition not in owners or owners[partition].at < state.at:
                    owners[partition] = state
        # A partition also claimed by a fresher not-ready worker has moved: not eligible.
        for state in self.workers.values():
            for partition in state.partitions:
                if partition in owners and state.at > owners[partition].at and not state.ready:
                    del owners[partition]
        return owners

    def _backlogs(self, owners: dict[int, WorkerState], item_s: dict[str, float]) -> dict[str, float]:
        """Items queued at each owning worker now (see the module's docstring)."""
        now = self.clock()
        partitions: dict[str, list[int]] = {}
        for partition, state in owners.items():
            partitions.setdefault(state.worker, []).append(partition)
        backlog: dict[str, float] = {}
        for worker, mine in partitions.items():
            state = owners[mine[0]]
            if state.backlog is None:
                backlog[worker] = sum(self.lag.get(p, 0) + self.sent[p] for p in mine)
                continue
            since = self._sent_since(state.at, mine)
            recent = self._sent_since(now - item_s[worker], mine)
            drained = max(now - state.at, 0.0) / item_s[worker]
            backlog[worker] = max(state.backlog + since - drained, recent)
        return backlog

    def _sent_since(self, moment: float, partitions: list[int]) -> int:
        count = 0
        for at, partition in reversed(self._sends):  # newest first; one sent at `moment` counts
            if at < moment:
                break
            count += partition in partitions
        return count

    def _preferred(self, model: str, waits: dict[int, float], now: float) -> int:
        best = min(waits, key=lambda p: (waits[p], self.lag.get(p, 0) + self.sent[p], p))
        choice = self._choices.get(model)
        escape = False
        if choice is not None and choice.partition in waits:
            current = waits[choice.partition]
            escape = current > self.settings.route_escape_ratio * waits[best]
            sticky = now - choice.since < self.settings.route_sticky_s
            if (sticky and not escape) or not self._clearly_better(waits[best], current):
                return choice.partition
        if choice is not None and choice.partition != best:
            self.flips += 1
            self.escapes += escape and now - choice.since < self.settings.route_sticky_s
        self._choices[model] = _Choice(best, now)
        return best

    def _clearly_better(self, best: float, current: float) -> bool:
        gain = current - best
        return gain >= self.settings.route_min_gain_s and gain >= self.settings.route_hysteresis * current

    def _capped(self, partition: int, waits: dict[int, float]) -> int:
        """The preferred partition unless it already holds its share cap of recent decisions;
        then the best eligible one under the cap (the preferred one if all are over it)."""
        window = self.settings.route_share_window
        limit = self.settings.route_max_share * window
        # The window this decision will close: the last window - 1 decisions and this one.
        counts = Counter(list(self._recent)[max(len(self._recent) - window + 1, 0):] if window > 1 else [])
        if counts[partition] + 1 <= limit or len(waits) == 1:
            return partition
        under = [p for p in waits if counts[p] + 1 <= limit]
        return min(under, key=lambda p: waits[p]) if under else partition

    def _record(self, partition: int) -> None:
        self.sent[partition] += 1
        now = self.clock()
        self._sends.append((now, partition))
        while self._sends and self._sends[0][0] < now - self.settings.worker_state_stale_s:
            self._sends.popleft()  # older than any report still trusted
        self._recent.append(partition)
        while len(self._recent) > self.settings.route_share_window:
            self._recent.popleft()
