"""Whisper tiny.en in torch from the packaged CTranslate2 file (real weights): the reader, token
equality with ctranslate2 itself decoding the same features greedily, word error rate against
the spoken text, silence, and continuous batching giving the same tokens as one at a time."""

from __future__ import annotations

import ctranslate2
import jiwer
import numpy as np
import pytest
import torch

from mmpipe.models.ct2_format import read_ct2_model
from mmpipe.models.whisper import Whisper, WhisperSpec, model_dir
from mmpipe.stages.decode import samples
from mmpipe.streams.continuous import ContinuousPolicy, run_to_completion

SENTENCES = (
    "Hello. This is a short test of the streaming inference pipeline.",
    "The quick brown fox jumps over the lazy dog.",
    "Please send the report to the meeting room by five o'clock.",
)
NORMALIZE = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(), jiwer.Strip()])


@pytest.fixture(scope="module")
def spec() -> WhisperSpec:
    return WhisperSpec()


@pytest.fixture(scope="module")
def model(spec: WhisperSpec) -> Whisper:
    threads = torch.get_num_threads()
    loaded = spec.load("cpu", "", False)
    torch.set_num_threads(min(threads, 2))  # silero (the VAD) sets one thread process-wide
    return loaded


@pytest.fixture(scope="module")
def clips(spec: WhisperSpec) -> list[dict[str, np.ndarray]]:
    return [spec.preprocess({"pcm": samples.speech_pcm(text, lead_s=0.5, tail_s=0.5)}, {"sample_rate": 16_000})
            for text in SENTENCES]


@pytest.fixture(scope="module")
def one_at_a_time(model: Whisper, clips: list[dict[str, np.ndarray]]) -> list[dict]:
    return [model.predict([clip])[0] for clip in clips]


def test_reader_reads_the_whisper_spec_with_fused_projections():
    model = read_ct2_model(model_dir() / "model.bin")
    assert (model.spec_name, model.revision) == ("WhisperSpec", 3)
    v = model.variables
    assert v["encoder/layer_0/self_attention/linear_0/weight"].shape == (1152, 384)  # fused QKV
    assert v["decoder/layer_0/attention/linear_1/weight"].shape == (768, 384)  # cross-attention K/V
    assert v["decoder/projection/weight"] is v["decoder/embeddings/weight"]  # the alias: tied output
    assert v["decoder/embeddings/weight"].dtype == np.float16


def test_torch_tokens_equal_ctranslate2_greedy(model: Whisper, clips: list[dict[str, np.ndarray]], one_at_a_time: list[dict]):
    oracle = ctranslate2.models.Whisper(str(model_dir()), device="cpu", compute_type="float32", intra_threads=2)
    features = ctranslate2.StorageView.from_array(np.stack([clip["mel"] for clip in clips]))
    prompt = model.prompt(None)
    results = oracle.generate(features, [prompt] * len(clips), beam_size=1, max_length=448)
    for result, ours in zip(results, one_at_a_time):
        assert ours["tokens"] == result.sequences_ids[0]
        assert ours["tokens"] and not ours["truncated"]


def test_word_error_rate_against_the_spoken_text(one_at_a_time: list[dict]):
    rates = [jiwer.wer(NORMALIZE(text), NORMALIZE(out["text"])) for text, out in zip(SENTENCES, one_at_a_time)]
    assert float(np.mean(rates)) <= 0.25, list(zip(rates, [o["text"] for o in one_at_a_time]))


def test_continuous_batching_gives_the_tokens_of_one_at_a_time(model: Whisper, clips: list[dict[str, np.ndarray]],
                                                               one_at_a_time: list[dict]):
    """Two rows, one join per step: the clips share steps at different positions, and the third
    joins when a row frees (the last row moves into the hole)."""
    model.reserve_cache(2 * model.bytes_per_sequence)
    policy = ContinuousPolicy(budget_bytes=2 * model.bytes_per_sequence, max_rows=2, max_queue=3, max_join=1,
                              eot=model.eot, max_new_tokens=model.max_new_tokens)
    together = run_to_completion(model, clips, policy)
    assert [o["tokens"] for o in together] == [o["tokens"] for o in one_at_a_time]


def test_silence_is_an_empty_transcript_and_never_decoded(spec: WhisperSpec, model: Whisper):
    ready = spec.preprocess({"pcm": np.zeros(3 * 16_000, dtype=np.float32)}, {"sample_rate": 16_000})
    assert ready["mel"].shape == (80, 0) and ready["speech"].shape == (0, 2)
    out = model.immediate(ready)
    assert out == {"text": "", "tokens": [], "truncated": False, "segments": [], "duration_s": 3.0, "speech_s": 0.0}


def test_speech_segments_come_from_the_vad(clips: list[dict[str, np.ndarray]]):
    starts = [float(clip["speech"][0, 0]) for clip in clips]
    assert all(0.3 <= s <= 0.8 for s in starts)  # after the half second of leading silence


def test_the_sink_joins_window_transcripts_in_time_order():
    from mmpipe.schemas import ModelRef, Prediction
    from mmpipe.stages.sink.stage import assemble

    ref = ModelRef("whisper-tiny-en", "ct2-f16")

    def window(part: int, text: str, speech: list[tuple[float, float]], truncated: bool = False) -> Prediction:
        output = {"text": text, "tokens": [1, 2] if text else [], "truncated": truncated,
                  "segments": [{"start_s": a, "end_s": b} for a, b in speech], "duration_s": 30.0,
                  "speech_s": sum(b - a for a, b in speech)}
        return Prediction(job_id="j", part=part, parts=3, kind="audio", modality="audio", model=ref, status="ok",
                          created_at=0.0, trace={"sink_in": 1.0}, output=output, meta={"offset_s": 30.0 * part})

    parts = [window(2, "last words", [(0.5, 2.0)], truncated=True), window(0, "first words", [(1.0, 2.0), (3.0, 4.5)]),
             window(1, "", [])]
    result = assemble(parts)
    transcript = result.prediction["transcript"]
    assert transcript["text"] == "first words last words"
    assert [(s["start_s"], s["end_s"], s["truncated"]) for s in transcript["segments"]] == [
        (1.0, 4.5, False), (60.5, 62.0, True)]
    assert result.prediction["segments"] == [{"start_s": 1.0, "end_s": 2.0}, {"start_s": 3.0, "end_s": 4.5},
                                             {"start_s": 60.5, "end_s": 62.0}]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8])
def test_the_padded_output_projection_gives_each_row_its_own_logits(model: Whisper, rows: int):
    """On a CPU the projection runs on rows padded to a multiple of 4 (some row counts hit a slow
    GEMM path); the padding rows are dropped and each real row's logits are its own."""
    decoder = model.net.decoder
    h = torch.randn(rows, decoder.embeddings.weight.shape[1], generator=torch.Generator().manual_seed(rows))
    logits = decoder.project(h)
    assert logits.shape == (rows, decoder.embeddings.weight.shape[0])
    torch.testing.assert_close(logits, h @ decoder.embeddings.weight.T, rtol=1e-4, atol=1e-4)
