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

from mmpipe.models.base import AutoregressiveModel, BadInput, LoadedModel
from mmpipe.models.registry import specs_by_name
from mmpipe.models.torch_util import gpu_memory_bytes, kv_cache_budget, resolve_device
from mmpipe.schemas import BadMessage, ModelRef, Prediction, WorkItem, decode_work_item, failed_part, to_json
from mmpipe.schemas.events import WorkerState
from mmpipe.streams.affinity import pin_model_thread
from mmpipe.streams.batching import DynamicBatcher, Expired, ItemFailed
from mmpipe.streams.continuous import ContinuousBatcher, Rejected
from mmpipe.streams.faults import crash_point
from mmpipe.streams.priority import is_late
from mmpipe.streams.stage import Incoming, Outgoing, Stage
from mmpipe.streams.worker_state import ServiceClock, WorkerReporter, snapshot, worker_name

log = logging.getLogger(__name__)


class InferenceStage(Stage):
    name = "inference"

    def setup(self) -> None:
        device = resolve_device(self.settings.device)
        self.models: dict[ModelRef, LoadedModel] = {}
        for spec in specs_by_name(self.settings.models):
            model = spec.load(device, str(self.settings.weights_dir), self.settings.allow_random_weights)
            graph = self.settings.graph_mode and model.freeze_graph()
            self.models[spec.ref] = model
            log.info("loaded %s on %s (weights: %s; %s)", spec.ref, model.device, model.weights,
                     "frozen graph" if graph else "eager")
        # Loading silero-vad sets torch to one thread process-wide; choose the count here.
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        for model in self.models.values():
            model.warmup()
        self.batchers: dict[ModelRef, DynamicBatcher | ContinuousBatcher] = {}
        # What the router on the preprocess side places work by: this worker's own report.
        self.service_clock = ServiceClock()
        self.holding = 0  # items taken and not yet answered: the backlog this worker reports
        self.reporter = WorkerReporter(self.settings, self._worker_state) if self.settings.scheduling.routing else None

    def _worker_state(self) -> WorkerState:
        ready = bool(self.batchers) and bool(self.assigned)
        return snapshot(worker_name(), set(self.assigned), ready, [ref.name for ref in self.models], self.service_clock,
                        self.holding)

    async def start(self) -> None:
        for ref, model in self.models.items():
            autoregressive = isinstance(model, AutoregressiveModel)
            batcher = self._continuous(ref, model) if autoregressive else self._dynamic(ref, model)
            batcher.start()
            self.batchers[ref] = batcher
        if self.reporter is not None:
            self.reporter.start()

    def _dynamic(self, ref: ModelRef, model: LoadedModel) -> DynamicBatcher:
        settings = self.settings.batching_for(ref.name)
        urgent_slot = settings.urgent_slot and settings.expedite_priority is not None and model.spec.config.reentrant_predict
        return DynamicBatcher(
            name=ref.name,
            predict=self._with_injected_faults(model.predict),
            bucket_key=model.spec.bucket_key,
            settings=settings,
            model_limit=model.spec.config.max_batch_size,
            executor=self._model_executor(ref),
            metrics=self.metrics,
            aging_s=self.settings.scheduling.aging_s,
            urgent_executor=self._model_executor(ref, "urgent", settings.urgent_precedence_nice) if urgent_slot else None,
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
            executor=self._model_executor(ref),
            metrics=self.metrics,
        )

    def _model_executor(self, ref: ModelRef, role: str = "", precedence: int = 0) -> ThreadPoolExecutor:
        """One thread per model (and its urgent slot's), on the model's own cores when
        MMPIPE_MODEL_CPUS names them; the slot's thread runs `precedence` nice steps above the
        main one, so that its batch takes the core they share first."""
        name = f"model-{ref.name}" + (f"-{role}" if role else "")
        return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=pin_model_thread,
                                  initargs=(self.settings.model_cpus, precedence))

    def _with_injected_faults(self, predict: Callable[[list], list]) -> Callable[[list], list]:
        """The model call with the configured fault injection: a degraded replica (a delay per
        batch) and the inference.batch crash point."""
        delay_s = self.settings.inject_execute_delay_ms / 1000.0
        if self.settings.fault_points:
            predict = self._with_crash_point(predict)
        if not delay_s:
            return predict

        def slowed(batch: list) -> list:
            time.sleep(delay_s)  # a degraded replica: same answers, later
            return predict(batch)

        return slowed

    def _with_crash_point(self, predict: Callable[[list], list]) -> Callable[[list], list]:
        def crashing(batch: list) -> list:
            crash_point(self.settings, "inference.batch", "")  # a batch in the model, unanswered
            return predict(batch)

        return crashing

    async def stop(self) -> None:
        if self.reporter is not None:
            await self.reporter.stop()
        for batcher in self.batchers.values():
            await batcher.stop()

    async def handle(self, message: Incoming) -> list[Outgoing]:
        self.holding += 1
        try:
            return await self._handle(message)
        finally:
            self.holding -= 1

    async def _handle(self, message: Incoming) -> list[Outgoing]:
        item = decode_work_item(message.value)
        item.trace["inference_in"] = message.received_at
        batcher = self.batchers.get(item.model)
        if batcher is None:
            raise BadMessage("model_not_served", f"this inference group serves {', '.join(map(str, self.batchers))}; not {item.model}")
        try:
            return await self._infer(message, item)
        except BadMessage as exc:
            if item.parts == 1:
                raise
            # One bad part (a frame) of a multi-part job: answer it as failed, keep the others.
            return [Outgoing(self.topics.predictions, message.key or item.job_id.encode(), to_json(failed_part(item, exc)))]

    async def _infer(self, message: Incoming, item: WorkItem) -> list[Outgoing]:
        batcher = self.batchers[item.model]
        try:  # untrusted until checked: nothing reaches the model that its spec does not declare
            self.models[item.model].spec.check_input(item.tensors)
        except BadInput as exc:
            raise BadMessage("bad_input", str(exc)) from None
        common = dict(
            job_id=item.job_id, part=item.part, parts=item.parts, kind=item.kind,
            modality=item.modality, model=item.model, created_at=item.created_at,
        )
        digest = item.meta.get("payload_digest")
        try:
            output, info = await batcher.submit(item.tensors, item.deadline, item.priority, item.on_timeout)
        except Expired as exc:
            return [self.answer_without_work("expired", **common, trace=item.trace, detail=str(exc), digest=digest,
                                             priority=item.priority)]
        except Rejected as exc:
            return [self.answer_without_work("rejected", **common, trace=item.trace, detail=str(exc), digest=digest,
                                             priority=item.priority)]
        except ItemFailed as exc:
            raise BadMessage("model_error", str(exc)) from None
        item.trace.update(batch_start=info.started_at, batch_end=info.finished_at)
        self.metrics.observe_service("execute", info.finished_at - info.started_at)
        self.service_clock.item_done(info.finished_at - info.started_at, info.size)
        self.service_clock.waited(message.partition, info.started_at - message.timestamp)
        self.metrics.gpu_memory.set(gpu_memory_bytes())
        late = is_late(info.started_at, item.deadline)
        if late:
            self.metrics.late.labels(self.name).inc()
        prediction = Prediction(
            **common,
            status="ok",
            trace=item.trace,
            output=output,
            meta={**item.meta, "batch_size": info.size, "batch_trigger": info.trigger,
                  "ready_partition": message.partition},
            weights=self.models[item.model].weights,
            priority=item.priority,
            late=late,
        )
        # No "inferring" status record: the sink stamps it from the prediction's batch_end.
        return [Outgoing(self.topics.predictions, message.key or item.job_id.encode(), to_json(prediction))]
