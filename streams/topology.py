"""The pipeline's topology, declared once: which stage reads what, feeds whom, runs which class.

    decode ──▶ preprocess ──▶ inference ──▶ sink

or, with decode and preprocess fused into one process (Settings.fuse_preprocess, Ray Data's
operator fusion: no `decoded` hop; stages/fused.py):

    decode+preprocess ──▶ inference ──▶ sink

The supervisor, `mmpipe worker` / `up`, lag and capacity, the benchmark and the compose tests
read this table instead of keeping their own lists. Stage classes are named by import path
(``module:Class``) so this runtime layer never imports the stages above it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from mmpipe.schemas.settings import Settings
from mmpipe.streams.topics import DEAD_LETTER, DECODED, EVENTS, PREDICTIONS, READY, STATUS, TopicSpec, with_lanes


@dataclass(frozen=True)
class StageSpec:
    name: str
    entry: str  # "module:Class" of the Stage subclass
    inputs: tuple[TopicSpec, ...]  # the first is the stage's main input (partitions, lag-based admission)
    output: TopicSpec | None  # the topic the next stage reads; None for the last stage
    downstream: str | None  # the stage that consumes `output`
    slot: int  # metrics port slot: stage `slot` replica j serves on base + PORTS_PER_STAGE*slot + j
    service_step: str  # the mm_service_seconds step that times one item of this stage's work
    default_replicas: int = 1

    def load_class(self) -> type[Any]:
        module, _, name = self.entry.partition(":")
        return getattr(importlib.import_module(module), name)


PIPELINE: tuple[StageSpec, ...] = (
    # Work stages also read their input's high-priority lane (streams/topics.py: lane).
    StageSpec("decode", "mmpipe.stages.decode.stage:DecodeStage", with_lanes(EVENTS), DECODED, "preprocess", 0, "decode"),
    StageSpec("preprocess", "mmpipe.stages.preprocess:PreprocessStage", with_lanes(DECODED), READY, "inference", 1,
              "preprocess"),
    StageSpec("inference", "mmpipe.stages.inference:InferenceStage", with_lanes(READY), PREDICTIONS, "sink", 2,
              "execute"),
    # The sink also reads what every stage reports besides results: dead letters and job states.
    StageSpec("sink", "mmpipe.stages.sink.stage:SinkStage", (PREDICTIONS, DEAD_LETTER, STATUS), None, None, 3,
              "sink"),
)

# Fused, the decode stage runs preprocess's transform on what it decoded and feeds inference
# itself; it keeps decode's name (group, metrics slot, replicas) and scales as one stage.
FUSED_PIPELINE: tuple[StageSpec, ...] = (
    StageSpec("decode", "mmpipe.stages.fused:DecodeAndPreprocessStage", with_lanes(EVENTS), READY, "inference", 0,
              "decode"),
    *PIPELINE[2:],
)

STAGE_NAMES: tuple[str, ...] = tuple(spec.name for spec in PIPELINE)  # every stage there is
_BY_NAME = {spec.name: spec for spec in PIPELINE}
_FUSED_BY_NAME = {spec.name: spec for spec in FUSED_PIPELINE}


def pipeline_of(settings: Settings | None) -> tuple[StageSpec, ...]:
    """The stages these settings run (None: the default topology)."""
    return FUSED_PIPELINE if settings is not None and settings.fuse_preprocess else PIPELINE


def stage_names(settings: Settings | None) -> tuple[str, ...]:
    return tuple(spec.name for spec in pipeline_of(settings))


# Given a base port, stage slot i's replica j serves its metrics at base + PORTS_PER_STAGE * i + j.
PORTS_PER_STAGE = 10


class UnknownStage(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")


class NotRunStage(UnknownStage):
    def __init__(self, name: str) -> None:
        ValueError.__init__(self, f"stage {name!r} does not run with decode and preprocess fused (MMPIPE_FUSE_PREPROCESS)")


def stage_spec(name: str, settings: Settings | None = None) -> StageSpec:
    """`name`'s spec in the topology these settings run (None: the default one)."""
    table = _FUSED_BY_NAME if pipeline_of(settings) is FUSED_PIPELINE else _BY_NAME
    if name in table:
        return table[name]
    raise NotRunStage(name) if name in _BY_NAME else UnknownStage(name)


def metrics_port(base: int, stage: str, index: int) -> int:
    return base + PORTS_PER_STAGE * stage_spec(stage).slot + index
