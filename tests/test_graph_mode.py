"""Graph mode (models/torch_util.py): on the CPU the image classifier runs as a frozen
TorchScript graph, which releases the GIL for its whole forward. It must answer exactly what
the eager model answers, at batch sizes other than the one it was traced at; a module whose
trace would differ, or that cannot be traced, stays eager. resnet18 with RANDOM weights."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from mmpipe.models.image_classifier import resnet18_spec
from mmpipe.models.torch_util import frozen_graph
from mmpipe.schemas.settings import Settings
from mmpipe.stages.inference import InferenceStage
from mmpipe.streams.metrics import StageMetrics


def _images(count: int) -> list[dict[str, np.ndarray]]:
    spec = resnet18_spec()
    rng = np.random.default_rng(7)
    return [spec.preprocess({"rgb": rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)}, {}) for _ in range(count)]


def test_the_frozen_graph_answers_what_the_eager_model_answers():
    model = resnet18_spec().load("cpu", "", allow_random=True)
    images = _images(5)
    batches = [images[:1], images[:3], images]  # traced at 2: none of these sizes
    eager = [model.predict(batch) for batch in batches]
    assert model.freeze_graph()
    assert isinstance(model.model, torch.jit.ScriptModule)
    for batch, expected in zip(batches, eager):
        got = model.predict(batch)
        for want_item, got_item in zip(expected, got, strict=True):
            assert [x["index"] for x in got_item["labels"]] == [x["index"] for x in want_item["labels"]]
            assert np.allclose([x["p"] for x in got_item["labels"]], [x["p"] for x in want_item["labels"]], atol=1e-4)


class _DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else -x  # tracing records one branch only


class _Untraceable(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, str]:
        return {"answer": "not a tensor"}


def test_a_module_whose_trace_differs_or_fails_stays_eager(caplog):
    caplog.set_level(logging.WARNING)
    ones = torch.ones(2, 3)
    with pytest.warns(torch.jit.TracerWarning):
        assert frozen_graph(_DataDependent().eval(), ones, -torch.ones(3, 3)) is None
    assert "differs from its module" in caplog.text
    assert frozen_graph(_Untraceable().eval(), ones, ones) is None
    assert "no frozen graph for _Untraceable" in caplog.text
    with pytest.warns(torch.jit.TracerWarning):  # checked on the traced branch: same answers, kept
        assert frozen_graph(_DataDependent().eval(), ones, torch.ones(3, 3)) is not None


@pytest.mark.parametrize("graph_mode", [True, False])
def test_the_inference_stage_freezes_its_models_only_in_graph_mode(graph_mode):
    settings = Settings(models=["resnet18"], torch_threads=1, allow_random_weights=True, graph_mode=graph_mode)
    stage = InferenceStage(settings, StageMetrics("inference-graph", registry=CollectorRegistry()))
    stage.setup()
    (model,) = stage.models.values()
    assert isinstance(model.model, torch.jit.ScriptModule) is graph_mode
