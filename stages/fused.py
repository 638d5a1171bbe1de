"""Decode and preprocess in one process (CPU): events -> ready, with Settings.fuse_preprocess.

Ray Data's operator fusion for this pipeline: on a host that runs both stages anyway, each
decoded part goes straight to the model's transform in the same process instead of through the
`decoded` topic, which spares a produce, a fetch and the broker's copy of every frame (151 KB
for an image), and one process's fixed costs. Each stage's behaviour stays where it is
(stages/decode/stage.py validates and decodes, stages/preprocess.py transforms and places onto
`ready`); this class only joins them. What fusing gives up: preprocess scales with decode (add
decode replicas), and work waiting for the transform waits in `events`, whose lag decode reports,
instead of in `decoded`. Traces keep both spans: preprocess_in is when decode handed the part on.
"""

from __future__ import annotations

import asyncio
import time

from mmpipe.schemas import WorkItem
from mmpipe.schemas.settings import Settings
from mmpipe.stages.decode.stage import DecodeStage
from mmpipe.stages.preprocess import PreprocessStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Outgoing


class DecodeAndPreprocessStage(DecodeStage):
    name = "decode"

    def __init__(self, settings: Settings, metrics: StageMetrics) -> None:
        super().__init__(settings, metrics)
        self.preprocess = PreprocessStage(settings, metrics)

    def setup(self) -> None:
        super().setup()
        self.preprocess.setup()

    async def start(self) -> None:
        await super().start()
        self.preprocess.status_reporter = self.status_reporter  # the runtime gave decode one
        await self.preprocess.start()

    async def stop(self) -> None:
        await self.preprocess.stop()
        await super().stop()

    def observe_downstream_lag(self, lag: dict[int, int]) -> None:
        self.preprocess.observe_downstream_lag(lag)  # `ready`'s lag: what the router places by

    async def forward(self, items: list[WorkItem], key: bytes) -> list[Outgoing]:
        """The parts of one job, transformed at once (the preprocess pool ranks them by priority)."""
        handed_on = time.time()
        prepared = await asyncio.gather(*(self.preprocess.prepare(item, handed_on, key) for item in items))
        return [out for outs in prepared for out in outs]
