"""What a fault or overload run's JSON report says about the run itself: the command and its
parameters, the commit, the date, the machine and the settings that shape the figures, so a
report saved under benchmarks/results can be read (and repeated) on its own, like bench.json."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mmpipe.schemas.settings import Settings

# The settings that shape a fault or overload run's figures (never the store URL: it may hold a password).
SETTINGS_SHOWN = (
    "partitions", "models", "device", "torch_threads", "model_cpus", "graph_mode", "decode_workers", "inference_workers",
    "default_batching", "batching", "continuous", "inject_execute_delay_ms", "fault_points",
    "admission_policy", "max_backlog", "default_deadline_s", "max_inflight", "inflight_high_per_partition",
    "inflight_low_per_partition", "downstream_lag_high", "downstream_lag_low", "stream_buffer_maxsize",
    "max_poll_records", "lag_interval_s", "commit_interval_s", "memory_budget_bytes", "poison_max_crashes",
    "video_sample_fps", "session_timeout_s",
)
REPO = Path(__file__).resolve().parents[2]


def git_commit() -> dict[str, Any] | None:
    """HEAD of the checkout this code runs from (else of the working directory), and whether
    tracked files differ from it."""
    for repo in (REPO, Path.cwd()):
        found = _git_head(repo)
        if found is not None:
            return found
    return None


def _git_head(repo: Path) -> dict[str, Any] | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "short": head[:7], "dirty": bool(dirty)}


def machine(settings: Settings) -> dict[str, Any]:
    """The machine summary the benchmark reports (mmpipe/harness/bench/env.py), or a smaller
    one where its dependencies (psutil, the [bench] extra) are missing."""
    from mmpipe.models.torch_util import resolve_device

    device = resolve_device(settings.device)
    try:
        from mmpipe.harness.bench.env import environment

        info = environment(device)
        info.pop("git_commit", None)  # reported at the top, in full
        return info
    except ImportError:
        return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
                "cpu_count": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
                "device": device}


def run_meta(command: str, parameters: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Taken when the run starts (the load average is the machine's before the run)."""
    return {
        "command": command,
        "argv": ["mmpipe", *sys.argv[1:]],
        "parameters": parameters,
        "git": git_commit(),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "started_unix": round(time.time(), 1),
        "machine": machine(settings),
        "settings": settings.model_dump(mode="json", include=set(SETTINGS_SHOWN)),
    }


def finish_meta(meta: dict[str, Any]) -> dict[str, Any]:
    meta["finished_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    meta["wall_s"] = round(time.time() - meta["started_unix"], 1)
    meta["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return meta


def write_report(path: Path, meta: dict[str, Any], report: Any) -> dict[str, bool]:
    """The run's JSON report at `path`: meta (finished now), the report's checks, its figures.
    Returns the checks."""
    import orjson

    checks = report.checks()
    document = {"meta": finish_meta(meta), "checks": checks, **report.as_dict()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    return checks
