"""Status reports: "this stage has started on this job", coalesced and sent off the ack path.

A job's state times (decoding, preprocessing) are a view for the job API, not an output: the
sink fills every state's time from the job's traces when it stores the result, so a lost
report costs only a live view. Reports are therefore not outputs of the message (no ack waits
on them): each stage buffers them and sends one StatusReport record per flush, every flush_s
or at max_entries, instead of one record per job per stage (each produced, fetched, parsed
and written to the store by the sink on its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mmpipe.schemas import JobStatus, to_json
from mmpipe.schemas.events import StatusReport
from mmpipe.streams.worker_state import worker_name

log = logging.getLogger(__name__)

# Produce one record; awaiting it gives the future of the broker's ack.
Publish = Callable[[str, bytes, bytes], Awaitable["asyncio.Future[Any]"]]

MAX_ENTRIES = 256  # per record: bounds the buffer and the record's size (about 25 KB)


class StatusReporter:
    def __init__(self, stage: str, topic: str, publish: Publish, flush_s: float,
                 on_drop: Callable[[int], None], max_entries: int = MAX_ENTRIES) -> None:
        self.stage = stage
        self.topic = topic
        self._publish = publish
        self._flush_s = flush_s
        self._on_drop = on_drop
        self._max_entries = max_entries
        # Keyed by the reporting process: its reports stay in order on one partition.
        self._key = f"{stage}:{worker_name()}".encode()
        self._entries: list[JobStatus] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sends: set[asyncio.Task] = set()

    def report(self, job_id: str, state: str, at: float) -> None:
        """Buffer one report; the first one of a flush window arms the flush."""
        self._entries.append(JobStatus(job_id, state, at, self.stage))  # type: ignore[arg-type]
        if len(self._entries) >= self._max_entries:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._flush_s, self.flush)

    def flush(self) -> None:
        """Send what is buffered as one record, in the background."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._entries:
            return
        entries, self._entries = self._entries, []
        task = asyncio.ensure_future(self._send(entries))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def close(self) -> None:
        """Send what is buffered and wait for every send in flight."""
        self.flush()
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)

    async def _send(self, entries: list[JobStatus]) -> None:
        try:
            ack = await self._publish(self.topic, self._key, to_json(StatusReport(entries)))
            await ack
        except Exception as exc:  # a live view only: counted and logged, never retried
            log.warning("stage %s: %d status reports dropped: %r", self.stage, len(entries), exc)
            self._on_drop(len(entries))
