"""A slow inference stage throttles the stages in front of it: they pause their partitions, the
backlog stays in Kafka's input topic (not in stage memory, not as piled-up frames between
stages), lag shows it on /metrics, and when the work drains everything resumes and every job
gets its result."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mmpipe.client import make_event
from mmpipe.schemas.settings import BatchingSettings
from mmpipe.stages.sink.store import count_results
from mmpipe.streams.topics import TopicNames
from mmpipe.streams.topology import STAGE_NAMES, metrics_port
from mmpipe.streams.broker import free_port_block
from mmpipe.supervisor import METRICS_PORT_SPAN, Pipeline
from tests.conftest import make_settings
from tests.helpers import publish, wait_for_results

pytestmark = pytest.mark.timeout(600)

DOWNSTREAM_HIGH = 6
MAX_INFLIGHT = 8
STREAM_BUFFER = 4
JOBS = 120


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> list[float]:
    return [v for (n, lbls), v in samples.items() if n == name and all((k, labels[k]) in lbls for k in labels)]


@pytest.fixture(scope="module")
def slow_pipeline(broker, tmp_path_factory, media_dir):
    workdir = tmp_path_factory.mktemp("slow")
    settings = make_settings(
        broker.bootstrap, workdir, media_dir,
        default_batching=BatchingSettings(mode="off"),
        inflight_high_per_partition=4, inflight_low_per_partition=1, max_inflight=MAX_INFLIGHT,
        downstream_lag_high=DOWNSTREAM_HIGH, downstream_lag_low=2, lag_interval_s=0.25,
        stream_buffer_maxsize=STREAM_BUFFER, max_poll_records=STREAM_BUFFER,
        models=["all-minilm-l6-v2"],
    )
    base = free_port_block(METRICS_PORT_SPAN)
    pipeline = Pipeline(settings, workdir=workdir, embedded_broker=False, metrics_base_port=base,
                        replica_overrides={("inference", 0): {"inject_execute_delay_ms": 120}})
    pipeline.start()
    pipeline.ports = {stage: metrics_port(base, stage, 0) for stage in STAGE_NAMES}
    try:
        yield pipeline
    finally:
        pipeline.stop()


def test_slow_inference_pauses_upstream_with_bounded_backlog_then_drains(slow_pipeline):
    settings, ports = slow_pipeline.settings, slow_pipeline.ports
    prefix = settings.topic_prefix
    events = [make_event("text", text=f"job number {i} for the slow model") for i in range(JOBS)]
    publish(settings, events)

    peak_ready_lag = peak_decode_lag = 0.0
    decode_paused_seen = False
    peak_inflight = {stage: 0.0 for stage in STAGE_NAMES}
    deadline = time.monotonic() + 240
    store_done = False
    while time.monotonic() < deadline and not store_done:
        inf = scrape(ports["inference"])
        dec = scrape(ports["decode"])
        peak_ready_lag = max([peak_ready_lag, *metric(inf, "mm_consumer_lag", group=f"{prefix}-inference")])
        peak_decode_lag = max([peak_decode_lag, sum(metric(dec, "mm_consumer_lag", group=f"{prefix}-decode"))])
        decode_paused_seen |= any(v == 1 for v in metric(dec, "mm_partition_paused", stage="decode"))
        for stage in STAGE_NAMES:
            peak_inflight[stage] = max(peak_inflight[stage], *metric(scrape(ports[stage]), "mm_inflight_items") or [0])
        store_done = _all_done(settings, events)
        time.sleep(0.2)

    results = wait_for_results(settings, [e.job_id for e in events], timeout_s=60)
    assert len(results) == JOBS and all(r.status == "ok" for r in results.values())  # nothing lost

    # The next stage's backlog (per partition) stayed near its bound instead of taking all
    # ~60 jobs of the partition: bound + what preprocess still finishes after pausing (its
    # in-flight items, faust's buffer and the records of its last fetch) + what inference holds uncommitted.
    assert 0 < peak_ready_lag <= DOWNSTREAM_HIGH + 2 * MAX_INFLIGHT + 2 * STREAM_BUFFER, peak_ready_lag
    # ... because the stages in front paused (decode too, once preprocess stopped taking work) ...
    assert decode_paused_seen
    pauses = metric(scrape(ports["decode"]), "mm_partition_pauses_total", stage="decode")
    assert pauses and pauses[0] >= 1
    # ... so the backlog waited in Kafka, visible as the decode group's lag ...
    assert peak_decode_lag >= JOBS / 3, peak_decode_lag
    # ... and no stage held more than its in-flight cap in memory.
    assert all(v <= MAX_INFLIGHT for v in peak_inflight.values()), peak_inflight

    # Once drained: partitions resumed, lag back to zero everywhere.
    time.sleep(2.0)
    for stage in STAGE_NAMES:
        samples = scrape(ports[stage])
        assert all(v == 0 for v in metric(samples, "mm_consumer_lag", group=f"{prefix}-{stage}")), stage
        assert all(v == 0 for v in metric(samples, "mm_partition_paused")), stage
    # The same read-outs export how many records each partition holds: one event per job.
    events_topic = TopicNames(prefix).events
    assert sum(metric(scrape(ports["decode"]), "mm_partition_end_offset", topic=events_topic)) == JOBS


def test_metrics_export_the_stage_table(slow_pipeline):
    """Every stage serves the design table's metrics: queue wait, service time, batch sizes."""
    samples = {stage: scrape(port) for stage, port in slow_pipeline.ports.items()}
    for stage in STAGE_NAMES:
        assert metric(samples[stage], "mm_queue_wait_seconds_count", stage=stage)[0] > 0
        assert metric(samples[stage], "process_resident_memory_bytes")
    assert metric(samples["decode"], "mm_service_seconds_count", step="decode")[0] > 0
    assert metric(samples["preprocess"], "mm_service_seconds_count", step="preprocess")[0] > 0
    assert metric(samples["inference"], "mm_service_seconds_count", step="execute")[0] > 0
    assert metric(samples["inference"], "mm_batch_size_count", model="all-minilm-l6-v2")[0] > 0
    assert metric(samples["sink"], "mm_end_to_end_seconds_count", modality="text", status="ok")[0] > 0


def _all_done(settings, events) -> bool:
    return count_results(settings.store_url) >= len(events)


def test_every_stage_reports_ready_and_alive_on_its_metrics_port(slow_pipeline):
    """What Kubernetes' probes ask each stage process: /readyz once its models are loaded and it
    joined its group, /healthz while its event loop beats (every 5 s)."""
    deadline = time.monotonic() + 15  # the first beat comes one interval after the worker starts
    for stage, port in slow_pipeline.ports.items():
        while time.monotonic() < deadline and not metric(scrape(port), "mm_heartbeat_timestamp_seconds", stage=stage):
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            assert (response.status, response.read()) == (200, b"ready\n"), stage
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            assert response.status == 200, stage
        samples = scrape(port)
        assert metric(samples, "mm_stage_ready", stage=stage) == [1.0], stage
        beats = metric(samples, "mm_heartbeat_timestamp_seconds", stage=stage)
        assert beats and time.time() - beats[0] < 30, f"{stage}: the event loop's heartbeat is missing or old"
