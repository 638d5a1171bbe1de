"""Preprocess stage (CPU): decoded -> ready.

Applies the model's own transform to each decoded part (torchvision resize / crop / normalise
for frames, torchaudio resampling for audio, tokenisation for text) on a worker thread, so the
inference stage receives model-ready tensors and spends its time on the accelerator. A part
that only needs a copy (a frame decode already cut to the model's crop) is copied in place: the
hand-off to a thread and back costs more than the copy.
"""

from __future__ import annotations

import time

import torch

from mmpipe.models.base import BadInput, ModelError
from mmpipe.models.registry import all_specs, get_spec
from mmpipe.schemas import BadMessage, WorkItem, decode_work_item, encode_work_item, failed_part, to_json
from mmpipe.streams.priority import PriorityExecutor, deadline_verdict
from mmpipe.streams.routing import Router
from mmpipe.streams.stage import Incoming, Outgoing, Stage
from mmpipe.streams.topics import READY
from mmpipe.streams.worker_state import WorkerStateFeed


class PreprocessStage(Stage):
    name = "preprocess"
    warms_every_model = True  # off where only copy-only parts come (decode's bypass: stages/fused.py)

    def setup(self) -> None:
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        self._pool = PriorityExecutor(self.settings.inference_workers, "preprocess", self.settings.scheduling.aging_s,
                                      time.monotonic)
        if self.warms_every_model:
            for spec in all_specs().values():
                spec.example_input()  # first-call costs (lazy imports, tokenizer load) paid here
        # Placement onto `ready`: routed by expected wait, or (off) the job ID's hash partition.
        self.router = Router(self.settings.scheduling, time.time) if self.settings.scheduling.routing else None
        self._feed = WorkerStateFeed(self.settings, self.router.observe_worker, self.router.forget_worker) if self.router else None

    async def start(self) -> None:
        if self._feed is not None:
            self._feed.start()

    def observe_downstream_lag(self, stage: str, lag: dict[int, int]) -> None:
        if self.router is None or stage != "inference":  # `ready`'s lag: what the router places by
            return
        self.router.observe_lag(lag)
        for model in self.router.models:  # the estimate beside what the workers measured
            for partition, wait in self.router.expected_waits(model).items():
                self.metrics.route_expected_wait.labels(model, str(partition)).set(wait)
        for partition, wait in self.router.measured_waits().items():
            self.metrics.route_measured_wait.labels(str(partition)).set(wait)

    async def stop(self) -> None:
        if self._feed is not None:
            await self._feed.stop()
        self._pool.shutdown()

    async def handle(self, message: Incoming) -> list[Outgoing]:
        return await self.prepare(decode_work_item(message.value), message.received_at, message.key)

    async def prepare(self, item: WorkItem, started: float, key: bytes | None) -> list[Outgoing]:
        """One decoded part, taken at `started`, made model-ready and placed onto `ready`."""
        item.trace["preprocess_in"] = started
        if deadline_verdict(time.time(), item.deadline, item.on_timeout) == "expire":
            return [self.answer_without_work(
                "expired",
                job_id=item.job_id, part=item.part, parts=item.parts, kind=item.kind,
                modality=item.modality, model=item.model, created_at=item.created_at,
                trace=item.trace, detail="deadline passed before preprocess", digest=item.meta.get("payload_digest"),
                priority=item.priority,
            )]
        if item.part == 0:
            self.report_status(item.job_id, "preprocessing", started)
        try:
            if needs_preprocess(item):
                ready = await self._pool.run(item.priority, self._preprocess, item)
            else:  # a copy (decode already cut the frame): cheaper here than a hand-off to a thread
                ready = self._preprocess(item)
        except BadMessage as exc:
            if item.parts == 1:
                raise
            # One bad part (a frame) of a multi-part job: answer it as failed, keep the others.
            return [Outgoing(self.topics.predictions, key or item.job_id.encode(), to_json(failed_part(item, exc)))]
        ready.trace["preprocess_out"] = time.time()
        self.metrics.observe_service("preprocess", ready.trace["preprocess_out"] - started)
        return [Outgoing(self.topics.lane(READY, ready.priority), key or item.job_id.encode(), encode_work_item(ready),
                         self._place(item.model.name))]

    def _place(self, model: str) -> int | None:
        """The ready partition for one item of `model` (None: its key's hash partition)."""
        if self.router is None:
            return None
        flips = self.router.flips
        partition = self.router.choose(model)
        if partition is not None:
            self.metrics.route_decisions.labels(str(partition)).inc()
        self.metrics.route_flips.inc(self.router.flips - flips)
        return partition

    def _preprocess(self, item: WorkItem) -> WorkItem:
        try:
            spec = get_spec(item.model)
            item.tensors = spec.preprocess(item.tensors, item.meta)
        except BadInput as exc:
            raise BadMessage("bad_input", str(exc)) from None
        except ModelError as exc:
            raise BadMessage("unknown_model", str(exc)) from None
        item.meta.pop("text", None)  # tokenised now; the text itself need not travel further
        return item


def needs_preprocess(item: WorkItem) -> bool:
    """Whether the part needs the model's transform, not merely a copy (an unknown model: the
    transform answers for it)."""
    try:
        return get_spec(item.model).needs_preprocess(item.tensors, item.meta)
    except ModelError:
        return True
