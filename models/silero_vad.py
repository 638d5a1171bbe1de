"""Speech activity detection with Silero VAD (weights ship inside the `silero-vad` package).

Batching: clips of one length bucket are padded to the bucket length and run as one batch
through the model's `audio_forward` (one RNN state per row); each row's frame probabilities are
then cut back to its real length and turned into segments with silero's own post-processing.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torchaudio

from mmpipe.models.base import (
    BadInput,
    DecodeHints,
    LoadedModel,
    ModelConfig,
    ModelSpec,
    TensorSpec,
    bucket_length,
)
from mmpipe.models.torch_util import resolve_device

SAMPLE_RATE = 16_000
WINDOW_SAMPLES = 512  # silero's frame at 16 kHz
WINDOW_S = 30.0  # long audio is cut into parts of this length by decode
# Bucket lengths in samples: a 30 s window is the common case, short clips share small buckets.
BUCKETS = tuple(int(s * SAMPLE_RATE) for s in (1, 2, 4, 8, 15, WINDOW_S))


def window_pcm(tensors: dict[str, np.ndarray], meta: dict[str, Any], model: str) -> np.ndarray:
    """A decoded audio window as mono float32 PCM at 16 kHz in [-1, 1], at most 30 s long."""
    pcm = tensors.get("pcm")
    if pcm is None or pcm.ndim != 1 or pcm.dtype != np.float32:
        raise BadInput(f"{model} wants mono float32 PCM, got {None if pcm is None else (pcm.dtype, pcm.shape)}")
    rate = int(meta.get("sample_rate", SAMPLE_RATE))
    if rate != SAMPLE_RATE:
        pcm = torchaudio.functional.resample(torch.from_numpy(pcm), rate, SAMPLE_RATE).numpy()
    if pcm.size > BUCKETS[-1]:
        raise BadInput(f"audio part of {pcm.size / SAMPLE_RATE:.1f} s exceeds the {WINDOW_S:.0f} s window")
    return np.clip(pcm, -1.0, 1.0).astype(np.float32, copy=False)


def _package_version() -> str:
    from importlib.metadata import version

    return version("silero-vad")


class SileroVadSpec(ModelSpec):
    def __init__(self) -> None:
        self.config = ModelConfig(
            name="silero-vad",
            version="v6",
            kind="audio",
            description=f"Silero VAD (package silero-vad {_package_version()}), 16 kHz mono",
            inputs=(TensorSpec("pcm", "float32", (-1,)),),
            output="speech segments [{start_s, end_s}] in seconds from the clip start",
            decode=DecodeHints(audio_sample_rate=SAMPLE_RATE, audio_window_s=WINDOW_S),
            max_batch_size=64,
            length_buckets=BUCKETS,
        )

    def preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, np.ndarray]:
        pcm = window_pcm(tensors, meta, self.config.name)
        if pcm.size < WINDOW_SAMPLES:
            raise BadInput(f"audio of {pcm.size} samples is shorter than one {WINDOW_SAMPLES}-sample frame")
        return {"pcm": pcm}

    def bucket_key(self, tensors: dict[str, np.ndarray]) -> int:
        return bucket_length(int(tensors["pcm"].shape[0]), BUCKETS)

    def example_input(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        pcm = (rng.standard_normal(SAMPLE_RATE * 2) * 0.01).astype(np.float32)
        return self.preprocess({"pcm": pcm}, {"sample_rate": SAMPLE_RATE})

    def load(self, device: str, weights_dir: str, allow_random: bool) -> LoadedModel:
        threads = torch.get_num_threads()
        from silero_vad import load_silero_vad

        model = load_silero_vad()
        torch.set_num_threads(threads)  # importing silero_vad sets 1 thread for the whole process
        return SileroVad(self, model, resolve_device(device))


class SileroVad(LoadedModel):
    def __init__(self, spec: SileroVadSpec, model: Any, device: str):
        # The JIT model is small and stateful; it runs on the CPU even when a GPU is present.
        super().__init__(spec, "cpu", "pretrained")
        self.model = model
        self._lock = threading.Lock()  # audio_forward keeps RNN state on the module

    def predict(self, batch: list[dict[str, np.ndarray]]) -> list[Any]:
        from silero_vad.utils_vad import get_speech_timestamps_from_probs

        lengths = [int(item["pcm"].shape[0]) for item in batch]
        padded_len = bucket_length(max(lengths), BUCKETS)
        audio = np.zeros((len(batch), padded_len), dtype=np.float32)
        for row, item in enumerate(batch):
            audio[row, : lengths[row]] = item["pcm"]
        with self._lock, torch.inference_mode():
            probs = self.model.audio_forward(torch.from_numpy(audio), SAMPLE_RATE).numpy()
        outputs = []
        for row, length in enumerate(lengths):
            frames = -(-length // WINDOW_SAMPLES)
            segments = get_speech_timestamps_from_probs(
                probs[row, :frames].tolist(),
                sampling_rate=SAMPLE_RATE,
                return_seconds=True,
                audio_length_samples=length,
            )
            outputs.append(
                {
                    "segments": [{"start_s": s["start"], "end_s": s["end"]} for s in segments],
                    "duration_s": round(length / SAMPLE_RATE, 3),
                    "speech_s": round(sum(s["end"] - s["start"] for s in segments), 3),
                }
            )
        return outputs

    def warmup(self) -> None:
        self.predict([self.spec.example_input()])
