"""The one retry policy of the project: tenacity with full-jitter exponential backoff.

Full jitter (a uniform wait between 0 and min(cap, base * 2**attempt)) spreads the retries of
many items and processes apart, so a recovering dependency is not hit by a synchronized wave.
Every retry loop (stage failures and produce, topic creation, the API's results listener, the
embedded broker's readiness wait) is built here, so they all back off the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_base,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    stop_never,
    wait_fixed,
    wait_random_exponential,
)

log = logging.getLogger(__name__)

RetryOn = type[BaseException] | tuple[type[BaseException], ...]


def full_jitter(base_s: float, cap_s: float) -> wait_random_exponential:
    return wait_random_exponential(multiplier=base_s, max=cap_s)


def async_retrying(
    retry_on: RetryOn,
    *,
    base_s: float,
    cap_s: float,
    give_up: Callable[[BaseException, int], bool] | None = None,
    deadline_s: float | None = None,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> AsyncRetrying:
    """Retry `retry_on` errors with full-jitter backoff until `give_up(exc, attempts_so_far)`
    says stop or `deadline_s` passes; then the last error is raised as itself."""
    retry = retry_if_exception_type(retry_on)
    if give_up is not None:
        retry = retry & _not_given_up(give_up)
    return AsyncRetrying(
        retry=retry,
        wait=full_jitter(base_s, cap_s),
        stop=stop_after_delay(deadline_s) if deadline_s is not None else stop_never,
        before_sleep=_reporter(on_retry),
        sleep=sleep,
        reraise=True,
    )


async def retry_async(
    call: Callable[[], Awaitable[Any]], retry_on: RetryOn, *, base_s: float, cap_s: float, **options: Any
) -> Any:
    """`await call()` under async_retrying(...). The first attempt runs bare, since nearly every
    call (each message's handling and produce) succeeds at once: the retrying object is built
    only after a failure, which it then takes as its first attempt (a `deadline_s` counts from
    there)."""
    try:
        return await call()
    except retry_on as exc:
        failure: BaseException | None = exc

    async def replay_then_call() -> Any:
        nonlocal failure
        if failure is not None:
            exc, failure = failure, None
            raise exc
        return await call()

    async for attempt in async_retrying(retry_on, base_s=base_s, cap_s=cap_s, **options):
        with attempt:
            return await replay_then_call()


def poll_until(call: Callable[[], Any], *, every_s: float, deadline_s: float,
               retry_if: Callable[[BaseException], bool] = lambda exc: isinstance(exc, Exception)) -> Any:
    """Blocking: call until it stops raising, every `every_s`, for at most `deadline_s`; the
    last error is raised as itself. For waiting on a process that is starting (not a dependency
    under load: no backoff)."""
    return Retrying(
        retry=retry_if_exception(retry_if),
        wait=wait_fixed(every_s),
        stop=stop_after_delay(deadline_s),
        reraise=True,
    )(call)


class _not_given_up(retry_base):
    """Retry while `give_up(error, attempts made before this one)` says no."""

    def __init__(self, give_up: Callable[[BaseException, int], bool]) -> None:
        self.give_up = give_up

    def __call__(self, state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome else None
        return exc is not None and not self.give_up(exc, state.attempt_number - 1)


def _reporter(on_retry: Callable[[BaseException, int, float], None] | None) -> Callable[[RetryCallState], None]:
    def report(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        if on_retry is not None and exc is not None:
            on_retry(exc, state.attempt_number - 1, delay)
        else:
            log.debug("retry %d in %.2fs after %r", state.attempt_number, delay, exc)

    return report
