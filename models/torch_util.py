"""Device selection and the inference context shared by the torch models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
