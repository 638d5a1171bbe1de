"""Keep the pipeline's own CPU work off the cores the model computes on.

With `model_cpus` set, every pipeline process (the broker, each stage, the inference stage's
event loop and Kafka threads) runs on the other cores and only the inference stage's model
thread runs on `model_cpus`. On a small CPU-only machine this is what lets a batch execute as
fast as the model alone: otherwise decode, preprocess, the sink and the broker preempt the
model thread whenever they have work. On a GPU host the same split keeps the thread that feeds
the accelerator from waiting behind (de)serialisation. Linux only (sched_setaffinity); empty
`model_cpus` (the default) changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)


def _supported() -> bool:
    return hasattr(os, "sched_setaffinity")


def pipeline_cpus(model_cpus: Iterable[int]) -> set[int]:
    """The cores left for everything but the model: all this process may use, less model_cpus
    (all of them if that would leave none)."""
    available = os.sched_getaffinity(0) if _supported() else set(range(os.cpu_count() or 1))
    rest = available - set(model_cpus)
    return rest or available


def pin(pid: int, cpus: set[int], what: str) -> None:
    """Pin a process (pid) or the calling thread (pid 0) to `cpus`; a failure is logged, never
    raised: affinity is an optimisation."""
    if not _supported() or not cpus:
        return
    try:
        os.sched_setaffinity(pid, cpus)
    except OSError as exc:
        log.warning("could not pin %s to CPUs %s: %s", what, sorted(cpus), exc)


def pin_pipeline_process(model_cpus: Iterable[int]) -> None:
    """The calling process, every thread it has (imports start some: torch's pools) and, by
    inheritance, every thread it starts later."""
    model_cpus = set(model_cpus)
    if model_cpus:
        pin_threads(os.getpid(), pipeline_cpus(model_cpus), f"pid {os.getpid()}")


def pin_model_thread(model_cpus: Iterable[int], precedence: int = 0) -> None:
    """Executor initializer of a model thread: this thread alone moves to model_cpus, and runs
    `precedence` nice steps above the process (an urgent slot's thread beside a main one)."""
    model_cpus = set(model_cpus)
    if model_cpus:
        pin(0, model_cpus, "the model thread")
    raise_thread_priority(precedence)


def raise_thread_priority(steps: int) -> bool:
    """Give the calling thread more CPU than the other threads on its core: a nice value `steps`
    below its current one (Linux: nice is per thread). That needs CAP_SYS_NICE or room under
    RLIMIT_NICE; without either the thread keeps its value and shares its core evenly, which
    is logged. (The reverse, the other thread at a higher nice value, needs no privilege, but
    then it would lose its core to any process that lands there, not only to this thread.)"""
    if steps <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid) - steps, -20))
    except OSError as exc:
        log.warning("thread %d keeps its CPU priority (%s): it shares its core evenly", tid, exc)
        return False
    return True


def pin_threads(pid: int, cpus: set[int], what: str) -> None:
    """Move every thread of a running process (a new mask set on the pid alone moves only its
    main thread); used to re-pin a broker that is already up."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError as exc:
        log.warning("could not list the threads of %s: %s", what, exc)
        return
    for tid in tids:
        pin(tid, cpus, f"{what} thread {tid}")
