"""Decode that runs preprocess's transform in its own process (CPU): events -> ready (and decoded).

Ray Data's operator fusion for this pipeline. Each decoded part that takes this path goes
straight to the model's transform in the same process instead of through the `decoded` topic,
which spares a produce, a fetch and the broker's copy of the part (151 KB for an image) and,
fused, one process's fixed costs. Two topologies run this class (streams/topology.py):

* bypass (Settings.preprocess_bypass, the default): only the parts preprocess would merely
  copy (frames decode already cut to the model's crop: ModelSpec.needs_preprocess) take this
  path; the rest (audio windows, text, uncut frames) go on to the preprocess stage as before,
  which keeps scaling on its own for the work it has.
* fused (Settings.fuse_preprocess): every part takes it, and no preprocess process runs. What
  that gives up: preprocess scales with decode (add decode replicas), and work waiting for the
  transform waits in `events`, whose lag decode reports, instead of in `decoded`.

Each stage's behaviour stays where it is (stages/decode/stage.py validates and decodes,
stages/preprocess.py transforms and places onto `ready`); this class only joins them. Traces
keep both spans: preprocess_in is when decode handed the part on.
"""

from __future__ import annotations

import asyncio
import time

from mmpipe.schemas import WorkItem
from mmpipe.schemas.settings import Settings
from mmpipe.stages.decode.stage import DecodeStage
from mmpipe.stages.preprocess import PreprocessStage, needs_preprocess
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Outgoing


class DecodeAndPreprocessStage(DecodeStage):
    name = "decode"

    def __init__(self, settings: Settings, metrics: StageMetrics) -> None:
        super().__init__(settings, metrics)
        self.preprocess = PreprocessStage(settings, metrics)
        self.fused = settings.fuse_preprocess
        # Bypassed, only frames decode already cut come here, whose transform is a copy: loading
        # every model's tokenizer and audio front end would only add to decode's memory (84 MiB).
        self.preprocess.warms_every_model = self.fused

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

    def observe_downstream_lag(self, stage: str, lag: dict[int, int]) -> None:
        self.preprocess.observe_downstream_lag(stage, lag)

    async def forward(self, items: list[WorkItem], key: bytes) -> list[Outgoing]:
        """The parts of one job that take this path, transformed at once (the preprocess pool
        ranks them by priority); the others onto `decoded`."""
        takes_path = [self.fused or not needs_preprocess(item) for item in items]
        here = [item for item, taken in zip(items, takes_path) if taken]
        there = [item for item, taken in zip(items, takes_path) if not taken]
        handed_on = time.time()
        prepared = await asyncio.gather(*(self.preprocess.prepare(item, handed_on, key) for item in here))
        return [out for outs in prepared for out in outs] + await super().forward(there, key)

