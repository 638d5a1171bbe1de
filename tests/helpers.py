"""Test helpers: publish events, wait for stored results, read the results topic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from mmpipe.client import Publisher, follow_results
from mmpipe.schemas.settings import Settings
from mmpipe.stages.sink.store import open_store
from mmpipe.schemas import JobResult, MediaEvent


def publish(settings: Settings, events: Iterable[MediaEvent]) -> list[str]:
    events = list(events)

    async def go() -> None:
        async with Publisher(settings) as publisher:
            await publisher.publish_many(events)

    asyncio.run(go())
    return [e.job_id for e in events]


def publish_raw(settings: Settings, items: Iterable[tuple[bytes | None, bytes]], topic: str | None = None) -> None:
    async def go() -> None:
        async with Publisher(settings) as publisher:
            for key, value in items:
                await publisher.publish_raw(key, value, topic)

    asyncio.run(go())


def wait_for_results(settings: Settings, job_ids: Iterable[str], timeout_s: float = 120.0) -> dict[str, JobResult]:
    """Poll the store until every job has a result; fail with the missing ids otherwise."""
    wanted = set(job_ids)
    store = open_store(settings.store_url)
    deadline = time.monotonic() + timeout_s
    found: dict[str, JobResult] = {}
    try:
        while time.monotonic() < deadline:
            for job_id in wanted - set(found):
                result = store.get_result(job_id)
                if result is not None:
                    found[job_id] = result
            if len(found) == len(wanted):
                return found
            time.sleep(0.2)
    finally:
        store.close()
    raise AssertionError(f"no result after {timeout_s}s for {sorted(wanted - set(found))}")


def topic_results(settings: Settings, idle_timeout_s: float = 2.0) -> list[JobResult]:
    """Every record on the results topic (not deduplicated)."""

    async def go() -> list[JobResult]:
        return [r async for r in follow_results(settings, from_beginning=True, idle_timeout_s=idle_timeout_s)]

    return asyncio.run(go())
