"""The `speech` scenario: decoder scheduling policies for Whisper tiny.en (real packaged weights).

The same espeak-ng clips of mixed length (1-25 s, so the references are known) arrive on the
same seeded Poisson schedule under three policies of streams/continuous.py, run in real time
against the torch model, in the bench process (no pipeline: the scheduler and the model alone):

* off         one sequence at a time;
* request     a batch forms only when the running set is empty and runs until its longest
              sequence ends (finished rows are stepped as padding, the batch answered together);
* continuous  sequences join at every decoder step and leave as they finish.

Reported per policy: decoder tokens/s (generated tokens per second of decoder steps; the
encoder's cost per 30 s window is the same under every policy and is reported apart),
end-to-end audio seconds per second, p50/p99 latency and time to first token from each clip's
scheduled arrival, the peak KV reservation against the budget, and the corpus word error rate
against the spoken text. Peer: the same file and features through ctranslate2 (what
faster-whisper runs), one clip at a time on the same cores (or the same GPU).

Heavy imports (torch, the model, jiwer, ctranslate2) happen only when the scenario runs.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from mmpipe.harness.bench.config import SPEECH_MIXES, BenchConfig
from mmpipe.harness.bench.resources import ResourceSampler

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
MODES = ("off", "request", "continuous")


def threads(cfg: BenchConfig) -> int:
    """Torch threads of the speech runs: --torch-threads, else every core up to 8 (no pipeline
    runs beside them; the recorded run used 2 on the 2-core machine)."""
    return cfg.torch_threads or max(1, min(8, os.cpu_count() or 2))


def sentences_per_clip(mix: str, rng: np.random.Generator) -> int:
    """How many sentences a clip speaks. "uniform": 1 to 7 alike (clips of about 2-22 s, so a
    request-level batch pads only a quarter to a third of its row-steps); "short-heavy": four
    clips in five are one sentence (1-3 s), the fifth is as long as fits (dictation among voice
    commands), so the longest row of a batch is several times its mean."""
    if mix == "uniform":
        return int(rng.integers(1, 8))
    if mix == "short-heavy":
        return 1 if rng.random() < 0.8 else len(SENTENCES)
    raise ValueError(f"unknown speech mix {mix!r}; choose from {', '.join(SPEECH_MIXES)}")


def make_clips(count: int, rng: np.random.Generator, max_clip_s: float, mix: str = "uniform") -> list[tuple[str, np.ndarray]]:
    """Mixed lengths: one sentence (1-3 s) up to several (at most max_clip_s)."""
    from mmpipe.models.whisper import SAMPLE_RATE
    from mmpipe.stages.decode.samples import speech_pcm

    clips = []
    for _ in range(count):
        chosen = list(rng.choice(SENTENCES, size=sentences_per_clip(mix, rng), replace=False))
        while True:
            pcm = speech_pcm(" ".join(chosen), lead_s=0.3, tail_s=0.3)
            if pcm.size <= max_clip_s * SAMPLE_RATE or len(chosen) == 1:
                break
            chosen.pop()
        clips.append((" ".join(chosen), pcm))
    return clips


def _seconds_since(started: float, tensor: Any) -> float:
    """Wall time since `started`, once the work queued on `tensor`'s GPU is done (CUDA runs
    asynchronously, so the clock alone would time the launch)."""
    if tensor.is_cuda:
        import torch

        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - started


def _timed_encoder(inner: Any) -> Any:
    """Wraps the encoder to bill its time apart from the decoder steps' (synchronised on a GPU)."""
    import torch

    class TimedEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.seconds = 0.0

        def forward(self, mel: torch.Tensor) -> torch.Tensor:
            started = time.perf_counter()
            out = self.inner(mel)
            self.seconds += _seconds_since(started, out)
            return out

    return TimedEncoder()


class TimedFill:
    """Wraps the decoder's fill_cross: a joining sequence's cross-attention keys and values over
    the 1,500 encoder frames, computed inside the step it joins. Every policy fills each
    sequence once; timed apart so that a step's cost per row is the step's own (a step that
    carries a join is otherwise the costliest of its row count)."""

    def __init__(self, inner: Callable[..., None]) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, cache: Any, rows: list[int], memory: Any) -> None:
        started = time.perf_counter()
        self.inner(cache, rows, memory)
        self.seconds += _seconds_since(started, memory)


def run_policy(model: Any, encoder: Any, fill: TimedFill, ready: list[dict], audio_s: float, arrivals: np.ndarray,
               mode: str, rows: int) -> dict[str, Any]:
    """One policy over the seeded arrivals, in real time; texts and tokens come back per clip.
    The machine's CPU is sampled over the run, so load from other users shows beside it."""
    sampler = ResourceSampler()
    sampler.watch("bench", os.getpid())
    sampler.begin()
    result = _run_policy(model, encoder, fill, ready, audio_s, arrivals, mode, rows)
    window = sampler.end()
    result["resources"] = {k: window[k] for k in ("cpu_cores", "machine_busy_cores", "other_busy_cores", "machine_cores")}
    return result


def _run_policy(model: Any, encoder: Any, fill: TimedFill, ready: list[dict], audio_s: float, arrivals: np.ndarray,
                mode: str, rows: int) -> dict[str, Any]:
    from mmpipe.streams.continuous import ContinuousPolicy, Sequence

    budget = rows * model.bytes_per_sequence
    model.reserve_cache(budget)
    policy = ContinuousPolicy(budget, rows, max_queue=len(ready), max_join=rows, eot=model.eot,
                              max_new_tokens=model.max_new_tokens, mode=mode)
    pending = deque(sorted(zip(arrivals.tolist(), range(len(ready)))))
    sequences: dict[int, Sequence] = {}
    encoder.seconds, fill.seconds, decoder_s, tokens, peak_reserved, live_rows = 0.0, 0.0, 0.0, 0, 0, 0
    step_cost: dict[int, list[float]] = {}  # rows -> seconds of each step with that many, joins' fills apart
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
        live_rows += sum(1 for s in policy.active if s.reason is None)  # the rest are request-level padding
        encoder_before, fill_before, started = encoder.seconds, fill.seconds, time.perf_counter()
        next_tokens = model.run_iteration(iteration)
        step_s = time.perf_counter() - started - (encoder.seconds - encoder_before)
        decoder_s += step_s
        step_cost.setdefault(len(iteration.tokens), []).append(step_s - (fill.seconds - fill_before))
        policy.advance(next_tokens, time.perf_counter() - t0)
    makespan = time.perf_counter() - t0
    steps = sum(len(v) for v in step_cost.values())
    row_steps = sum(rows * len(v) for rows, v in step_cost.items())
    done = [sequences[i] for i in range(len(ready))]
    latency = np.array([s.finished_at - s.arrived for s in done])
    ttft = np.array([s.first_token_at - s.arrived for s in done])
    return {
        "policy": mode, "rows": rows, "tokens": tokens,
        "decoder_s": round(decoder_s, 3), "fill_s": round(fill.seconds, 3), "encoder_s": round(encoder.seconds, 3),
        "makespan_s": round(makespan, 3),
        "decoder_tokens_per_s": round(tokens / decoder_s, 1),
        "audio_s_per_s": round(audio_s / makespan, 2),
        "audio_s_per_busy_s": round(audio_s / (decoder_s + encoder.seconds), 2),
        "mean_step_rows": round(row_steps / max(steps, 1), 2),
        "steps": steps, "row_steps": row_steps, "live_row_steps": live_rows,
        "step_ms_by_rows": {str(rows): {"steps": len(v), "mean_ms": round(1000 * float(np.mean(v)), 2)}
                            for rows, v in sorted(step_cost.items())},
        "latency_p50_s": round(float(np.percentile(latency, 50)), 3), "latency_p99_s": round(float(np.percentile(latency, 99)), 3),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3), "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
        "kv_peak_bytes": peak_reserved, "kv_budget_bytes": budget,
        "truncated": sum(s.reason == "length" for s in done),
        "texts": [model.output(s.payload, s.generated, s.reason or "length")["text"] for s in done],
        "sequences": [s.generated for s in done],
    }


def scheduling_ceiling(runs: dict[str, dict[str, Any]], min_steps: int = 3) -> dict[str, Any]:
    """How far any decoder scheduler could get beyond this request-level run, from two facts of
    the run: the request-level batches' padding (row-steps that were not live sequences, set by
    how the spoken lengths differ within a batch) and the cheapest measured cost of a row in a
    step (the step cost per row falls with rows and is lowest near a full step), joins' fills
    apart. The ideal scheduler steps only live rows, all at that cheapest cost, and fills each
    sequence's cross-attention once (the least any policy's fills took); its decoder tokens/s
    over request-level is the ceiling of continuous / request-level on these clips and slots."""
    request = runs["request"]
    pooled: dict[int, list[float]] = {}  # rows -> [steps, total ms] over every policy's steps
    for run in runs.values():
        for rows, cost in run["step_ms_by_rows"].items():
            total = pooled.setdefault(int(rows), [0, 0.0])
            total[0] += cost["steps"]
            total[1] += cost["steps"] * cost["mean_ms"]
    steps = {r: t for r, t in pooled.items() if t[0] >= min_steps} or pooled
    rows = min(steps, key=lambda r: steps[r][1] / steps[r][0] / r)
    row_ms = steps[rows][1] / steps[rows][0] / rows
    fill_s = min(run["fill_s"] for run in runs.values())
    ideal_s = request["live_row_steps"] * row_ms / 1000 + fill_s
    return {
        "padding_share": round(1 - request["live_row_steps"] / max(request["row_steps"], 1), 3),
        "cheapest_row_ms": round(row_ms, 3), "at_rows": rows, "fill_s": round(fill_s, 3),
        "ceiling": round(request["decoder_s"] / ideal_s, 2),
    }


def run_peer(ready: list[dict], audio_s: float, threads: int, prompt: list[int], device: str) -> dict[str, Any]:
    """The same features through ctranslate2, greedy, one clip at a time; an error is reported,
    not raised (the peer is beside the measurement, not part of it)."""
    try:
        import ctranslate2

        from mmpipe.models.whisper import model_dir

        if device.startswith("cuda"):
            options = dict(device="cuda", device_index=int(device.partition(":")[2] or 0), compute_type="float16")
        else:
            options = dict(device="cpu", compute_type="float32", intra_threads=threads)
        peer = ctranslate2.models.Whisper(str(model_dir()), **options)
        started = time.perf_counter()
        results = [peer.generate(ctranslate2.StorageView.from_array(item["mel"][None]), [prompt], beam_size=1)[0]
                   for item in ready]
        elapsed = time.perf_counter() - started
    except Exception as exc:  # noqa: BLE001 - missing package, no CUDA build, ...
        return {"peer": "ctranslate2", "error": f"{type(exc).__name__}: {exc}", "tokens": []}
    return {"peer": f"ctranslate2 {ctranslate2.__version__} {options['compute_type']} on {options['device']}, one clip at a time",
            "seconds": round(elapsed, 3), "audio_s_per_s": round(audio_s / elapsed, 2),
            "tokens": [r.sequences_ids[0] for r in results]}


def one_at_a_time_capacity(model: Any, encoder: Any, fill: TimedFill, ready: list[dict], audio_s: float, rows: int) -> float:
    """Clips per second the "off" policy serves with every clip queued at once: this machine's
    capacity one sequence at a time, which the default offered rate is a multiple of. (A fixed
    rate, 2/s, overloaded one 2-core machine 2.6 times and left a faster one nearly idle, where
    every policy steps one row at a time and the policies cannot differ.)"""
    burst = run_policy(model, encoder, fill, ready, audio_s, np.zeros(len(ready)), "off", rows)
    return len(ready) / burst["makespan_s"]


def run(cfg: BenchConfig, device: str, say: Callable[[str], None]) -> dict[str, Any]:
    """The whole scenario: clips, model, the three policies on the same arrivals, the peer."""
    import jiwer
    import torch

    from mmpipe.models.whisper import SAMPLE_RATE, WhisperSpec

    normalize = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(), jiwer.RemoveMultipleSpaces(), jiwer.Strip()])
    rng = np.random.default_rng(cfg.speech_seed)
    spec = WhisperSpec()
    clips = make_clips(cfg.speech_clips, rng, cfg.speech_max_clip_s, cfg.speech_mix)
    ready = [spec.preprocess({"pcm": pcm}, {"sample_rate": SAMPLE_RATE}) for _, pcm in clips]
    model = spec.load(device, "", False)
    n_threads = threads(cfg)
    torch.set_num_threads(n_threads)  # after the VAD load, which sets one thread process-wide
    encoder = _timed_encoder(model.net.encoder)
    model.net.encoder = encoder
    fill = TimedFill(model.net.decoder.fill_cross)
    model.net.decoder.fill_cross = fill
    model.warmup()
    audio_s = sum(pcm.size for _, pcm in clips) / SAMPLE_RATE
    capacity, rate = None, cfg.speech_rate
    if rate is None:
        capacity = one_at_a_time_capacity(model, encoder, fill, ready, audio_s, cfg.speech_rows)
        rate = round(cfg.speech_load * capacity, 3)
        say(f"speech: one at a time this machine serves {capacity:.2f} clips/s; offering {cfg.speech_load:g}x: {rate:g}/s")
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(clips)))
    references = [normalize(text) for text, _ in clips]
    say(f"speech: {len(clips)} clips, {audio_s:.1f} s of audio, Poisson {rate:g}/s (seed {cfg.speech_seed}), "
        f"{cfg.speech_rows} KV slots, {n_threads} torch threads on {device}")

    runs, generated = [], {}
    for mode in MODES:
        result = run_policy(model, encoder, fill, ready, audio_s, arrivals, mode, cfg.speech_rows)
        result["wer"] = round(jiwer.wer(references, [normalize(t) for t in result.pop("texts")]), 3)
        generated[mode] = result.pop("sequences")
        runs.append(result)
        say(f"speech {mode}: {result['decoder_tokens_per_s']} decoder tokens/s, {result['audio_s_per_s']} audio s/s, "
            f"p50/p99 {result['latency_p50_s']}/{result['latency_p99_s']} s, WER {result['wer']}")
    peer = run_peer(ready, audio_s, n_threads, model.prompt(None), device)
    by = {r["policy"]: r for r in runs}
    return {
        "weights": f"{model.weights} ({spec.config.description}; run in {str(model.dtype).removeprefix('torch.')})",
        "model": f"{spec.config.name}:{spec.config.version}", "device": device,
        "mix": cfg.speech_mix, "clips": len(clips), "audio_s": round(audio_s, 1),
        "clip_s": [round(pcm.size / SAMPLE_RATE, 1) for _, pcm in clips],
        "rate_per_s": rate, "load": cfg.speech_load if capacity else None,
        "one_at_a_time_clips_per_s": round(capacity, 3) if capacity else None, "seed": cfg.speech_seed, "threads": n_threads,
        "continuous_vs_request_decoder_tokens_per_s": round(
            by["continuous"]["decoder_tokens_per_s"] / by["request"]["decoder_tokens_per_s"], 2),
        "continuous_vs_off_decoder_tokens_per_s": round(
            by["continuous"]["decoder_tokens_per_s"] / by["off"]["decoder_tokens_per_s"], 2),
        "scheduling_ceiling": scheduling_ceiling(by),
        "peer": {k: v for k, v in peer.items() if k != "tokens"},
        "clips_where_peer_tokens_equal_continuous": sum(a == b for a, b in zip(peer["tokens"], generated["continuous"])),
        "clips_where_policies_agree": sum(a == b == c for a, b, c in zip(*generated.values())),
        "runs": runs,
    }
