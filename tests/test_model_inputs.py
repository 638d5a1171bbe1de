"""Inference checks every work item against its model's declared inputs before the model sees
it: token ids within the vocabulary, shapes within the buckets, dtypes, finite floats. Real
model (all-MiniLM-L6-v2, the weights its package ships) behind the real batcher."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from mmpipe.models.base import BadInput
from mmpipe.models.registry import all_specs
from mmpipe.schemas import ModelRef, Refused, WorkItem, decode_prediction, encode_work_item
from mmpipe.schemas.settings import Settings
from mmpipe.stages.inference import InferenceStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Incoming

TEXT = ModelRef("all-minilm-l6-v2", "1")


@pytest.mark.parametrize("ref", list(all_specs()))
def test_every_models_example_input_passes_and_a_wrong_dtype_does_not(ref):
    spec = all_specs()[ref]
    example = spec.example_input()
    spec.check_input(example)
    name, array = next(iter(example.items()))
    with pytest.raises(BadInput, match="want"):
        spec.check_input({**example, name: array.astype(np.float64)})
    with pytest.raises(BadInput, match="takes tensors"):
        spec.check_input({**example, "extra": array})


def test_non_finite_floats_are_refused():
    # Images travel as uint8 crops (normalised on the model's device), so take a float input:
    # the audio models' PCM.
    spec, name = next((s, n) for s in all_specs().values() for n, a in s.example_input().items()
                      if np.issubdtype(a.dtype, np.floating))
    example = spec.example_input()
    values = example[name].copy()
    values.flat[0] = np.inf
    with pytest.raises(BadInput, match="finite"):
        spec.check_input({**example, name: values})


def _item(ids: np.ndarray, parts: int = 1) -> bytes:
    now = time.time()
    return encode_work_item(WorkItem(job_id="tok-1", part=0, parts=parts, kind="text", modality="text", model=TEXT,
                                     created_at=now, deadline=now + 60, tensors={"input_ids": ids}))


def test_inference_refuses_out_of_vocabulary_and_overlong_token_ids_and_serves_good_ones():
    stage = InferenceStage(Settings(models=["all-minilm-l6-v2"], torch_threads=1),
                           StageMetrics("inference-inputs", registry=CollectorRegistry()))
    stage.setup()

    async def run() -> None:
        await stage.start()
        try:
            for ids, match in ((np.array([101, 30522, 102], np.int32), "outside"),
                               (np.array([101, -1, 102], np.int32), "outside"),
                               (np.full(257, 101, np.int32), "longest bucket")):
                with pytest.raises(Refused, match=match) as refused:
                    await stage.handle(Incoming("t.ready", 0, 1, b"tok-1", _item(ids), time.time(), time.time()))
                assert refused.value.reason == "bad_input"
            out = await stage.handle(Incoming("t.ready", 0, 2, b"tok-1", _item(np.array([101, 7592, 102], np.int32)),
                                              time.time(), time.time()))
            assert decode_prediction(out[0].value).output["dim"] == 384
            # One bad part of a multi-part job is answered as failed, not dead-lettered.
            out = await stage.handle(Incoming("t.ready", 0, 3, b"tok-1", _item(np.array([30522], np.int32), parts=2),
                                              time.time(), time.time()))
            failed = decode_prediction(out[0].value)
            assert failed.status == "error" and failed.error.startswith("bad_input: ")
        finally:
            await stage.stop()

    asyncio.run(run())
