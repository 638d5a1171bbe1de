"""The pipeline's topology, declared once: which stage reads what, feeds whom, runs which class.

    decode ──▶ preprocess ──▶ inference ──▶ sink

By default (Settings.preprocess_bypass) decode places the parts it already made model-ready
(frames cut to the model's crop, for which preprocess would only copy) straight onto `ready`:

    decode ──▶ preprocess ──▶ inference ──▶ sink
       └───────(bypass)────────▶┘

or, with decode and preprocess fused into one process (Settings.fuse_preprocess, Ray Data's
operator fusion: no `decoded` hop for any part; stages/fused.py):

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
    # A second output for parts that need none of `downstream`'s work, and the stage reading it.
    bypass: TopicSpec | None = None
    bypass_downstream: str | None = None

    def outputs(self) -> list[tuple[TopicSpec, str]]:
        """(topic, the stage that reads it) for each topic this stage feeds."""
        pairs = [(self.output, self.downstream), (self.bypass, self.bypass_downstream)]
        return [(topic, stage) for topic, stage in pairs if topic is not None and stage is not None]

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

# With the bypass, decode hands parts that need no transform to preprocess's placement in its
# own process (stages/fused.py) and feeds both `decoded` and `ready`.
BYPASS_PIPELINE: tuple[StageSpec, ...] = (
    StageSpec("decode", "mmpipe.stages.fused:DecodeAndPreprocessStage", with_lanes(EVENTS), DECODED, "preprocess", 0,
              "decode", bypass=READY, bypass_downstream="inference"),
    *PIPELINE[1:],
)

STAGE_NAMES: tuple[str, ...] = tuple(spec.name for spec in PIPELINE)  # every stage there is
_BY_NAME = {spec.name: spec for spec in PIPELINE}


def pipeline_of(settings: Settings | None) -> tuple[StageSpec, ...]:
    """The stages these settings run (None: the default topology, the bypass's)."""
    if settings is None:
        return BYPASS_PIPELINE
    if settings.fuse_preprocess:
        return FUSED_PIPELINE
    return BYPASS_PIPELINE if settings.preprocess_bypass else PIPELINE


def stage_names(settings: Settings | None) -> tuple[str, ...]:
    return tuple(spec.name for spec in pipeline_of(settings))


def places_onto_ready(settings: Settings | None, stage: str) -> bool:
    """Whether `stage` writes `ready` (and so runs the router that places work onto it)."""
    return any(topic == READY for topic, _ in stage_spec(stage, settings).outputs())


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
    for spec in pipeline_of(settings):
        if spec.name == name:
            return spec
    raise NotRunStage(name) if name in _BY_NAME else UnknownStage(name)


def metrics_port(base: int, stage: str, index: int) -> int:
    return base + PORTS_PER_STAGE * stage_spec(stage).slot + index
