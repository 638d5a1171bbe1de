"""Inference stage (GPU when present): ready -> predictions.

Loads the configured models once, gives each its own executor thread and batcher, and answers
every item with a Prediction carrying the batch it ran in. One-shot models get a DynamicBatcher
(max batch size, max wait of the oldest item, shape buckets, deadlines); autoregressive ones
(speech to text) a ContinuousBatcher: sequences join and leave the running set at every decoder
step, each holding a KV-cache slot reserved from the configured budget when it is admitted. An item the model fails on alone is dead-lettered
with the model's error; an item whose deadline passed is answered as expired, never run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from mmpipe.models.base import AutoregressiveModel, LoadedModel
from mmpipe.models.registry import specs_by_name
from mmpipe.models.torch_util import gpu_memory_bytes, kv_cache_budget, resolve_device
from mmpipe.schemas import BadMessage, ModelRef, Prediction, decode_work_item, to_json
from mmpipe.streams.batching import DynamicBatcher, Expired, ItemFailed
from mmpipe.streams.continuous import ContinuousBatcher, Rejected
from mmpipe.streams.stage import Incoming, Outgoing, Stage

log = logging.getLogger(__name__)


class InferenceStage(Stage):
    name = "inference"

    def setup(self) -> None:
        device = resolve_device(self.settings.device)
        self.models: dict[ModelRef, LoadedModel] = {}
        for spec in specs_by_name(self.settings.models):
            model = spec.load(device, str(self.settings.weights_dir), self.settings.allow_random_weights)
            self.models[spec.ref] = model
            log.info("loaded %s on %s (weights: %s)", spec.ref, model.device, model.weights)
        # Loading silero-vad sets torch to one thread process-wide; choose the count here.
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        for model in self.models.values():
            model.warmup()
        self.batchers: dict[ModelRef, DynamicBatcher | ContinuousBatcher] = {}

    async def start(self) -> None:
        for ref, model in self.models.items():
            autoregressive = isinstance(model, AutoregressiveModel)
            batcher = self._continuous(ref, model) if autoregressive else self._dynamic(ref, model)
            batcher.start()
            self.batchers[ref] = batcher

    def _dynamic(self, ref: ModelRef, model: LoadedModel) -> DynamicBatcher:
        return DynamicBatcher(
            name=ref.name,
            predict=self._with_injected_delay(model.predict),
            bucket_key=model.spec.bucket_key,
            settings=self.settings.batching_for(ref.name),
            model_limit=model.spec.config.max_batch_size,
            executor=ThreadPoolExecutor(1, thread_name_prefix=f"model-{ref.name}"),
            metrics=self.metrics,
        )

    def _continuous(self, ref: ModelRef, model: AutoregressiveModel) -> ContinuousBatcher:
        settings = self.settings.continuous
        budget = min(kv_cache_budget(settings, model.device), settings.max_sequences * model.bytes_per_sequence)
        rows = model.reserve_cache(budget)
        log.info("%s: KV-cache budget %d bytes, %d sequence slots (%s)", ref, budget, rows, settings.mode)
        return ContinuousBatcher(
            name=ref.name,
            model=model,
            settings=settings,
            budget_bytes=budget,
            max_rows=rows,
            executor=ThreadPoolExecutor(1, thread_name_prefix=f"model-{ref.name}"),
            metrics=self.metrics,
        )

    def _with_injected_delay(self, predict: Callable[[list], list]) -> Callable[[list], list]:
        delay_s = self.settings.inject_execute_delay_ms / 1000.0
        if not delay_s:
            return predict

        def slowed(batch: list) -> list:
            time.sleep(delay_s)  # a degraded replica: same answers, later
            return predict(batch)

        return slowed

    async def stop(self) -> None:
        for batcher in self.batchers.values():
            await batcher.stop()

    async def handle(self, message: Incoming) -> list[Outgoing]:
        item = decode_work_item(message.value)
        item.trace["inference_in"] = message.received_at
        batcher = self.batchers.get(item.model)
        if batcher is None:
            raise BadMessage("model_not_served", f"this inference group serves {', '.join(map(str, self.batchers))}; not {item.model}")
        common = dict(
            job_id=item.job_id, part=item.part, parts=item.parts, kind=item.kind,
            modality=item.modality, model=item.model, created_at=item.created_at,
        )
        try:
            output, info = await batcher.submit(item.tensors, item.deadline)
        except Expired as exc:
            return [self.answer_without_work("expired", **common, trace=item.trace, detail=str(exc))]
        except Rejected as exc:
            return [self.answer_without_work("rejected", **common, trace=item.trace, detail=str(exc))]
        except ItemFailed as exc:
            raise BadMessage("model_error", str(exc)) from None
        item.trace.update(batch_start=info.started_at, batch_end=info.finished_at)
        self.metrics.observe_service("execute", info.finished_at - info.started_at)
        self.metrics.gpu_memory.set(gpu_memory_bytes())
        prediction = Prediction(
            **common,
            status="ok",
            trace=item.trace,
            output=output,
            meta={**item.meta, "batch_size": info.size, "batch_trigger": info.trigger},
            weights=self.models[item.model].weights,
        )
        out = [Outgoing(self.topics.predictions, message.key or item.job_id.encode(), to_json(prediction))]
        if item.part == 0:
            out.append(self.status(item.job_id, "inferring"))
        return out
