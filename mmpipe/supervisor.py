"""Runs a whole pipeline on one machine: the embedded broker (unless a bootstrap is given) and
one OS process per stage replica. Used by `up`, `demo`, the tests and the benchmarks; in
production each stage runs as its own container (compose/) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from mmpipe.schemas.settings import SETTINGS_FILE_ENV, Settings, write_settings
from mmpipe.streams.affinity import pipeline_cpus
from mmpipe.streams.broker import EmbeddedBroker, free_port
from mmpipe.streams.kafka import ensure_topics
from mmpipe.streams.topology import PIPELINE, metrics_port

READY_FILE_ENV = "MMPIPE_READY_FILE"


@dataclass
class StageProcess:
    stage: str
    index: int
    process: subprocess.Popen
    ready_file: Path
    log_path: Path

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.index}"

    def alive(self) -> bool:
        return self.process.poll() is None


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

    # Lifecycle ------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = self.settings.state_path("run")

    def start(self, timeout_s: float = 180.0) -> Pipeline:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.embedded_broker:
            port = int(self.settings.bootstrap.rsplit(":", 1)[1]) if ":" in self.settings.bootstrap else 0
            cpus = pipeline_cpus(self.settings.model_cpus) if self.settings.model_cpus else None
            self.broker = EmbeddedBroker(port=port or free_port(), log_path=self.workdir / "broker.log", cpus=cpus)
            self.settings = self.settings.model_copy(update={"bootstrap": self.broker.start()})
        asyncio.run(ensure_topics(self.settings))
        for spec in PIPELINE:
            for index in range(self.replicas.get(spec.name, spec.default_replicas)):
                self.spawn(spec.name, index)
        self.wait_ready(timeout_s)
        return self

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
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "mmpipe.cli", "worker", stage],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        proc = StageProcess(stage, index, process, ready, log_path)
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
        """Until every stage process has joined its group and got its first assignment."""
        deadline = time.monotonic() + timeout_s
        pending = list(procs or self.processes)
        while pending:
            for proc in list(pending):
                if proc.ready_file.exists():
                    pending.remove(proc)
                elif not proc.alive():
                    raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}; log: {proc.log_path}\n{tail(proc.log_path)}")
            if time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise TimeoutError(f"stages not ready after {timeout_s}s: {names}")
            time.sleep(0.2)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
