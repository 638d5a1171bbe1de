"""Runs a whole pipeline on one machine: the embedded broker (unless a bootstrap is given) and
one OS process per stage replica. Used by `up`, `demo`, the tests and the benchmarks; in
production each stage runs as its own container (compose/) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from mmpipe.schemas.settings import SETTINGS_FILE_ENV, Settings, write_settings
from mmpipe.streams.affinity import pipeline_cpus
from mmpipe.streams.broker import EmbeddedBroker, free_port
from mmpipe.streams.children import die_with_parent
from mmpipe.streams.kafka import ensure_topics
from mmpipe.streams.topology import PIPELINE, PORTS_PER_STAGE, StageSpec, metrics_port, pipeline_of

READY_FILE_ENV = "MMPIPE_READY_FILE"


def supervisor_metrics_port(base: int) -> int:
    """`up` serves its own metrics (restarts, processes up) in the slot after the last stage's."""
    return base + PORTS_PER_STAGE * len(PIPELINE)


METRICS_PORT_SPAN = PORTS_PER_STAGE * (len(PIPELINE) + 1)  # every stage's slot and `up`'s own


@dataclass
class StageProcess:
    stage: str
    index: int
    process: subprocess.Popen
    ready_file: Path
    log_path: Path
    restarts: int = 0  # times this replica was started again after its first start
    crashes: int = 0  # exits in a row without a stable run in between (drives the backoff)
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # set while an exited process waits out its backoff
    reported_ready: bool = False

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.index}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_reason(self) -> str:
        """Why it exited, in one line: the signal, or the exit code and its log's last word."""
        code = self.process.returncode
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}: {last_reason(self.log_path)}"


@dataclass(frozen=True)
class StartFailure:
    process: str
    reason: str
    log_path: Path | None

    def line(self) -> str:
        return f"{self.process}: {self.reason}" + (f"  (log: {self.log_path})" if self.log_path else "")


class StartFailed(RuntimeError):
    """Some processes did not come up; everything that did was stopped again."""

    def __init__(self, failures: list[StartFailure]) -> None:
        self.failures = failures
        super().__init__("pipeline did not start:\n" + "\n".join(f.line() for f in failures))


@dataclass(frozen=True)
class RestartPolicy:
    """Capped exponential backoff: 1, 2, 4 ... `cap_s` seconds between restarts of a replica
    that keeps crashing; a replica that ran `stable_s` without exiting starts over at 1 s."""

    base_s: float = 1.0
    cap_s: float = 30.0
    stable_s: float = 60.0

    def delay_s(self, crashes: int) -> float:
        return min(self.cap_s, self.base_s * 2 ** max(crashes - 1, 0))


@dataclass(frozen=True)
class SupervisorEvent:
    kind: str  # "exited" (restart scheduled), "restarted" (spawned again), "ready" (rejoined its group)
    process: str
    pid: int
    restarts: int
    detail: str  # exited: the reason and the backoff; else empty
    log_path: Path

    def line(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.process} (pid {self.pid}) {self.kind}{detail}  [restarts: {self.restarts}; log: {self.log_path}]"


class SupervisorMetrics:
    """What `up` itself exports: restarts per replica, and which replicas run now."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "mm_supervisor_restarts_total", "Stage processes started again after they exited",
            ["stage", "replica"], registry=self.registry,
        )
        self.running = Gauge(
            "mm_supervisor_process_up", "1 while the stage process runs", ["stage", "replica"], registry=self.registry,
        )
        self._server: object | None = None

    def serve(self, port: int) -> None:
        self._server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


@dataclass
class Pipeline:
    settings: Settings
    workdir: Path | None = None  # default: <state_dir>/run
    embedded_broker: bool = True
    replicas: dict[str, int] = field(default_factory=dict)
    metrics_base_port: int = 0  # 0: no metrics servers; else stage i replica j gets base+10*i+j
    extra_env: dict[str, str] = field(default_factory=dict)
    # Per-replica settings changes, e.g. {("inference", 1): {"inject_execute_delay_ms": 50}}.
    replica_overrides: dict[tuple[str, int], dict] = field(default_factory=dict)
    broker: EmbeddedBroker | None = None
    processes: list[StageProcess] = field(default_factory=list)
    metrics: SupervisorMetrics = field(default_factory=SupervisorMetrics)

    # Lifecycle ------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = self.settings.state_path("run")

    def start(self, timeout_s: float = 180.0) -> Pipeline:
        """Broker, topics, every stage replica, until all have joined their groups. If anything
        fails to come up, whatever did start is stopped again before StartFailed is raised."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.embedded_broker:
                self._start_broker()
            asyncio.run(ensure_topics(self.settings))
            for spec in pipeline_of(self.settings):
                for index in range(self.replica_count(spec)):
                    self.spawn(spec.name, index)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def replica_count(self, spec: StageSpec) -> int:
        """How many processes of this stage the pipeline starts with."""
        return self.replicas.get(spec.name, spec.default_replicas)

    def _start_broker(self) -> None:
        port = int(self.settings.bootstrap.rsplit(":", 1)[1]) if ":" in self.settings.bootstrap else 0
        log_path = self.workdir / "broker.log"
        cpus = pipeline_cpus(self.settings.model_cpus) if self.settings.model_cpus else None
        self.broker = EmbeddedBroker(port=port or free_port(), log_path=log_path, cpus=cpus)
        try:
            self.settings = self.settings.model_copy(update={"bootstrap": self.broker.start()})
        except (RuntimeError, TimeoutError) as exc:
            raise StartFailed([StartFailure("broker", f"{exc}: {last_reason(log_path)}", log_path)]) from None

    def stop(self) -> None:
        for proc in self.processes:
            if proc.alive():
                proc.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.process.wait(max(deadline - time.monotonic(), 0.1))
            if proc.alive():
                proc.process.kill()
                proc.process.wait()
        if self.broker is not None:
            self.broker.stop()
        self.metrics.close()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # Processes --------------------------------------------------------------------------------
    def settings_file(self) -> Path:
        return write_settings(self.settings, self.workdir / "settings.json")

    def spawn(self, stage: str, index: int = 0) -> StageProcess:
        ready = self.workdir / f"{stage}-{index}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{stage}-{index}.log"
        settings = self.settings.model_copy(update=self.replica_overrides.get((stage, index), {}))
        if self.metrics_base_port:
            port = metrics_port(self.metrics_base_port, stage, index)
            settings = settings.model_copy(update={"metrics_port": port})
        settings_path = write_settings(settings, self.workdir / f"{stage}-{index}.settings.json")
        env = dict(os.environ, **self.extra_env)
        env.update({SETTINGS_FILE_ENV: str(settings_path), READY_FILE_ENV: str(ready), "PYTHONUNBUFFERED": "1"})
        env["_TYPER_STANDARD_TRACEBACK"] = "1"  # plain tracebacks: the log's last line names the error
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "mmpipe.cli", "worker", stage],
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent(),
            )
        proc = StageProcess(stage, index, process, ready, log_path)
        previous = next((p for p in self.processes if p.name == proc.name), None)
        if previous is not None:
            proc.restarts, proc.crashes = previous.restarts + 1, previous.crashes
            self.metrics.restarts.labels(stage, str(index)).inc()
        self.metrics.running.labels(stage, str(index)).set(1)
        self.processes = [p for p in self.processes if p.name != proc.name] + [proc]
        return proc

    def process(self, stage: str, index: int = 0) -> StageProcess:
        return next(p for p in self.processes if p.stage == stage and p.index == index)

    def kill(self, stage: str, index: int = 0, sig: int = signal.SIGKILL) -> None:
        proc = self.process(stage, index)
        proc.process.send_signal(sig)
        proc.process.wait(30)

    def restart(self, stage: str, index: int = 0, timeout_s: float = 120.0) -> StageProcess:
        proc = self.spawn(stage, index)
        self.wait_ready(timeout_s, [proc])
        return proc

    def wait_ready(self, timeout_s: float, procs: list[StageProcess] | None = None) -> None:
        """Until every stage process has joined its group and got its first assignment.
        StartFailed names every process that exited (a failure often takes several down
        together: give them `FAILURE_GRACE_S` to show it) or, at the timeout, is still not ready."""
        deadline = time.monotonic() + timeout_s
        pending = list(procs or self.processes)
        while pending:
            pending = [proc for proc in pending if not proc.ready_file.exists()]
            if any(not proc.alive() for proc in pending):
                time.sleep(FAILURE_GRACE_S)
                raise StartFailed([
                    StartFailure(proc.name, proc.exit_reason(), proc.log_path) for proc in pending if not proc.alive()
                ])
            if time.monotonic() > deadline:
                raise StartFailed([
                    StartFailure(proc.name, f"not ready after {timeout_s:.0f}s; last log line: {last_reason(proc.log_path)}",
                                 proc.log_path)
                    for proc in pending
                ])
            time.sleep(0.2)

    # Supervision ------------------------------------------------------------------------------
    def supervise(
        self,
        until: Callable[[], bool],
        on_event: Callable[[SupervisorEvent], None],
        policy: RestartPolicy = RestartPolicy(),
        poll_s: float = 0.2,
    ) -> None:
        """Restart every stage process that exits, with capped exponential backoff, until
        `until()` is true. Runs on the thread that started the processes (see die_with_parent)."""
        while not until():
            now = time.monotonic()
            for proc in list(self.processes):
                event = self._check(proc, now, policy)
                if event is not None:
                    on_event(event)
            time.sleep(poll_s)

    def _check(self, proc: StageProcess, now: float, policy: RestartPolicy) -> SupervisorEvent | None:
        def event(kind: str, p: StageProcess, detail: str = "") -> SupervisorEvent:
            return SupervisorEvent(kind, p.name, p.process.pid, p.restarts, detail, p.log_path)

        if proc.alive():
            if now - proc.started_at >= policy.stable_s:
                proc.crashes = 0
            if not proc.reported_ready and proc.restarts and proc.ready_file.exists():
                proc.reported_ready = True
                return event("ready", proc)
            return None
        if proc.restart_at is None:  # just exited
            proc.crashes += 1
            delay = policy.delay_s(proc.crashes)
            proc.restart_at = now + delay
            self.metrics.running.labels(proc.stage, str(proc.index)).set(0)
            return event("exited", proc, f"{proc.exit_reason()}; restarting in {delay:.0f}s")
        if now >= proc.restart_at:
            return event("restarted", self.spawn(proc.stage, proc.index))
        return None


# After one process fails to start, how long to wait for others failing for the same reason.
FAILURE_GRACE_S = 2.0

# A traceback's exception line: "ValueError: ...", "mmpipe.models.base.WeightsUnavailable: ...".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Unavailable|Exit|Interrupt|Failed)\b.*")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Where a crash report puts its reason: the first unindented line after a Python traceback's
# header; the line after a Rust panic's "panicked at" (the broker).
_REASON_AFTER = ("Traceback (most recent call last):", "panicked at ")


def last_reason(path: Path, max_chars: int = 300) -> str:
    """The log's last meaningful line: the exception that ended its last traceback (or panic),
    else the last line that names an error, else its last line."""
    try:
        text = _ANSI.sub("", path.read_text(errors="replace"))
    except OSError:
        return "(no log)"
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if any(marker in line for marker in _REASON_AFTER)]
    if starts:
        found = next((line for line in lines[starts[-1] + 1:] if not line[:1].isspace()), None)
        if found:
            return found[:max_chars]
    found = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line) or " ERROR " in line), None)
    return (found or (lines[-1] if lines else "(empty log)"))[:max_chars]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
