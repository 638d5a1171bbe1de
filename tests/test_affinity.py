"""Pinning the model thread apart from the pipeline's other threads (Linux affinity masks),
in a child process: pinning a pipeline process moves all of its threads."""

import json
import os
import subprocess
import sys

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
with ThreadPoolExecutor(1, initializer=affinity.pin_model_thread, initargs=(model,)) as pool:
    seen["model"] = sorted(pool.submit(os.sched_getaffinity, 0).result())
seen["main"] = sorted(os.sched_getaffinity(0))
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
    assert masks_in_child(model) == {"early": rest, "main": rest, "model": model}


def test_no_model_cpus_changes_nothing():
    cores = sorted(os.sched_getaffinity(0))
    assert masks_in_child([]) == {"early": cores, "main": cores, "model": cores}
