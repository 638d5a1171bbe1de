"""Failure policy: what a stage does when handling a message fails.

    BadMessage (refused input)   -> dead-letter topic at once, with its reason; never retried
    TransientError               -> retried max_retries times (full-jitter backoff), then
                                    dead-lettered as retries_exhausted
    DependencyUnavailable        -> retried until the dependency is back, holding the offset
                                    (the partition gate then pauses intake)
    anything else (a bug)        -> dead-lettered as internal_error, loudly: a bug must not
                                    stall the partition

Pure of Kafka: the policy returns what to produce; delivery sends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mmpipe.schemas import BadMessage, DeadLetter, peek_header, to_json
from mmpipe.schemas.events import MODALITIES
from mmpipe.schemas.settings import Settings
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.retry import retry_async
from mmpipe.streams.stage import DependencyUnavailable, Incoming, Outgoing, TransientError

log = logging.getLogger(__name__)

EXCERPT_BYTES = 512

Handler = Callable[[Incoming], Awaitable[list[Outgoing]]]


def dead_letter(stage: str, message: Incoming, reason: str, detail: str) -> DeadLetter:
    header = peek_header(message.value)
    created = header.get("created_at")
    modality = header.get("modality")
    return DeadLetter(
        job_id=message.job_id,
        stage=stage,
        reason=reason,
        detail=detail[:2000],
        source_topic=message.topic,
        source_partition=message.partition,
        source_offset=message.offset,
        failed_at=time.time(),
        created_at=float(created) if isinstance(created, (int, float)) else None,
        modality=modality if modality in MODALITIES else None,  # raw text from a refused message: only a known one
        payload_excerpt=(message.value or b"")[:EXCERPT_BYTES],
    )


class FailurePolicy:
    def __init__(
        self,
        stage: str,
        settings: Settings,
        metrics: StageMetrics,
        dead_letter_topic: str,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.stage = stage
        self.metrics = metrics
        self.dead_letter_topic = dead_letter_topic
        self.max_retries = settings.max_retries
        self.backoff_s = settings.retry_backoff_s
        self.backoff_max_s = settings.retry_backoff_max_s
        self._sleep = sleep

    async def run(self, handle: Handler, message: Incoming) -> list[Outgoing]:
        """Handle one message under the policy; returns what to produce (outputs or a letter)."""
        try:
            outgoing = await retry_async(
                lambda: handle(message), (TransientError, DependencyUnavailable),
                base_s=self.backoff_s, cap_s=self.backoff_max_s,
                give_up=self._transient_exhausted, on_retry=self.count_retry, sleep=self._sleep,
            )
        except BadMessage as exc:
            return [self.dead_letter(message, exc.reason, exc.detail)]
        except TransientError as exc:
            return [self.dead_letter(message, "retries_exhausted", f"{self.max_retries + 1} attempts: {exc}")]
        except Exception as exc:
            log.exception("stage %s failed on %s", self.stage, message.job_id)
            return [self.dead_letter(message, "internal_error", f"{type(exc).__name__}: {exc}")]
        self.metrics.count("ok")
        return outgoing

    def _transient_exhausted(self, exc: BaseException, attempts: int) -> bool:
        return isinstance(exc, TransientError) and attempts >= self.max_retries

    def count_retry(self, exc: BaseException, attempt: int, delay: float, reason: str | None = None) -> None:
        reason = reason or ("transient" if isinstance(exc, TransientError) else "dependency_unavailable")
        self.metrics.retries.labels(self.stage, reason).inc()
        log.warning("stage %s: %s (%s); retry %d in %.2fs", self.stage, reason, exc, attempt + 1, delay)

    def dead_letter(self, message: Incoming, reason: str, detail: str) -> Outgoing:
        self.metrics.count("dead_letter")
        self.metrics.dead_letters.labels(self.stage, reason).inc()
        letter = dead_letter(self.stage, message, reason, detail)
        log.info("dead-letter %s from %s: %s: %s", letter.job_id, self.stage, reason, detail[:200])
        return Outgoing(self.dead_letter_topic, message.job_id.encode(), to_json(letter))
