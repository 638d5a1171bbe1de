"""Device selection and the inference context shared by the torch models."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from mmpipe.schemas.settings import ContinuousSettings

log = logging.getLogger(__name__)


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


def frozen_graph(module: torch.nn.Module, example: torch.Tensor, check: torch.Tensor) -> torch.jit.ScriptModule | None:
    """`module` traced on `example` and frozen (weights inlined, batch norm folded): a forward
    that is one call into C++, which releases the GIL for its whole length. An eager forward
    takes the GIL back between layers, and another thread of the process holding it (the
    inference stage's event loop) stalls the model each time: in benchmarks/gil_contention.py
    a thread holding the GIL 30 % of the time slowed an eager resnet18 1.2-1.3x and the frozen
    graph not at all. None (eager stays) when tracing fails or the graph's output on `check`
    (another batch size) differs from the module's."""
    try:
        with torch.inference_mode():
            graph = torch.jit.freeze(torch.jit.trace(module, example))
            expected, got = module(check), graph(check)
    except Exception as exc:  # an operation tracing cannot capture: serve it eagerly
        log.warning("no frozen graph for %s: %s", type(module).__name__, exc)
        return None
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-3, atol=1e-4):
        log.warning("frozen graph of %s differs from its module; keeping it eager", type(module).__name__)
        return None
    return graph


def gpu_memory_bytes() -> int:
    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0


def kv_cache_budget(settings: ContinuousSettings, device: str) -> int:
    """KV-cache bytes for an autoregressive model: the configured bytes, or on CUDA (when a
    fraction is set) that share of the memory free now, after the weights are loaded."""
    if device.startswith("cuda") and settings.kv_cache_gpu_fraction > 0:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * settings.kv_cache_gpu_fraction)
    return settings.kv_cache_budget_bytes
