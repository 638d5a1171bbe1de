"""Which models exist, and which one serves a modality when an event names none."""

from __future__ import annotations

from functools import lru_cache

from mmpipe.models.base import ModelSpec, UnknownModel, WrongModality
from mmpipe.schemas import ModelRef

# modality -> (name, version) used when an event names no model; a video's frames use the
# image default (or the event's model) and its audio track the audio default.
DEFAULTS = {
    "image": ModelRef("resnet18", "imagenet1k-v1"),
    "audio": ModelRef("whisper-tiny-en", "ct2-f16"),  # transcript plus the VAD's speech segments
    "text": ModelRef("all-minilm-l6-v2", "1"),
}
KIND_OF_MODALITY = {"image": "image", "audio": "audio", "text": "text", "video": "image"}


@lru_cache(maxsize=1)
def all_specs() -> dict[ModelRef, ModelSpec]:
    from mmpipe.models.image_classifier import resnet18_spec
    from mmpipe.models.silero_vad import SileroVadSpec
    from mmpipe.models.text_embedding import TextEmbeddingSpec
    from mmpipe.models.whisper import WhisperSpec

    specs = [resnet18_spec(), SileroVadSpec(), TextEmbeddingSpec(), WhisperSpec()]
    return {spec.ref: spec for spec in specs}


def get_spec(ref: ModelRef) -> ModelSpec:
    specs = all_specs()
    if ref not in specs:
        raise UnknownModel(str(ref), [str(r) for r in specs])
    return specs[ref]


def resolve(ref: ModelRef | None, modality: str) -> ModelSpec:
    """The model that serves this modality (video: the frame model), checked for fit."""
    kind = KIND_OF_MODALITY[modality]
    spec = get_spec(ref or DEFAULTS[kind])
    if spec.config.kind != kind:
        raise WrongModality(
            f"model {spec.ref} takes {spec.config.kind} input; a {modality} job needs a {kind} model"
        )
    return spec


def specs_by_name(names: list[str]) -> list[ModelSpec]:
    chosen = [spec for spec in all_specs().values() if spec.config.name in names]
    missing = set(names) - {spec.config.name for spec in chosen}
    if missing:
        raise UnknownModel(", ".join(sorted(missing)), [str(r) for r in all_specs()])
    return chosen
