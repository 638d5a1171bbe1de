"""Decoding untrusted media in worker processes, so one hostile file cannot take the decode
stage down: each worker runs under an address-space limit (RLIMIT_AS) and each decode under a
time budget; a worker that crashes, runs out of memory or overruns is replaced (an overrunning
one is killed) and only its own job is refused, with a reason:

    decode_timeout          the decode took longer than the budget
    decode_out_of_memory    the decode needed more memory than the worker may have
    decoder_crashed         the worker died (a signal, e.g. a crash in native code)

Workers are spawned, not forked: a fork of the stage would carry torch (imported for the model
specs) into every worker's address space, and the limit is meant for the decoder alone.

The pool lives on the caller's event loop: each worker has a pipe each way, written and read
without blocking by the loop itself (length-prefixed pickles), and a loop timer enforces the
budget. No threads: a pool with manager threads (pebble, before this) handed every job through a
queue and a thread on each side, which cost about 0.5 ms more CPU per image job, both sides
together (benchmarks/decode_pool_cost.py --compare-with).
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import multiprocessing
import os
import pickle
import resource
import signal
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from mmpipe.stages.decode.media import DecodedMedia, DecodeLimits, MediaError, Source, decode_media

T = TypeVar("T")
# Recycle workers now and then, in case a codec leaks. Rarely: a respawn imports the stage's
# __main__ again (~0.4 s of CPU), and a worker's RSS stayed flat over 3,000 mixed decodes
# (benchmarks/decode_worker_recycling.py: every 500 cost 0.84 ms of CPU per decode more).
TASKS_PER_WORKER = 5000
PIPE_BYTES = 1 << 20  # a decoded image (150 KB) crosses in one write, not 64 KB at a time
_LENGTH = struct.Struct(">Q")
_INCOMPLETE = object()


class _Overran(Exception):
    """The decode's time budget ran out (kept apart from a TimeoutError the task may raise)."""


class _Died(Exception):
    def __init__(self, exitcode: int | None) -> None:
        super().__init__(exitcode)
        self.exitcode = exitcode


class _Gone(_Died):
    """The worker was dead before it got the task (the task never started: it may go to another)."""


# The worker's side ------------------------------------------------------------------------------
def _limit_worker(memory_limit_bytes: int) -> None:
    """Cap the worker's address space (malloc then fails, not the host)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = os.read(fd, min(left, PIPE_BYTES))
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> bytes:
    return _read_exactly(fd, _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))[0])


def _write_all(fd: int, frame: list[bytes]) -> None:
    """Write a frame's parts (no copy to join them); blocking."""
    left = sum(map(len, frame))
    while left:
        written = os.writev(fd, frame)
        left -= written
        if left:
            frame = [memoryview(b"".join(frame))[written:]]


def _frame(obj: Any) -> list[bytes]:
    """A length-prefixed pickle, as the two parts writev sends."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return [_LENGTH.pack(len(data)), data]


def _serve(tasks: Connection, results: Connection, memory_limit_bytes: int) -> None:
    """A worker's whole life: run each (fn, args) it is sent and send back (ok, value) until
    told to stop (None) or its stage goes away (end of file)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the stage's to handle
    _limit_worker(memory_limit_bytes)
    while True:
        try:
            task = pickle.loads(_read_frame(tasks.fileno()))
        except EOFError:
            return
        if task is None:
            return
        fn, args = task
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # the caller gets it; the worker goes on
            outcome = (False, exc)
        try:
            frame = _frame(outcome)
        except Exception as exc:  # noqa: BLE001 (an unpicklable result or error)
            frame = _frame((False, RuntimeError(f"the worker's answer could not be sent: {exc!r}")))
        _write_all(results.fileno(), frame)


# The stage's side -------------------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    tasks: Connection  # the stage writes tasks here (non-blocking)
    results: Connection  # and reads answers here (non-blocking)
    done: int = 0
    inbox: bytearray = field(default_factory=lambda: bytearray(PIPE_BYTES))  # each read lands here
    _buffer: bytearray = field(default_factory=bytearray)  # an answer that came in several reads

    def take_answer(self, chunk: memoryview) -> Any:
        """Feed bytes read from the worker; the unpickled answer once it is all there (mostly
        from the first read: the pipe holds a decoded image whole), else _INCOMPLETE."""
        if not self._buffer and len(chunk) >= _LENGTH.size and len(chunk) == _LENGTH.size + _LENGTH.unpack_from(chunk)[0]:
            return pickle.loads(chunk[_LENGTH.size:])
        self._buffer += chunk
        if len(self._buffer) < _LENGTH.size:
            return _INCOMPLETE
        end = _LENGTH.size + _LENGTH.unpack_from(self._buffer)[0]
        if len(self._buffer) < end:
            return _INCOMPLETE
        answer = pickle.loads(memoryview(self._buffer)[_LENGTH.size:end])
        del self._buffer[:end]
        return answer

    def ask_to_stop(self) -> None:
        try:
            _send_now(self.tasks.fileno(), _frame(None))
        except (OSError, _Died):
            pass

    def close_pipes(self) -> None:
        self.tasks.close()
        self.results.close()


class DecodePool:
    def __init__(self, workers: int, memory_limit_bytes: int, timeout_s: float,
                 tasks_per_worker: int = TASKS_PER_WORKER) -> None:
        self.memory_limit_bytes = memory_limit_bytes
        self.timeout_s = timeout_s
        self.workers = workers
        self.tasks_per_worker = tasks_per_worker
        self._context = multiprocessing.get_context("spawn")
        self._closed = False
        self._live: set[_Worker] = set()
        self._leaving: list[BaseProcess] = []  # stopped or killed, not reaped yet
        self._idle: list[_Worker] = [self._spawn() for _ in range(workers)]
        self._waiting: collections.deque[asyncio.Future[_Worker]] = collections.deque()

    async def decode(self, modality: str, source: Source, limits: DecodeLimits) -> DecodedMedia:
        return await self.run(decode_media, modality, source, limits)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker, its failures turned into refusals (fn must be picklable)."""
        task = _frame((fn, args))
        try:
            try:
                ok, value = await self._attempt(task)
            except _Gone:  # that worker had died while idle (killed from outside): it never started
                ok, value = await self._attempt(task)
        except _Overran:
            raise MediaError("decode_timeout", f"decoding took longer than {self.timeout_s:g} s") from None
        except _Died as died:
            raise MediaError("decoder_crashed", f"the decode worker died ({_exit_reason(died.exitcode)})") from None
        if ok:
            return value
        if isinstance(value, MemoryError):
            raise MediaError(
                "decode_out_of_memory", f"decoding needed more than {self.memory_limit_bytes >> 20} MiB"
            ) from None
        raise value

    def warm_up(self, limits: DecodeLimits) -> None:
        """Start every worker and decode a tiny clip in each, so imports, codec and swscale
        set-up are not billed to the first jobs (before the stage's loop runs: blocking)."""
        from mmpipe.stages.decode import samples

        clip = samples.encode_video(seconds=1.0, width=64, height=48, audio=samples.tone_pcm(1.0))
        task = _frame((decode_media, ("video", clip, limits)))
        for worker in self._idle:
            _set_blocking(worker, True)
            try:
                _write_all(worker.tasks.fileno(), task)
                ok, value = pickle.loads(_read_frame(worker.results.fileno()))
            finally:
                _set_blocking(worker, False)
            if not ok:
                raise value

    def close(self) -> None:
        """Ask idle workers to stop, kill busy ones, and reap them all."""
        self._closed = True
        idle = set(self._idle)
        for worker in list(self._live):
            self._retire(worker, kill=worker not in idle)
        self._idle.clear()
        for process in self._leaving:
            process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        self._leaving.clear()

    # ---------------------------------------------------------------------------------------
    async def _attempt(self, task: list[bytes]) -> tuple[bool, Any]:
        """`task` on one worker; the worker comes back to the pool, or is replaced when it died,
        overran or its caller was cancelled mid-task (what it is doing then is unknown)."""
        worker = await self._take()
        try:
            answer = await self._call(worker, task)
        except BaseException:
            self._give_back(self._replace(worker))
            raise
        worker.done += 1
        self._give_back(worker if worker.done < self.tasks_per_worker else self._replace(worker, kill=False))
        return answer

    def _spawn(self) -> _Worker:
        tasks_read, tasks_write = self._context.Pipe(duplex=False)
        results_read, results_write = self._context.Pipe(duplex=False)
        for conn in (tasks_write, results_write):
            _widen(conn.fileno())
        process = self._context.Process(
            target=_serve, args=(tasks_read, results_write, self.memory_limit_bytes), daemon=True,
            name="decode-worker",
        )
        process.start()  # spawn hands the child its own copies of the two ends it uses
        tasks_read.close()
        results_write.close()
        worker = _Worker(process, tasks_write, results_read)
        _set_blocking(worker, False)
        self._live.add(worker)
        return worker

    def _retire(self, worker: _Worker, kill: bool) -> None:
        if kill:
            worker.process.kill()
        else:
            worker.ask_to_stop()
        worker.close_pipes()
        self._live.discard(worker)
        self._leaving.append(worker.process)
        self._leaving = [process for process in self._leaving if process.exitcode is None]  # reaps the gone

    def _replace(self, worker: _Worker, kill: bool = True) -> _Worker | None:
        """Retire `worker` and start another in its place (none once the pool is closed)."""
        self._retire(worker, kill)
        return None if self._closed else self._spawn()

    async def _take(self) -> _Worker:
        """An idle worker, or wait (first come, first served) for one to come back."""
        if self._closed:  # the stage is stopping: not the input's fault, and not answered
            from mmpipe.streams.stage import DependencyUnavailable  # here: workers import this module too

            raise DependencyUnavailable("the decode pool is closed")
        if self._idle and not self._waiting:
            return self._idle.pop()
        slot: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        self._waiting.append(slot)
        try:
            return await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self._give_back(slot.result())  # handed one as the wait was cancelled: pass it on
            raise
        finally:
            if slot in self._waiting:
                self._waiting.remove(slot)

    def _give_back(self, worker: _Worker | None) -> None:
        if worker is None:
            return
        while self._waiting:
            slot = self._waiting.popleft()
            if not slot.done():
                slot.set_result(worker)
                return
        self._idle.append(worker)

    async def _call(self, worker: _Worker, frame: list[bytes]) -> tuple[bool, Any]:
        """Send one task to `worker` and await its answer within the time budget; the loop reads
        the answer as it comes and writes a task bigger than the pipe as the worker takes it."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        results_fd = worker.results.fileno()

        def fail(exc: BaseException) -> None:
            if not answer.done():
                answer.set_exception(exc)

        def readable() -> None:
            try:
                size = os.readv(results_fd, [worker.inbox])
            except BlockingIOError:
                return
            except OSError:
                size = 0
            if answer.done():
                return
            if not size:  # the worker closed its end: it is dying or dead
                worker.process.join(0.5)
                fail(_Died(worker.process.exitcode))
            else:
                try:
                    outcome = worker.take_answer(memoryview(worker.inbox)[:size])
                except Exception as exc:  # noqa: BLE001 (an answer that does not unpickle)
                    fail(exc)
                    return
                if outcome is not _INCOMPLETE:
                    answer.set_result(outcome)

        loop.add_reader(results_fd, readable)
        timer = loop.call_later(self.timeout_s, fail, _Overran())
        sender = None
        try:
            try:
                rest = _send_now(worker.tasks.fileno(), frame, partial=True)
            except _Died:
                raise _Gone(None) from None
            if rest:
                sender = loop.create_task(_send_rest(loop, worker.tasks.fileno(), rest))
                sender.add_done_callback(lambda done: done.cancelled() or done.exception() is None or fail(done.exception()))
            return await answer
        finally:
            timer.cancel()
            loop.remove_reader(results_fd)
            if sender is not None:
                sender.cancel()


def _widen(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or over the system's pipe-max-size
        pass


def _set_blocking(worker: _Worker, blocking: bool) -> None:
    os.set_blocking(worker.tasks.fileno(), blocking)
    os.set_blocking(worker.results.fileno(), blocking)


def _send_now(fd: int, frame: list[bytes], partial: bool = False) -> memoryview | None:
    """Write what the pipe takes now (an idle worker has emptied it; a task of up to PIPE_BYTES
    goes whole); the rest, if `partial`, for _send_rest."""
    try:
        written = os.writev(fd, frame)
    except BlockingIOError:
        written = 0
    except BrokenPipeError:
        raise _Died(None) from None
    if written == sum(map(len, frame)):
        return None
    if not partial:
        raise _Died(None)
    return memoryview(b"".join(frame))[written:]


async def _send_rest(loop: asyncio.AbstractEventLoop, fd: int, view: memoryview) -> None:
    while view:
        writable: asyncio.Future[None] = loop.create_future()
        loop.add_writer(fd, lambda: writable.done() or writable.set_result(None))
        try:
            await writable
        finally:
            loop.remove_writer(fd)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            raise _Died(None) from None


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {-exitcode}: {signal.strsignal(-exitcode)}"
    return f"exit code {exitcode}"
