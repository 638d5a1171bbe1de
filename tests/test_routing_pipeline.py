"""Routing through real processes: two inference replicas, one slowed per batch; at a load the
healthy replica can carry, preprocess places most work on its partitions (hashing would split
it evenly), every job still gets exactly one ok result, and the router's metrics show its
decisions, flips and expected waits beside the waits the workers measured."""

from __future__ import annotations

import time

import pytest

from mmpipe.client import make_event
from mmpipe.schemas.settings import BatchingSettings, SchedulingSettings
from mmpipe.streams.topology import metrics_port
from mmpipe.streams.broker import free_port_block
from mmpipe.supervisor import METRICS_PORT_SPAN, Pipeline
from tests.conftest import make_settings
from tests.helpers import publish, wait_for_results
from tests.test_backpressure import metric, scrape

pytestmark = pytest.mark.timeout(600)

JOBS = 80
SLOW_MS = 150


def test_routing_sends_work_around_a_slow_replica_and_loses_nothing(broker, tmp_path, media_dir):
    settings = make_settings(
        broker.bootstrap, tmp_path, media_dir, partitions=4, models=["all-minilm-l6-v2"],
        default_batching=BatchingSettings(max_batch_size=8, max_wait_ms=5), lag_interval_s=0.25,
        scheduling=SchedulingSettings(routing=True, route_sticky_s=0.3, worker_state_interval_s=0.25),
    )
    base = free_port_block(METRICS_PORT_SPAN)
    pipeline = Pipeline(settings, workdir=tmp_path, embedded_broker=False, metrics_base_port=base,
                        replicas={"inference": 2},
                        replica_overrides={("inference", 1): {"inject_execute_delay_ms": SLOW_MS}})
    pipeline.start()
    try:
        warm = [make_event("text", text=f"warm-up {i}") for i in range(8)]
        wait_for_results(settings, publish(settings, warm))
        time.sleep(1.5)  # both workers measured and reported; the router has read them
        before = [_executed(base, i) for i in (0, 1)]
        events = [make_event("text", text=f"routed job {i}") for i in range(JOBS)]
        for start in range(0, JOBS, 2):  # 20 jobs/s: well within the healthy replica's capacity
            publish(settings, events[start:start + 2])
            time.sleep(0.1)
        results = wait_for_results(settings, [e.job_id for e in events], timeout_s=180)
        executed = [_executed(base, i) - before[i] for i in (0, 1)]
        router = scrape(metrics_port(base, "preprocess", 0))
    finally:
        pipeline.stop()

    assert len(results) == JOBS and all(r.status == "ok" for r in results.values())
    assert sum(executed) == JOBS, executed  # each item ran once, on one replica
    # The slow replica owns half the partitions; by hash it would run about half the items.
    assert executed[1] <= 0.3 * JOBS, executed
    decisions = metric(router, "mm_route_decisions_total")
    assert sum(decisions) >= JOBS
    assert metric(router, "mm_route_flips_total")
    expected = metric(router, "mm_route_expected_wait_seconds", model="all-minilm-l6-v2")
    measured = metric(router, "mm_route_measured_wait_seconds")
    assert len(expected) == 4 and measured and all(w >= 0 for w in expected + measured)


def _executed(base: int, replica: int) -> float:
    """Items the inference replica has run (the sum of its batch sizes)."""
    samples = scrape(metrics_port(base, "inference", replica))
    return sum(metric(samples, "mm_batch_size_sum"))
