"""Pinning the model thread apart from the pipeline's other threads (Linux affinity masks),
in a child process: pinning a pipeline process moves all of its threads."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from mmpipe.streams import affinity

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux affinity and two cores")

CHILD = """
import json, os, sys, threading
from concurrent.futures import ThreadPoolExecutor
from mmpipe.streams import affinity
model = json.loads(sys.argv[1])
early = threading.Event(); done = threading.Event(); seen = {}
def started_before_pinning():
    early.set(); done.wait(); seen["early"] = sorted(os.sched_getaffinity(0))
thread = threading.Thread(target=started_before_pinning); thread.start(); early.wait()
affinity.pin_pipeline_process(model)
def nice():
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
with ThreadPoolExecutor(1, initializer=affinity.pin_model_thread, initargs=(model,)) as pool:
    seen["model"] = sorted(pool.submit(os.sched_getaffinity, 0).result())
    seen["model_nice"] = pool.submit(nice).result()
with ThreadPoolExecutor(1, initializer=affinity.pin_model_thread, initargs=(model, 10)) as pool:
    seen["raised_nice"] = pool.submit(nice).result()
seen["main"] = sorted(os.sched_getaffinity(0))
seen["main_nice"] = nice()
done.set(); thread.join()
print(json.dumps(seen))
"""


def masks_in_child(model_cpus: list[int]) -> dict[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(model_cpus)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_model_thread_alone_moves_to_its_cores_and_every_other_thread_to_the_rest():
    cores = sorted(os.sched_getaffinity(0))
    model, rest = cores[-1:], cores[:-1]
    assert affinity.pipeline_cpus(model) == set(rest)
    seen = masks_in_child(model)
    assert {k: seen[k] for k in ("early", "main", "model")} == {"early": rest, "main": rest, "model": model}


def _may_raise_priority() -> bool:
    """Whether this process may lower a thread's nice value (CAP_SYS_NICE, RLIMIT_NICE room)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(affinity.raise_thread_priority, 1).result()


def test_an_urgent_slot_s_thread_runs_above_the_others_where_the_process_may_raise_it():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = masks_in_child(sorted(os.sched_getaffinity(0))[-1:])
    raised = max(base - 10, -20) if _may_raise_priority() else base  # else an even split, logged
    assert (seen["main_nice"], seen["model_nice"], seen["raised_nice"]) == (base, base, raised)


def test_no_model_cpus_changes_nothing():
    cores = sorted(os.sched_getaffinity(0))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = masks_in_child([])
    assert {k: seen[k] for k in ("early", "main", "model", "model_nice", "main_nice")} == {
        "early": cores, "main": cores, "model": cores, "model_nice": base, "main_nice": base}


@pytest.mark.parametrize("precedence", [10, 0])
def test_the_inference_stage_runs_a_model_s_urgent_slot_above_its_main_thread(precedence):
    """An urgent batch shares the model's core with a running batch; the slot thread's lower
    nice value gives it most of the core (benchmarks/urgent_precedence.py measures how much)."""
    import threading

    from prometheus_client import CollectorRegistry

    from mmpipe.schemas.settings import BatchingSettings, Settings
    from mmpipe.stages.inference import InferenceStage
    from mmpipe.streams.metrics import StageMetrics

    settings = Settings(models=["resnet18"], torch_threads=1, allow_random_weights=True,
                        model_cpus=sorted(os.sched_getaffinity(0))[-1:],
                        default_batching=BatchingSettings(urgent_precedence_nice=precedence))
    stage = InferenceStage(settings, StageMetrics("inference-nice", registry=CollectorRegistry()))
    stage.setup()
    ((ref, model),) = stage.models.items()
    batcher = stage._dynamic(ref, model)

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert batcher._urgent_executor is not None
    assert batcher._executor.submit(nice).result() == base
    raised = max(base - precedence, -20) if _may_raise_priority() else base
    assert batcher._urgent_executor.submit(nice).result() == raised
