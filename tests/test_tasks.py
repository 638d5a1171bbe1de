"""Stopping background tasks: a swallowed cancellation costs a round, never a hang."""

from __future__ import annotations

import asyncio
import logging

from mmpipe.streams.tasks import cancel_and_wait, close_within


async def test_a_loop_whose_wait_for_swallowed_the_cancel_is_still_stopped():
    # Python 3.11's wait_for returns the inner result when the cancel lands in the same loop
    # iteration as the inner completion (gh-86296): the loop below would run for ever.
    loop = asyncio.get_running_loop()
    inner: list[asyncio.Future] = []
    rounds = 0

    async def consume_forever() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            inner.append(loop.create_future())
            await asyncio.wait_for(inner[-1], 10)

    task = asyncio.ensure_future(consume_forever())
    await asyncio.sleep(0)
    inner[-1].set_result(None)  # completes in the same iteration as the cancel below
    await asyncio.wait_for(cancel_and_wait(task, recancel_after_s=0.05), 5)
    assert task.cancelled()


async def test_a_task_that_ignores_one_cancel_is_cancelled_again():
    seen = 0

    async def stubborn() -> None:
        nonlocal seen
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen += 1
                if seen > 1:
                    raise

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, recancel_after_s=0.05), 5)
    assert task.cancelled() and seen == 2


async def test_a_task_that_never_stops_is_left_with_a_warning(caplog):
    released = asyncio.Event()

    async def immortal() -> None:
        while not released.is_set():
            try:
                await released.wait()
            except asyncio.CancelledError:
                pass

    task = asyncio.ensure_future(immortal())
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait(task, recancel_after_s=0.02, give_up_after_s=0.1)
    assert not task.done() and "did not stop" in caplog.text
    released.set()  # let it end, so the test's loop can close
    await task


async def test_a_task_that_had_failed_is_reported_not_raised(caplog):
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING):
        await cancel_and_wait(task)
    assert "boom" in caplog.text


async def test_close_within_bounds_a_close_that_hangs(caplog):
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(close_within(asyncio.sleep(60), 0.05, "a hung client"), 5)
    assert "a hung client did not close" in caplog.text


async def test_no_task_is_nothing_to_stop():
    await cancel_and_wait(None)
