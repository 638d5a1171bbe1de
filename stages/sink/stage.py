"""Sink stage: predictions + dead-letter + status -> result store and the `results` topic.

Writes exactly one result per job_id: parts are stored first-write-wins, the job's result is
assembled in the transaction that stores its last part, and a redelivered message finds the
stored result and re-publishes that same result (only if its publication was not confirmed).
The `results` topic is keyed by job_id and compacted, so it converges to one record per job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from mmpipe.stages.sink.store import Final, ResultStore, StoreUnavailable, open_store
from mmpipe.stages.sink.store.group import GroupCommit
from mmpipe.schemas import (
    DeadLetter,
    JobResult,
    Prediction,
    Refused,
    Timings,
    decode_dead_letter,
    decode_prediction,
    decode_status,
    to_json,
)
from mmpipe.streams.faults import crash_point
from mmpipe.streams.stage import DependencyUnavailable, Incoming, Outgoing, Stage

log = logging.getLogger(__name__)

MERGE_GAP_S = 0.05  # speech segments split only by an audio window boundary are joined


class SinkStage(Stage):
    name = "sink"

    def setup(self) -> None:
        # One thread owns the store's connection: writes are serialised, the loop never blocks.
        self._db = ThreadPoolExecutor(1, thread_name_prefix="store")
        self.store: ResultStore = open_store(self.settings.store_url)
        self.store.init_schema()
        self._group = GroupCommit(self.store, self._db)

    async def stop(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._db, self.store.close)
        self._db.shutdown(wait=True)

    async def handle(self, message: Incoming) -> list[Outgoing]:
        sink_in = message.received_at
        if message.topic == self.topics.status:
            report = decode_status(message.value)  # one stage process's reports: one group commit
            await asyncio.gather(*(self._call(self.store.record_status, e.job_id, e.state, e.at) for e in report.entries))
            return []
        if message.topic == self.topics.dead_letter:
            final = await self._dead_letter(decode_dead_letter(message.value), sink_in)
        else:
            prediction = decode_prediction(message.value)
            prediction.trace["sink_in"] = sink_in
            final = await self._call(self.store.record_part, prediction, assemble)
            if final is None and prediction.parts > 1:
                crash_point(self.settings, "sink.between_parts", prediction.job_id)  # a part stored, not all
        self.metrics.observe_service("sink", time.time() - sink_in)
        if final is None or (final.published and not final.created):
            return []
        if final.created:
            crash_point(self.settings, "sink.after_commit", final.result.job_id)  # stored, not published
            result = final.result
            self.metrics.end_to_end.labels(result.modality, result.status).observe(result.timings.end_to_end_ms / 1000)
            self.metrics.priority_end_to_end.labels(str(result.priority), result.status).observe(
                result.timings.end_to_end_ms / 1000)
        return [Outgoing(self.topics.results, final.result.job_id.encode(), to_json(final.result))]

    async def after_send(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            if out.topic == self.topics.results:
                await self._call(self.store.mark_published, out.key.decode())

    async def _dead_letter(self, letter: DeadLetter, sink_in: float) -> Final | None:
        await self._call(self.store.record_dead_letter, letter)
        if letter.job_id.startswith("unknown:") or letter.reason == "job_id_conflict":
            # No job to answer, or one that is another's: the dead-letter row is the record.
            return None
        return await self._call(self.store.record_result, failed_result(letter, sink_in))

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a store call in the next group commit and return its own outcome."""
        outcome = await self._group.outcome(fn, *args)
        if isinstance(outcome, StoreUnavailable):
            raise DependencyUnavailable(str(outcome)) from outcome
        if isinstance(outcome, Refused):  # a job ID reused for another payload, a value the store will not take
            raise outcome  # dead-lettered with its reason
        if isinstance(outcome, Exception):
            # No store error is the message's fault (bad messages are refused before the store
            # sees them): an error nobody classified is waited out like an outage, loudly, and
            # never turned into a dead letter that would fail a good prediction for good.
            log.error("store call %s failed with an unclassified error; retrying", fn.__name__, exc_info=outcome)
            raise DependencyUnavailable(f"unclassified store error: {type(outcome).__name__}: {outcome}") from outcome
        return outcome


# Assembly: parts -> one result ----------------------------------------------------------------
def assemble(parts: list[Prediction]) -> JobResult:
    """Build a job's result from its parts (all of them, or one expired/rejected part)."""
    completed = time.time()
    first = parts[0]
    unanswered = [p for p in parts if p.status in ("expired", "rejected")]
    critical = max(parts, key=lambda p: p.trace.get("sink_in", 0.0))  # the part that finished last
    timings = timings_from_trace(critical.trace, first.created_at, completed, critical.meta.get("batch_size", 0))
    model = first.model
    if first.modality == "video":
        model = next((p.model for p in parts if p.kind == "image"), first.model)
    common = dict(
        job_id=first.job_id,
        modality=first.modality,
        model=model,
        timings=timings,
        created_at=first.created_at,
        completed_at=completed,
        parts=first.parts,
        priority=first.priority,
        late=any(p.late for p in parts),
        weights="random" if any(p.weights == "random" for p in parts) else first.weights,
    )
    if unanswered:
        first_unanswered = unanswered[0]
        code = "deadline_exceeded" if first_unanswered.status == "expired" else "overloaded"
        error = {"code": code, "message": first_unanswered.error or ""}
        return JobResult(status=first_unanswered.status, prediction=None, error=error, **common)
    if all(p.status == "error" for p in parts):  # no part to show: the job failed
        code, _, message = (parts[0].error or "").partition(": ")
        return JobResult(status="error", prediction=None, error={"code": code, "message": message}, **common)
    return JobResult(status="ok", prediction=_prediction(first.modality, parts), **common)


def _prediction(modality: str, parts: list[Prediction]) -> Any:
    if modality in ("image", "text"):
        return parts[0].output
    frames = [
        {"frame": p.meta.get("frame"), "t_s": p.meta.get("t_s"), **(p.output if p.status == "ok" else {"error": p.error})}
        for p in sorted(parts, key=lambda p: p.part)
        if p.kind == "image"
    ]
    audio = [p for p in parts if p.kind == "audio"]
    speech = merge_speech(audio) if audio else None
    transcript = merge_transcript(audio)
    if speech is not None and transcript is not None:
        speech["transcript"] = transcript
    if modality == "audio":
        return speech
    return {"frames": frames, "audio": speech}


def merge_speech(parts: list[Prediction]) -> dict[str, Any]:
    """Join per-window VAD outputs into one timeline (offsets added, boundary splits merged)."""
    segments: list[dict[str, float]] = []
    duration = 0.0
    failed = [p for p in parts if p.status == "error"]
    for part in sorted((p for p in parts if p.status == "ok"), key=lambda p: p.meta.get("offset_s", 0.0)):
        offset = float(part.meta.get("offset_s", 0.0))
        duration = max(duration, offset + float(part.output.get("duration_s", 0.0)))
        for seg in part.output.get("segments", []):
            start, end = round(offset + seg["start_s"], 3), round(offset + seg["end_s"], 3)
            if segments and start - segments[-1]["end_s"] <= MERGE_GAP_S:
                segments[-1]["end_s"] = max(segments[-1]["end_s"], end)
            else:
                segments.append({"start_s": start, "end_s": end})
    speech = sum(s["end_s"] - s["start_s"] for s in segments)
    merged: dict[str, Any] = {"segments": segments, "duration_s": round(duration, 3), "speech_s": round(speech, 3)}
    if failed:  # windows that failed on their own, beside the others' segments
        merged["failed_windows"] = [{"offset_s": p.meta.get("offset_s"), "error": p.error} for p in failed]
    return merged


def merge_transcript(parts: list[Prediction]) -> dict[str, Any] | None:
    """Join per-window transcripts (a speech-to-text model's parts) into one: a segment per
    window with speech, timed by the window's first and last speech, and the text in order."""
    windows = sorted((p for p in parts if "text" in (p.output or {})), key=lambda p: p.meta.get("offset_s", 0.0))
    if not windows:
        return None
    segments = []
    for part in windows:
        out = part.output
        if not out["text"] or not out.get("segments"):
            continue  # silence, or speech the model heard no words in
        offset = float(part.meta.get("offset_s", 0.0))
        segments.append({
            "start_s": round(offset + out["segments"][0]["start_s"], 3),
            "end_s": round(offset + out["segments"][-1]["end_s"], 3),
            "text": out["text"],
            "tokens": out.get("tokens", []),
            "truncated": bool(out.get("truncated", False)),  # hit the model's token limit
        })
    first = windows[0]
    return {"text": " ".join(s["text"] for s in segments), "segments": segments, "model": str(first.model), "weights": first.weights}


def timings_from_trace(trace: dict[str, float], created: float, completed: float, batch_size: int = 0) -> Timings:
    """Split one path's wall time into waits and work. The spans tile the path, so they add up
    to end_to_end_ms (missing stamps, e.g. of an expired item, count as zero)."""

    def span(start: str, end: str) -> float:
        a, b = trace.get(start), trace.get(end)
        return round(max(b - a, 0.0) * 1000, 3) if a is not None and b is not None else 0.0

    stamps = dict(trace, created=created, completed=completed)
    trace = stamps
    return Timings(
        queue_decode_ms=span("created", "decode_in"),
        decode_ms=span("decode_in", "decode_out"),
        queue_preprocess_ms=span("decode_out", "preprocess_in"),
        preprocess_ms=span("preprocess_in", "preprocess_out"),
        queue_inference_ms=span("preprocess_out", "inference_in"),
        batch_wait_ms=span("inference_in", "batch_start"),
        execute_ms=span("batch_start", "batch_end"),
        queue_sink_ms=span("batch_end", "sink_in"),
        sink_ms=span("sink_in", "completed"),
        end_to_end_ms=span("created", "completed"),
        batch_size=int(batch_size),
    )


def failed_result(letter: DeadLetter, sink_in: float) -> JobResult:
    completed = time.time()
    created = letter.created_at or letter.failed_at
    modality = letter.modality or "unknown"
    return JobResult(
        job_id=letter.job_id,
        status="error",
        modality=modality,
        model=None,  # a dead-lettered job may name no model, or one that does not exist
        prediction=None,
        timings=Timings(end_to_end_ms=round(max(completed - created, 0.0) * 1000, 3), sink_ms=round((completed - sink_in) * 1000, 3)),
        created_at=created,
        completed_at=completed,
        error={"code": letter.reason, "message": letter.detail, "stage": letter.stage},
    )
