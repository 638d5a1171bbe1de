"""Decode stage (CPU): events -> decoded.

Validates the event, resolves the model, reads the payload (inline or a local file under the
allowed input roots), decodes it with PyAV in an isolated worker process (isolation.py: an
address-space limit and a time budget per decode) and emits one work item per part:
an image is one part, audio one part per window, a video one part per sampled frame plus its
audio windows, a text one part. Bad input goes to the dead-letter topic with a reason; a job
whose deadline already passed is answered as expired without being decoded.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mmpipe.stages.decode.inputs import read_payload
from mmpipe.stages.decode.isolation import DecodePool
from mmpipe.stages.decode.media import DecodedFrame, DecodedMedia, DecodeLimits, decode_text, windows
from mmpipe.models.base import ModelError, ModelSpec
from mmpipe.models.registry import DEFAULTS, KIND_OF_MODALITY, all_specs, get_spec, resolve
from mmpipe.schemas import MediaEvent, Refused, WorkItem, decode_event, encode_work_item, payload_digest
from mmpipe.schemas.settings import Settings
from mmpipe.streams.faults import crash_point
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.priority import deadline_verdict
from mmpipe.streams.stage import Incoming, Outgoing, Stage
from mmpipe.streams.topics import DECODED


class DecodeStage(Stage):
    name = "decode"

    def __init__(self, settings: Settings, metrics: StageMetrics) -> None:
        super().__init__(settings, metrics)
        self.sheds_load = settings.admission_policy == "reject"  # the pipeline's admission point

    def setup(self) -> None:
        self._texts = ThreadPoolExecutor(1, thread_name_prefix="decode-text")  # file reads only
        self._pool = DecodePool(
            self.settings.decode_workers, self.settings.decode_memory_limit_bytes, self.settings.decode_timeout_s
        )
        self._pool.warm_up(DecodeLimits(video_max_frames=1))
        all_specs()  # import the model specs (torch, torchvision) now, not on the first job

    async def stop(self) -> None:
        self._texts.shutdown(wait=False, cancel_futures=True)
        self._pool.close()

    async def handle(self, message: Incoming) -> list[Outgoing]:
        event = decode_event(message.value)
        started = message.received_at
        deadline = event.deadline or event.created_at + self.settings.default_deadline_s
        self.backlog = max(self.backlog - 1, 0)
        if deadline_verdict(time.time(), deadline, event.on_timeout) == "expire":
            return [self._answer(event, "expired", started, f"deadline {deadline:.3f} passed before decode")]
        frame_spec = self._resolve(event)
        if not await self.wait_for_room(message, event.priority):
            detail = (f"overloaded: {self.backlog} jobs wait for decode (max_backlog "
                      f"{self.settings.max_backlog}) and the next stage is full; retry later")
            return [self._answer(event, "rejected", started, detail)]
        self.report_status(event.job_id, "decoding", started)
        payload = await read_payload(event.payload, self.settings)
        crash_point(self.settings, "decode.handle", event.job_id)
        media = await self._decode(event, payload, frame_spec)
        items = self._items(event, media, frame_spec, deadline, started)
        self.metrics.observe_service("decode", time.time() - started)
        return await self.forward(items, event.job_id.encode())

    async def forward(self, items: list[WorkItem], key: bytes) -> list[Outgoing]:
        """Where decoded items go: onto `decoded` (the lane of their priority), for preprocess."""
        return [Outgoing(self.topics.lane(DECODED, item.priority), key, encode_work_item(item)) for item in items]

    # ---------------------------------------------------------------------------------------
    def _resolve(self, event: MediaEvent) -> ModelSpec:
        try:
            return resolve(event.model, event.modality)
        except ModelError as exc:
            raise Refused("unknown_model", str(exc)) from None

    async def _decode(self, event: MediaEvent, payload: Any, spec: ModelSpec) -> DecodedMedia | str:
        hints = spec.config.decode
        audio_spec = get_spec(DEFAULTS["audio"])
        limits = DecodeLimits(
            image_short_side=hints.image_short_side,
            image_center_crop=hints.image_center_crop if self.settings.decode_center_crop else None,
            audio_sample_rate=(hints.audio_sample_rate or audio_spec.config.decode.audio_sample_rate or 16_000),
            audio_max_seconds=self.settings.audio_max_seconds,
            video_sample_fps=self.settings.video_sample_fps,
            video_max_frames=self.settings.video_max_frames,
            video_max_seconds=self.settings.video_max_seconds,
            video_max_source_frames=self.settings.video_max_source_frames,
            threads=self.settings.decode_threads,
        )
        if event.modality != "text":
            return await self._pool.decode(event.modality, payload, limits)
        if isinstance(payload, str):
            return payload
        if isinstance(payload, Path):
            payload = await asyncio.get_running_loop().run_in_executor(self._texts, payload.read_bytes)
        return decode_text(payload)

    def _items(
        self, event: MediaEvent, media: DecodedMedia | str, spec: ModelSpec, deadline: float, started: float
    ) -> list[WorkItem]:
        now = time.time()
        trace = {"created": event.created_at, "decode_in": started, "decode_out": now}
        digest = payload_digest(event)
        parts: list[tuple[str, ModelSpec, dict, dict]] = []
        if isinstance(media, str):
            parts.append(("text", spec, {}, {"text": media}))
        else:
            for frame in media.frames:
                parts.append(("image", spec, {"rgb": frame.rgb}, frame_meta(frame, media)))
            if media.pcm is not None and media.pcm.size:
                audio_spec = spec if spec.config.kind == "audio" else get_spec(DEFAULTS["audio"])
                hints = audio_spec.config.decode
                rate = hints.audio_sample_rate or 16_000
                for offset_s, chunk in windows(media.pcm, rate, hints.audio_window_s):
                    meta = {"offset_s": offset_s, "sample_rate": rate}
                    parts.append(("audio", audio_spec, {"pcm": chunk}, meta))
            if event.modality == "audio" and not parts:
                raise Refused("undecodable_media", "audio decoded to zero samples")
        return [
            WorkItem(
                job_id=event.job_id,
                part=index,
                parts=len(parts),
                kind=kind,
                modality=event.modality,
                model=part_spec.ref,
                created_at=event.created_at,
                deadline=deadline,
                trace=dict(trace),
                meta={**meta, "payload_digest": digest},
                tensors=tensors,
                priority=event.priority,
                on_timeout=event.on_timeout,
            )
            for index, (kind, part_spec, tensors, meta) in enumerate(parts)
        ]

    def _answer(self, event: MediaEvent, status: str, started: float, detail: str) -> Outgoing:
        kind = KIND_OF_MODALITY[event.modality]
        return self.answer_without_work(
            status,
            job_id=event.job_id,
            part=0,
            parts=1,
            kind=kind,
            modality=event.modality,
            model=event.model or DEFAULTS[kind],
            created_at=event.created_at,
            trace={"created": event.created_at, "decode_in": started},
            detail=detail,
            digest=payload_digest(event),
            priority=event.priority,
        )


def frame_meta(frame: DecodedFrame, media: DecodedMedia) -> dict[str, Any]:
    """What an image work item says about its frame: where it sits in the media, the media's
    size, and whether decode already cut it to the model's centre crop."""
    meta: dict[str, Any] = {"frame": frame.index, "t_s": frame.time_s, "width": media.width, "height": media.height}
    if frame.center_crop:
        meta["center_crop"] = frame.center_crop
    return meta
