"""Device selection and the inference context shared by the torch models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mmpipe.schemas.settings import ContinuousSettings


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
    return device


@contextlib.contextmanager
def inference_context(device: str) -> Iterator[None]:
    """No autograd; on a GPU, fp16 autocast (tensor cores), on the CPU plain fp32."""
    with torch.inference_mode():
        if device.startswith("cuda"):
            with torch.autocast("cuda", dtype=torch.float16):
                yield
        else:
            yield


def gpu_memory_bytes() -> int:
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0


def kv_cache_budget(settings: ContinuousSettings, device: str) -> int:
    """KV-cache bytes for an autoregressive model: the configured bytes, or on CUDA (when a
    fraction is set) that share of the memory free now, after the weights are loaded."""
    if device.startswith("cuda") and settings.kv_cache_gpu_fraction > 0:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * settings.kv_cache_gpu_fraction)
    return settings.kv_cache_budget_bytes
