"""The one small model interface every stage talks to.

A model has two halves, like a Triton model repository entry:

* ModelSpec  - the declarative contract plus the CPU-side work: what decode should produce,
               how preprocess turns decoded media into model-ready tensors, how items are
               grouped into shape buckets. No weights; decode and preprocess import only this.
* LoadedModel - the weights on a device and `predict(batch)`. Only the inference stage loads it.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmpipe.schemas import ModelRef


class ModelError(Exception):
    """Base of the model errors a stage turns into a clear status."""


class UnknownModel(ModelError):
    def __init__(self, ref: str, known: Sequence[str]) -> None:
        super().__init__(f"unknown model {ref!r}; known: {', '.join(sorted(known))}")


class WrongModality(ModelError):
    pass


class WeightsUnavailable(ModelError):
    pass


class BadInput(ModelError):
    """An input the model cannot take (wrong shape, empty text, too long): never retried."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]  # -1 marks a variable dimension
    value_range: tuple[int, int] | None = None  # inclusive bounds of integer values (token ids)


@dataclass(frozen=True)
class DecodeHints:
    """What decode should hand to this model's preprocess."""

    image_short_side: int | None = None  # frames are downscaled in the RGB conversion pass
    # then cut to this centre square, as preprocess would: the pixels preprocess drops never
    # travel (the frame's meta says `center_crop` where decode cut it)
    image_center_crop: int | None = None
    audio_sample_rate: int | None = None
    audio_window_s: float | None = None  # long audio is cut into windows of this length


@dataclass(frozen=True)
class ModelConfig:
    """The operator-readable contract of one model version."""

    name: str
    version: str
    kind: str  # the work-item kind it takes: image | audio | text
    description: str
    inputs: tuple[TensorSpec, ...]
    output: str
    decode: DecodeHints = DecodeHints()
    max_batch_size: int = 64  # model/memory bound; the batcher's limit is capped by it
    length_buckets: tuple[int, ...] = ()  # variable-length inputs are padded up to one of these
    # predict keeps no state between calls and may run on two threads at once (only then does
    # the batcher give urgent items a second model thread: streams/batching.py, the urgent slot)
    reentrant_predict: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> ModelRef:
        return ModelRef(self.name, self.version)


class LoadedModel(abc.ABC):
    """Weights on a device. `predict` runs on the inference stage's executor thread."""

    def __init__(self, spec: ModelSpec, device: str, weights: str) -> None:
        self.spec = spec
        self.device = device
        self.weights = weights  # "pretrained", "local:<file>" or "random"

    @abc.abstractmethod
    def predict(self, batch: list[dict[str, np.ndarray]]) -> list[Any]:
        """One output (JSON-serialisable) per input, in order."""

    def warmup(self) -> None:
        """Run once on a representative input so the first real batch is not slow."""

    def freeze_graph(self) -> bool:
        """Swap the Python-level forward for a frozen graph where this model has one (same
        outputs, checked when swapped). True when swapped; the default keeps it eager."""
        return False


class AutoregressiveModel(LoadedModel):
    """A model that generates step by step: the inference stage serves it with the continuous
    batcher (streams/continuous.py, whose StepModel protocol the methods below fulfil) instead of
    calling `predict` in batches."""

    eot: int
    max_new_tokens: int

    @property
    @abc.abstractmethod
    def bytes_per_sequence(self) -> int:
        """KV-cache bytes one sequence reserves at most."""

    @abc.abstractmethod
    def reserve_cache(self, budget_bytes: int) -> int:
        """Preallocate the KV cache within the budget; returns how many sequences it holds."""

    @abc.abstractmethod
    def immediate(self, payload: dict[str, np.ndarray]) -> Any | None:
        """The output when nothing needs generating, else None."""

    @abc.abstractmethod
    def sequence_bytes(self, payload: dict[str, np.ndarray]) -> int:
        """The sequence's reservation; raises BadInput on input the model cannot take."""

    @abc.abstractmethod
    def prompt(self, payload: dict[str, np.ndarray]) -> list[int]:
        """Forced tokens fed before the first generated one."""

    @abc.abstractmethod
    def run_iteration(self, iteration: Any) -> list[int]:
        """Row moves, the joining sequences' encoder pass, one decoder step: the next tokens."""

    @abc.abstractmethod
    def output(self, payload: dict[str, np.ndarray], tokens: list[int], reason: str) -> Any:
        """The answer from the generated tokens and why generation stopped."""


class ModelSpec(abc.ABC):
    config: ModelConfig

    @property
    def ref(self) -> ModelRef:
        return self.config.ref

    @abc.abstractmethod
    def preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, np.ndarray]:
        """Decoded media -> model-ready tensors (runs in the preprocess stage)."""

    def needs_preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> bool:
        """False where decode already did this model's transform and preprocess() is only a
        copy: the part may skip the preprocess stage (Settings.preprocess_bypass)."""
        return True

    def check_input(self, tensors: dict[str, np.ndarray]) -> None:
        """Raise BadInput unless `tensors` is what config.inputs declares: the same names, dtypes
        and ranks, fixed dimensions equal, variable ones within the largest length bucket,
        integers within their value range (an out-of-range token id is a device-side assert on
        CUDA that fails every later batch of the replica), floats finite."""
        declared = {spec.name: spec for spec in self.config.inputs}
        if set(tensors) != set(declared):
            raise BadInput(f"{self.ref} takes tensors {sorted(declared)}, got {sorted(tensors)}")
        longest = max(self.config.length_buckets, default=None)
        for name, spec in declared.items():
            _check_tensor(spec, tensors[name], longest)

    def bucket_key(self, tensors: dict[str, np.ndarray]) -> Hashable:
        """Items with equal keys can share a batch. Default: identical shapes."""
        return tuple((name, array.shape) for name, array in sorted(tensors.items()))

    @abc.abstractmethod
    def load(self, device: str, weights_dir: str, allow_random: bool) -> LoadedModel:
        ...

    def example_input(self) -> dict[str, np.ndarray]:
        """A model-ready input for warm-up and benchmarks."""
        raise NotImplementedError


def _check_tensor(spec: TensorSpec, array: np.ndarray, longest: int | None) -> None:
    if array.dtype.name != spec.dtype or array.ndim != len(spec.shape):
        raise BadInput(f"{spec.name}: want {spec.dtype}{list(spec.shape)}, got {array.dtype.name}{list(array.shape)}")
    for want, got in zip(spec.shape, array.shape):
        if (want != -1 and got != want) or (want == -1 and longest is not None and got > longest):
            raise BadInput(f"{spec.name}: shape {list(array.shape)} does not fit {list(spec.shape)} (longest bucket {longest})")
    if array.size == 0:
        return
    if spec.value_range is not None:
        low, high = spec.value_range
        if array.min() < low or array.max() > high:
            raise BadInput(f"{spec.name}: values outside [{low}, {high}]")
    elif array.dtype.kind == "f" and not np.isfinite(array).all():
        raise BadInput(f"{spec.name}: values that are not finite")


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """Smallest bucket that holds `length` (inputs longer than the last are refused upstream)."""
    for bound in buckets:
        if length <= bound:
            return bound
    return buckets[-1] if buckets else length
