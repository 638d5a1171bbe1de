"""Image classification with a torchvision architecture and its ImageNet weights enum.

Weights are looked for, in order: a local file in `weights_dir` named like the enum's download
(e.g. resnet18-f37072fd.pth), torch hub's cache / download through the weights enum, and only
when allowed random initialisation, which every result then reports as weights="random".
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torchvision.transforms import v2

from mmpipe.models.base import (
    BadInput,
    DecodeHints,
    LoadedModel,
    ModelConfig,
    ModelSpec,
    TensorSpec,
    WeightsUnavailable,
)
from mmpipe.models.torch_util import frozen_graph, inference_context, resolve_device

log = logging.getLogger(__name__)

TOP_K = 5


class ImageClassifierSpec(ModelSpec):
    def __init__(self, arch: str, weights_enum: Any, version: str, resize: int = 256, crop: int = 224):
        self.arch = arch
        self.weights_enum = weights_enum
        self.categories: list[str] = list(weights_enum.meta["categories"])
        self.config = ModelConfig(
            name=arch,
            version=version,
            kind="image",
            description=f"torchvision {arch}, {weights_enum} ({len(self.categories)} classes)",
            # uint8 crops travel (half the bytes of float16); the model normalises on its device.
            inputs=(TensorSpec("pixels", "uint8", (3, crop, crop)),),
            output=f"top-{TOP_K} labels with probabilities",
            decode=DecodeHints(image_short_side=resize, image_center_crop=crop),
            max_batch_size=256,
            reentrant_predict=True,  # a forward pass under no_grad: no state between calls
        )
        self.mean, self.std = _normalisation(weights_enum)
        self._transform = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop)])
        self.crop = crop

    def preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, np.ndarray]:
        rgb = tensors.get("rgb")
        if rgb is None or rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
            shape = None if rgb is None else rgb.shape
            raise BadInput(f"{self.arch} wants an HxWx3 uint8 image, got {shape}")
        if min(rgb.shape[:2]) < 8:
            raise BadInput(f"image {rgb.shape[1]}x{rgb.shape[0]} is too small to classify")
        if not self.needs_preprocess(tensors, meta):
            # Decode already resized and cut it: only HWC -> CHW (numpy's copy: half torch's).
            return {"pixels": np.ascontiguousarray(rgb.transpose(2, 0, 1))}
        return {"pixels": self._transform(torch.from_numpy(rgb).permute(2, 0, 1)).contiguous().numpy()}

    def needs_preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> bool:
        rgb = tensors.get("rgb")
        cut = rgb is not None and rgb.ndim == 3 and rgb.shape[:2] == (self.crop, self.crop)
        return not (cut and meta.get("center_crop") == self.crop)

    def example_input(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        return self.preprocess({"rgb": rng.integers(0, 255, (256, 341, 3), dtype=np.uint8)}, {})

    def load(self, device: str, weights_dir: str, allow_random: bool) -> LoadedModel:
        device = resolve_device(device)
        model = getattr(torchvision.models, self.arch)(weights=None)
        state, weights = self._load_state(Path(weights_dir), allow_random)
        if state is not None:
            model.load_state_dict(state)
        return ImageClassifier(self, model, device, weights)

    @property
    def weights_file(self) -> str:
        return Path(self.weights_enum.url).name

    def weights_on_disk(self, weights_dir: Path) -> Path | None:
        """The weights load() finds without a download: the local file, else torch's hub cache."""
        for path in (weights_dir / self.weights_file, Path(torch.hub.get_dir()) / "checkpoints" / self.weights_file):
            if path.is_file():
                return path
        return None

    def _load_state(self, weights_dir: Path, allow_random: bool) -> tuple[dict | None, str]:
        local = weights_dir / self.weights_file
        if local.is_file():
            _check_file_hash(local)
            return torch.load(local, map_location="cpu", weights_only=True), f"local:{local}"
        try:
            # check_hash: the download must match the SHA-256 prefix in its published file name.
            return self.weights_enum.get_state_dict(progress=False, check_hash=True), "pretrained"
        except Exception as exc:  # offline, hub cache empty, corrupt download...
            if not allow_random:
                raise WeightsUnavailable(
                    f"no weights for {self.arch}: put {local.name} in {weights_dir} or allow "
                    f"random weights (MMPIPE_ALLOW_RANDOM_WEIGHTS=1); download failed: {exc}"
                ) from exc
            log.warning("%s: pretrained weights unavailable (%s); using RANDOM weights", self.arch, exc)
            return None, "random"


class ImageClassifier(LoadedModel):
    def __init__(self, spec: ImageClassifierSpec, model: torch.nn.Module, device: str, weights: str):
        super().__init__(spec, device, weights)
        self.categories = spec.categories
        self.model = model.eval().to(device, memory_format=torch.channels_last)
        # (x / 255 - mean) / std as one multiply-subtract on the device.
        std = torch.tensor(spec.std).view(1, 3, 1, 1)
        self._scale = (1.0 / (255.0 * std)).to(device)
        self._shift = (torch.tensor(spec.mean).view(1, 3, 1, 1) / std).to(device)

    def normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 NCHW crops -> the float input the weights were trained on, on the model's device."""
        return pixels.to(self.device, non_blocking=True).float().mul_(self._scale).sub_(self._shift)

    def freeze_graph(self) -> bool:
        # On the CPU only: a graph traced under the GPU's fp16 autocast is not tried yet.
        if self.device != "cpu":
            return False
        pixels = self.spec.example_input()["pixels"]
        example = np.stack([pixels, pixels[:, ::-1], 255 - pixels])
        graph = frozen_graph(self.model, self._input(example[:2]), self._input(example))
        if graph is None:
            return False
        self.model = graph
        return True

    def _input(self, pixels: np.ndarray) -> torch.Tensor:
        return self.normalise(torch.from_numpy(pixels)).contiguous(memory_format=torch.channels_last)

    def predict(self, batch: list[dict[str, np.ndarray]]) -> list[Any]:
        pixels = np.stack([item["pixels"] for item in batch])
        with inference_context(self.device):
            logits = self.model(self._input(pixels))
            probs = torch.softmax(logits.float(), dim=1)
            top = torch.topk(probs, TOP_K, dim=1)
        values, indices = top.values.cpu().numpy(), top.indices.cpu().numpy()
        return [
            {
                "labels": [
                    {"label": self.categories[int(i)], "index": int(i), "p": round(float(p), 5)}
                    for p, i in zip(row_p, row_i)
                ]
            }
            for row_p, row_i in zip(values, indices)
        ]

    def warmup(self) -> None:
        self.predict([self.spec.example_input()])


def _check_file_hash(path: Path) -> None:
    """A local weights file named like torch hub's (name-<sha256 prefix>.pth) must match it."""
    import hashlib

    from torch.hub import HASH_REGEX

    match = HASH_REGEX.search(path.name)
    if match is None:
        return
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if not digest.startswith(match.group(1)):
        raise WeightsUnavailable(f"{path} does not match the hash in its name ({match.group(1)}...): refusing it")


def _normalisation(weights_enum: Any) -> tuple[list[float], list[float]]:
    transforms = weights_enum.transforms()
    return list(transforms.mean), list(transforms.std)


def resnet18_spec() -> ImageClassifierSpec:
    return ImageClassifierSpec(
        "resnet18", torchvision.models.ResNet18_Weights.IMAGENET1K_V1, version="imagenet1k-v1"
    )
