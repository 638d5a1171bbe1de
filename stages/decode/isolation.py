"""Decoding untrusted media in worker processes, so one hostile file cannot take the decode
stage down: each worker runs under an address-space limit (RLIMIT_AS) and each decode under a
time budget; a worker that crashes, runs out of memory or overruns is replaced (pebble kills
an overrunning worker and restarts it) and only its own job is refused, with a reason:

    decode_timeout          the decode took longer than the budget
    decode_out_of_memory    the decode needed more memory than the worker may have
    decoder_crashed         the worker died (a signal, e.g. a crash in native code)

Workers are spawned, not forked: a fork of the stage would carry torch (imported for the model
specs) into every worker's address space, and the limit is meant for the decoder alone.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
import signal
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any, TypeVar

import pebble

from mmpipe.stages.decode.media import DecodedMedia, DecodeLimits, MediaError, Source, decode_media

T = TypeVar("T")
# Recycle workers now and then, in case a codec leaks. Rarely: a respawn imports the stage's
# __main__ again (~0.4 s of CPU), and a worker's RSS stayed flat over 3,000 mixed decodes
# (benchmarks/decode_worker_recycling.py: every 500 cost 0.84 ms of CPU per decode more).
TASKS_PER_WORKER = 5000
# pebble's two manager threads look at the pool every sleep_unit (0.1 s: 20 wake-ups a second in
# an idle decode stage) for overrun budgets and dead workers; jobs and results do not wait for
# it. Every 0.5 s, a refusal for a dead or overrunning worker comes up to 0.5 s later.
POOL_TICK_S = 0.5
pebble.common.CONSTS.sleep_unit = POOL_TICK_S


def _limit_worker(memory_limit_bytes: int) -> None:
    """Runs first in every worker: cap its address space (malloc then fails, not the host)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))


class DecodePool:
    def __init__(self, workers: int, memory_limit_bytes: int, timeout_s: float) -> None:
        self.memory_limit_bytes = memory_limit_bytes
        self.timeout_s = timeout_s
        self.workers = workers
        self._pool = pebble.ProcessPool(
            max_workers=workers,
            max_tasks=TASKS_PER_WORKER,
            initializer=_limit_worker,
            initargs=(memory_limit_bytes,),
            context=multiprocessing.get_context("spawn"),
        )

    async def decode(self, modality: str, source: Source, limits: DecodeLimits) -> DecodedMedia:
        return await self.run(decode_media, modality, source, limits)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker, its failures turned into refusals (fn must be picklable)."""
        future = self._pool.schedule(fn, args=args, timeout=self.timeout_s)
        try:
            return await asyncio.wrap_future(future)
        except TimeoutError:
            raise MediaError("decode_timeout", f"decoding took longer than {self.timeout_s:g} s") from None
        except MemoryError:
            raise MediaError(
                "decode_out_of_memory", f"decoding needed more than {self.memory_limit_bytes >> 20} MiB"
            ) from None
        except pebble.ProcessExpired as exc:
            raise MediaError("decoder_crashed", f"the decode worker died ({_exit_reason(exc.exitcode)})") from None
        except CancelledError:
            raise asyncio.CancelledError() from None

    def warm_up(self, limits: DecodeLimits) -> None:
        """Start every worker and decode a tiny clip in each, so imports, codec and swscale
        set-up are not billed to the first jobs."""
        from mmpipe.stages.decode import samples

        clip = samples.encode_video(seconds=1.0, width=64, height=48, audio=samples.tone_pcm(1.0))
        futures = [self._pool.schedule(decode_media, args=("video", clip, limits)) for _ in range(self.workers)]
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.stop()
        self._pool.join()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {-exitcode}: {signal.strsignal(-exitcode)}"
    return f"exit code {exitcode}"
