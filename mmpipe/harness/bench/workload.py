"""Representative inputs per modality, made once with PyAV / espeak-ng and cached on disk.

* image: noisy 640x480 JPEGs (a few different pictures), sent inline in the event;
* video: a 4 s 640x360 H.264 clip with a spoken AAC track, sent as a file URI;
* audio: a few seconds of espeak-ng speech between silences (FLAC), sent as a file URI;
* text: short sentences, inline;
* the decode benchmark's clip: 720p H.264 at about 3 Mbit/s, noisy moving content.

`model_input` turns the same media into the model-ready tensors the inference stage receives
(decode + the model's own preprocess), so the model-alone baseline runs on what the pipeline
runs on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmpipe.stages.decode import samples
from mmpipe.client import make_event
from mmpipe.stages.decode.media import DecodeLimits, decode_audio, decode_image
from mmpipe.schemas import MediaEvent
from mmpipe.schemas.events import NORMAL_PRIORITY

IMAGE_SIZE = (640, 480)
IMAGE_VARIANTS = 8
TEXTS = [
    "Streaming inference turns a model into a service that must behave under real traffic.",
    "The batcher stops waiting when the batch is full or the oldest request has waited long enough.",
    "A faster kernel barely changes what users see when requests spend most of their time queued.",
    "Every result is written once per job id, so a redelivered message never doubles it.",
]
DECODE_CLIP = dict(width=1280, height=720, fps=25, bitrate=3_000_000)


@dataclass
class Workload:
    """The media every job of a benchmark run is made from."""

    media_dir: Path
    images: list[bytes] = field(default_factory=list)
    video: Path | None = None
    audio: Path | None = None
    _counter: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def prepare(cls, media_dir: Path, modalities: set[str]) -> Workload:
        media_dir.mkdir(parents=True, exist_ok=True)
        work = cls(media_dir.resolve())
        work.images = [_cached(media_dir / f"image-{i}.jpg", lambda i=i: _image(i)) for i in range(IMAGE_VARIANTS)]
        if "video" in modalities:
            work.video = _cached_path(media_dir / "clip-640x360-4s.mp4", _talking_clip)
        if "audio" in modalities:
            work.audio = _cached_path(media_dir / "speech.flac", lambda: samples.encode_audio(samples.speech_pcm(), fmt="flac"))
        return work

    def event(self, modality: str, run_tag: str, priority: int = NORMAL_PRIORITY) -> MediaEvent:
        """A new job of this modality; created_at is now, so build it at send time."""
        n = next(self._counter)
        job = dict(job_id=f"{run_tag}-{n}", priority=priority)
        if modality == "image":
            return make_event("image", data=self.images[n % len(self.images)], **job)
        if modality == "text":
            return make_event("text", text=TEXTS[n % len(TEXTS)], **job)
        path = {"video": self.video, "audio": self.audio}[modality]
        if path is None:
            raise ValueError(f"workload was prepared without {modality} media")
        return make_event(modality, uri=str(path), **job)


def model_input(spec: object, modality: str, work: Workload) -> dict[str, np.ndarray]:
    """Decode + preprocess one representative input exactly as the decode and preprocess
    stages would, for the model-alone baseline."""
    hints = spec.config.decode  # type: ignore[attr-defined]
    if modality == "image":
        media = decode_image(work.images[0], DecodeLimits(image_short_side=hints.image_short_side))
        return spec.preprocess({"rgb": media.frames[0].rgb}, {})  # type: ignore[attr-defined]
    if modality == "audio":
        assert work.audio is not None
        media = decode_audio(work.audio, DecodeLimits(audio_sample_rate=hints.audio_sample_rate or 16_000))
        return spec.preprocess({"pcm": media.pcm}, {"sample_rate": hints.audio_sample_rate or 16_000})  # type: ignore[attr-defined]
    if modality == "text":
        return spec.preprocess({}, {"text": TEXTS[0]})  # type: ignore[attr-defined]
    raise ValueError(f"no model-alone input for modality {modality!r}")


def decode_clip(cache_dir: Path, seconds: float) -> bytes:
    """The 720p ~3 Mbit/s noisy H.264 clip of the decode benchmark (cached: encoding is slow)."""
    name = f"decode-{DECODE_CLIP['width']}x{DECODE_CLIP['height']}-{DECODE_CLIP['bitrate'] // 1000}k-{seconds:g}s.mp4"
    return _cached(cache_dir / name, lambda: samples.encode_video(seconds=seconds, **DECODE_CLIP))


def _image(seed: int) -> bytes:
    return samples.encode_image(samples.synthetic_picture(*IMAGE_SIZE, seed=seed), "jpeg")


def _talking_clip() -> bytes:
    speech = samples.speech_pcm()
    return samples.encode_video(seconds=4.0, width=640, height=360, audio=speech[: 4 * 16_000])


def _cached(path: Path, make: object) -> bytes:
    return _cached_path(path, make).read_bytes()


def _cached_path(path: Path, make: object) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(make())  # type: ignore[operator]
        tmp.replace(path)
    return path.resolve()
