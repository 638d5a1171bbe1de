"""What the run cost: RSS and CPU time of every stage process, the whole machine's CPU (so load
from other users of a shared machine shows), GPU utilisation and memory where there is a GPU,
and consumer lag. (The inference stage's own metrics are read in pipeline_run.py.)

A background thread samples every process; a window (one measured run) reports CPU used per
process as cores (CPU seconds / wall seconds) and the peak RSS seen inside it. Peaks over the
whole benchmark are kept too: memory must stay bounded across every load, not just one.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from mmpipe.schemas.settings import Settings
from mmpipe.streams.kafka import LagReader
from mmpipe.streams.tasks import cancel_and_wait
from mmpipe.streams.topology import stage_names

MiB = 1024 * 1024


@dataclass
class _Window:
    started: float
    cpu_start: dict[str, float]
    system_start: Any
    peak_rss: dict[str, int] = field(default_factory=dict)
    gpu_util: list[float] = field(default_factory=list)
    gpu_mem: list[float] = field(default_factory=list)


class ResourceSampler:
    def __init__(self, interval_s: float = 0.5, gpu: bool = False) -> None:
        self.interval_s = interval_s
        self.gpu = gpu and shutil.which("nvidia-smi") is not None
        self._procs: dict[str, psutil.Process] = {}
        self._trees: set[str] = set()  # names whose child processes count as theirs
        self._cpu: dict[str, float] = {}  # last CPU seconds seen per name (windows never span a restart)
        self.peak_rss: dict[str, int] = {}
        self.gpu_mem_peak_mib = 0.0
        self._window: _Window | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resource-sampler", daemon=True)
        self._last_gpu = 0.0

    # Processes ------------------------------------------------------------------------------
    def watch(self, name: str, pid: int, with_children: bool = False) -> None:
        """Follow a process under a stable name; a restarted stage keeps its name. With
        `with_children`, its CPU includes its child processes' (a stage's: decode's worker
        processes do its decoding), never for one whose children are watched on their own."""
        with self._lock:
            try:
                self._procs[name] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                return
            if with_children:
                self._trees.add(name)
            else:
                self._trees.discard(name)
        self._sample()

    def unwatch(self, name: str) -> None:
        with self._lock:
            self._procs.pop(name, None)
            self._trees.discard(name)

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # Windows --------------------------------------------------------------------------------
    def begin(self) -> None:
        self._sample()
        with self._lock:
            self._window = _Window(time.monotonic(), dict(self._cpu), psutil.cpu_times())

    def end(self) -> dict[str, Any]:
        self._sample()
        with self._lock:
            window, self._window = self._window, None
            # Processes watched now: one that no longer runs (preprocess, with decode and
            # preprocess fused) keeps its last reading, which is no CPU in this window.
            cpu_now = {name: cpu for name, cpu in self._cpu.items() if name in self._procs}
        assert window is not None, "end() without begin()"
        wall = max(time.monotonic() - window.started, 1e-6)
        cores = {name: round((cpu_now[name] - window.cpu_start.get(name, 0.0)) / wall, 3) for name in cpu_now}
        busy = _busy_cores(window.system_start, psutil.cpu_times(), wall)
        report: dict[str, Any] = {
            "wall_s": round(wall, 2),
            "cpu_cores": cores,
            "machine_busy_cores": round(busy, 3),
            # Busy time nobody of ours accounts for: other users of the machine.
            "other_busy_cores": round(max(busy - sum(cores.values()), 0.0), 3),
            "machine_cores": psutil.cpu_count(),
            "peak_rss_mib": {name: round(rss / MiB, 1) for name, rss in window.peak_rss.items()},
        }
        if window.gpu_util:
            report["gpu_util_pct"] = {"mean": round(sum(window.gpu_util) / len(window.gpu_util), 1), "max": max(window.gpu_util)}
            report["gpu_mem_used_mib_max"] = max(window.gpu_mem)
        return report

    # Sampling ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        with self._lock:
            procs = [(name, proc, name in self._trees) for name, proc in self._procs.items()]
        readings = {}
        for name, proc, tree in procs:
            try:
                with proc.oneshot():
                    cpu = _tree_cpu_s(proc) if tree else sum(proc.cpu_times()[:2])
                    readings[name] = (cpu, proc.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        gpu = self._gpu_reading()
        with self._lock:
            for name, (cpu, rss) in readings.items():
                self._cpu[name] = cpu
                self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss)
                if self._window is not None:
                    self._window.peak_rss[name] = max(self._window.peak_rss.get(name, 0), rss)
            if gpu is not None:
                self.gpu_mem_peak_mib = max(self.gpu_mem_peak_mib, gpu[1])
                if self._window is not None:
                    self._window.gpu_util.append(gpu[0])
                    self._window.gpu_mem.append(gpu[1])

    def _gpu_reading(self) -> tuple[float, float] | None:
        """(utilisation %, memory used MiB) of GPU 0, at most once a second."""
        if not self.gpu or time.monotonic() - self._last_gpu < 1.0:
            return None
        self._last_gpu = time.monotonic()
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True, text=True, timeout=5, check=True,
            ).stdout.strip()
            util, mem = (float(x) for x in out.split(","))
            return util, mem
        except (OSError, subprocess.SubprocessError, ValueError):
            return None


def _tree_cpu_s(proc: psutil.Process) -> float:
    return sum(tree_cpu_times(proc))


def tree_cpu_times(proc: psutil.Process) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its descendants: its own, those of the
    children it reaped (children_*: a recycled decode worker), and each live descendant's
    likewise. A child's time moves from its own count to its parent's children_* when reaped,
    so nothing counts twice."""
    user = system = 0.0
    for member in (proc, *proc.children(recursive=True)):
        try:
            times = member.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone between the listing and the reading: its parent reaps it
        user += times.user + times.children_user
        system += times.system + times.children_system
    return user, system


def _busy_cores(before: Any, after: Any, wall: float) -> float:
    def busy(t: Any) -> float:
        # Linux counts guest time inside user time as well; iowait is idle.
        extra = sum(getattr(t, f, 0.0) for f in ("iowait", "guest", "guest_nice"))
        return sum(t) - t.idle - extra

    return (busy(after) - busy(before)) / wall


class LagSampler:
    """Peak consumer lag per stage group (messages not yet committed), read from the broker
    like `mmpipe lag` does, every `interval_s` while a run is in progress."""

    def __init__(self, settings: Settings, interval_s: float = 1.0) -> None:
        self.settings = settings
        self.interval_s = interval_s
        self.peaks: dict[str, int] = {}
        self.last: dict[str, int] = {}  # the latest reading per stage
        self._reader: LagReader | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LagSampler:
        self._reader = LagReader(self.settings)
        self._task = asyncio.ensure_future(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_and_wait(self._task)
        if self._reader is not None:
            await self._reader.close()

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    async def sample(self) -> None:
        assert self._reader is not None
        for stage in stage_names(self.settings):
            try:
                rows = await self._reader.read_stage(stage)
            except Exception:  # telemetry: a failed read must not fail the run
                continue
            lag = sum(row.lag for row in rows)
            self.last[stage] = lag
            self.peaks[stage] = max(self.peaks.get(stage, 0), lag)

    def idle(self) -> bool:
        """Every stage has committed all it was given (nothing is in flight anywhere)."""
        return set(self.last) >= set(stage_names(self.settings)) and all(lag <= 0 for lag in self.last.values())
