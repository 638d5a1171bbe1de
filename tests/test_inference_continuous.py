"""The inference stage serving Whisper (real weights) with the continuous batcher, in process:
sequences that share the KV budget are answered, one past the bounded queue is answered
`rejected` with the reason, and silence is answered without decoding."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import torch
from prometheus_client import CollectorRegistry

from mmpipe.models.whisper import WhisperSpec
from mmpipe.schemas import WorkItem, encode_work_item
from mmpipe.schemas.settings import ContinuousSettings, Settings
from mmpipe.stages.decode import samples
from mmpipe.stages.inference import InferenceStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Incoming


def message(spec: WhisperSpec, job_id: str, tensors: dict[str, np.ndarray]) -> Incoming:
    now = time.time()
    item = WorkItem(job_id=job_id, part=0, parts=1, kind="audio", modality="audio", model=spec.ref, created_at=now,
                    deadline=now + 120, meta={"offset_s": 0.0}, tensors=tensors)
    return Incoming("ready", 0, 0, job_id.encode(), encode_work_item(item), now, now)


async def test_kv_budget_queue_and_rejection_in_the_inference_stage():
    spec = WhisperSpec()
    speech = spec.preprocess({"pcm": samples.speech_pcm("Hello everyone.", lead_s=0.3, tail_s=0.3)}, {"sample_rate": 16_000})
    silence = spec.preprocess({"pcm": np.zeros(16_000, dtype=np.float32)}, {"sample_rate": 16_000})
    one_sequence = 21_196_800  # fp32 on the CPU: 4 layers x K,V x 384 x (225 + 1500) x 4 bytes
    settings = Settings(models=["whisper-tiny-en"], device="cpu", torch_threads=min(torch.get_num_threads(), 2),
                        continuous=ContinuousSettings(kv_cache_budget_bytes=one_sequence, max_queue=2))
    registry = CollectorRegistry()
    stage = InferenceStage(settings, StageMetrics("inference", registry))
    stage.setup()
    await stage.start()
    try:
        answers = await asyncio.gather(*(stage.handle(message(spec, f"job-{i}", speech)) for i in range(3)),
                                       stage.handle(message(spec, "silent", silence)))
    finally:
        await stage.stop()
    predictions = [orjson.loads(out[0].value) for out in answers]
    statuses = [p["status"] for p in predictions]
    # the three arrive before the first step: two fill the queue, the third is refused; then one
    # runs in the single KV slot while the other waits for it
    assert statuses == ["ok", "ok", "rejected", "ok"]
    assert "kv_queue_full" in predictions[2]["error"]
    assert "hello" in predictions[0]["output"]["text"].lower() and predictions[0]["weights"] == "pretrained"
    assert predictions[0]["output"]["tokens"] == predictions[1]["output"]["tokens"]
    assert predictions[3]["output"]["text"] == "" and predictions[3]["meta"]["batch_trigger"] == "no_decoding"
    assert registry.get_sample_value("mm_kv_budget_bytes", {"model": "whisper-tiny-en"}) == one_sequence
    assert registry.get_sample_value("mm_sequences_finished_total", {"model": "whisper-tiny-en", "reason": "eot"}) == 2
    # a single slot: the two sequences never shared a step, the second waited for the first
    assert [p["meta"]["batch_size"] for p in predictions[:2]] == [1, 1]
    assert registry.get_sample_value("mm_admission_wait_seconds_count", {"model": "whisper-tiny-en"}) == 2
