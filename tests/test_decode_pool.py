"""The decode worker pool (stages/decode/isolation.py) as the stage uses it: more jobs than
workers, tasks and answers bigger than a pipe, refusals that keep the worker, workers that
die between jobs, are recycled, or are abandoned by a cancelled caller, and a close that leaves
no process behind. (Crashes, overruns and memory exhaustion mid-job: tests/test_hostile.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import psutil
import pytest

from mmpipe.stages.decode import samples
from mmpipe.stages.decode.isolation import PIPE_BYTES, DecodePool
from mmpipe.stages.decode.media import DecodeLimits, MediaError
from mmpipe.streams.stage import DependencyUnavailable

MIB = 1024**2


@pytest.fixture
def pool() -> Iterator[DecodePool]:
    decode_pool = DecodePool(2, 512 * MIB, timeout_s=10.0)
    yield decode_pool
    decode_pool.close()


def _worker_pids() -> set[int]:
    """This process's live spawned workers (not multiprocessing's resource tracker)."""
    pids = set()
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def test_more_jobs_than_workers_each_get_their_own_answer(pool):
    sizes = [(64 + 16 * i, 48 + 8 * i) for i in range(8)]
    images = [samples.encode_image(samples.synthetic_picture(w, h)) for w, h in sizes]

    async def decode_all():
        return await asyncio.gather(*(pool.decode("image", data, DecodeLimits()) for data in images))

    decoded = asyncio.run(decode_all())
    assert [(media.width, media.height) for media in decoded] == sizes


def test_a_task_and_an_answer_bigger_than_the_pipe_cross_whole(pool):
    payload = os.urandom(4 * PIPE_BYTES + 123)
    assert asyncio.run(pool.run(bytes, payload)) == payload
    assert len(asyncio.run(pool.run(bytes, 3 * PIPE_BYTES))) == 3 * PIPE_BYTES


def test_a_refused_input_keeps_its_worker(pool):
    pids = {asyncio.run(pool.run(os.getpid)) for _ in range(4)}
    with pytest.raises(MediaError) as refused:
        asyncio.run(pool.decode("image", b"\x89PNG garbage" * 10, DecodeLimits()))
    assert refused.value.reason == "undecodable_media"
    assert {asyncio.run(pool.run(os.getpid)) for _ in range(4)} == pids


def test_a_worker_killed_between_jobs_costs_no_job(pool):
    victim = asyncio.run(pool.run(os.getpid))
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.2)
    answered = [asyncio.run(pool.run(os.getpid)) for _ in range(4)]  # none refused
    assert victim not in answered


def test_workers_are_recycled_after_their_task_quota():
    pool = DecodePool(1, 512 * MIB, timeout_s=10.0, tasks_per_worker=2)
    try:
        pids = [asyncio.run(pool.run(os.getpid)) for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE
    finally:
        pool.close()


def test_a_cancelled_caller_leaves_a_working_pool_and_no_busy_worker(pool):
    async def cancel_midway() -> int:
        busy = asyncio.ensure_future(pool.run(time.sleep, 30))
        await asyncio.sleep(1.0)
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy
        for _ in range(50):  # SIGKILL takes effect a moment later
            if len(_worker_pids()) == 2:
                break
            await asyncio.sleep(0.05)
        return len(_worker_pids())

    assert asyncio.run(cancel_midway()) == 2  # the sleeping worker was killed and replaced
    assert asyncio.run(pool.run(sum, [1, 2, 3])) == 6


def test_close_leaves_no_worker_process_and_refuses_no_job():
    pool = DecodePool(2, 512 * MIB, timeout_s=10.0)
    pool.warm_up(DecodeLimits(video_max_frames=1))
    assert len(_worker_pids()) == 2
    pool.close()
    assert _worker_pids() == set()
    with pytest.raises(DependencyUnavailable):  # a stopping stage leaves the job for redelivery
        asyncio.run(pool.run(os.getpid))
