"""Group commit for an asyncio process: store calls from many tasks share transactions.

The calls that queue while a transaction runs on the store's thread share the next one
(ResultStore.run_group). At light load a call runs alone at once; under load one commit serves
many. Used by the sink (every store call) and the job API (its writes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from mmpipe.stages.sink.store.base import ResultStore

GROUP_COMMIT_MAX = 256  # store calls per transaction


class GroupCommit:
    def __init__(self, store: ResultStore, thread: Executor, max_calls: int = GROUP_COMMIT_MAX) -> None:
        self.store = store
        self._thread = thread  # the one thread that owns the store's connection
        self._max_calls = max_calls
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def outcome(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Queue `fn(*args)` for the next group transaction; returns what it returned or the
        exception it raised (as a value: the caller decides what a failure means to it)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((fn, args, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            group, self._pending = self._pending[: self._max_calls], self._pending[self._max_calls :]
            calls = [(fn, args) for fn, args, _ in group]
            try:
                outcomes = await loop.run_in_executor(self._thread, self.store.run_group, calls)
            except Exception as exc:  # the whole group failed (StoreUnavailable): every caller hears it
                outcomes = [exc] * len(group)
            for (_, _, future), outcome in zip(group, outcomes):
                if not future.done():  # its caller may have been cancelled meanwhile
                    future.set_result(outcome)
