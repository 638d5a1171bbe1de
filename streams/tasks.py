"""Stopping a background task so that it stays stopped.

On Python 3.11, `asyncio.wait_for` returns the inner result when the outer cancellation
arrives in the same loop iteration in which the inner awaitable completes (CPython gh-86296,
fixed in 3.12): the task's `cancel()` is swallowed, and a loop such as
`while True: await consumer.getmany()` runs on while its owner awaits it for ever. Every
background task here is stopped through `cancel_and_wait`, which cancels again until the task
has ended, so a lost cancellation costs one more round instead of a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

log = logging.getLogger(__name__)

RECANCEL_AFTER_S = 0.5  # how long one cancellation may take before it is sent again
GIVE_UP_AFTER_S = 30.0  # a task still running after this is left behind, with a warning


async def cancel_and_wait(task: asyncio.Future | None, *, recancel_after_s: float = RECANCEL_AFTER_S,
                          give_up_after_s: float = GIVE_UP_AFTER_S) -> None:
    """Cancel `task` and wait until it has ended; its own failure, if any, is logged, not raised."""
    if task is None:
        return
    deadline = time.monotonic() + give_up_after_s
    while not task.done():
        if time.monotonic() > deadline:
            log.warning("task %r did not stop within %.0f s of being cancelled; leaving it", task, give_up_after_s)
            return
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_after_s)
    if not task.cancelled() and task.exception() is not None:
        log.warning("task %r had failed before it was stopped: %r", task, task.exception())


async def close_within(closing: Awaitable[object], timeout_s: float, what: str) -> None:
    """Await a client's close/stop for at most `timeout_s`: shutting down never hangs on a peer."""
    try:
        await asyncio.wait_for(closing, timeout_s)
    except asyncio.TimeoutError:
        log.warning("%s did not close within %.1f s; dropping it", what, timeout_s)
    except Exception as exc:  # closing a broken client: nothing left to do with it
        log.debug("%s failed while closing: %r", what, exc)
