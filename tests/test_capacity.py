"""The replica hint of `mmpipe lag`: the arithmetic on synthetic numbers, the reading of real
/metrics pages, and one run against the embedded broker with events arriving in the window."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from typer.testing import CliRunner

from mmpipe.capacity import (
    LATENCY_BUDGET_S,
    MetricsPage,
    ServiceTotals,
    StageLoad,
    advice,
    bench_service_times,
    capacity_hint,
    combine_service,
    drain_seconds,
    lag_threshold,
    parse_metrics,
    replicas_needed,
    scaling_bounds,
    stage_budget_s,
)
from mmpipe.client import make_event
from mmpipe.report import capacity_report, capacity_table, replica_endpoints, up_endpoints
from mmpipe.streams.broker import free_port
from mmpipe.streams.kafka import ensure_topics
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.topology import STAGE_NAMES
from tests.conftest import make_settings
from tests.helpers import publish

# --- The arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arrival", "per_item", "workers", "target", "expected"),
    [
        (100.0, 0.02, 1, 0.7, 3),  # 2.0 replicas busy / 0.7 = 2.86
        (100.0, 0.02, 2, 0.7, 2),  # two worker threads per replica halve it: 1.43
        (35.0, 0.02, 1, 0.7, 1),  # exactly at target: 0.7 / 0.7
        (10.0, 0.07, 1, 0.7, 1),  # float noise (1.0000000000000002) must not round up to 2
        (50.0, 0.02, 1, 1.0, 1),  # target 1: run flat out
        (0.0, 0.5, 1, 0.7, 1),  # no traffic: still one member to take the next item
        (1000.0, 0.004, 1, 0.5, 8),
    ],
)
def test_replicas_needed(arrival, per_item, workers, target, expected):
    assert replicas_needed(arrival, per_item, workers, target) == expected


def test_replicas_needed_without_service_time_or_with_bad_input():
    assert replicas_needed(100.0, None) is None
    with pytest.raises(ValueError):
        replicas_needed(1.0, 0.1, target=0.0)
    with pytest.raises(ValueError):
        replicas_needed(1.0, 0.1, workers=0)


def test_capacity_hint_from_a_window():
    # 300 items arrived in 3 s, 150 were committed; a replica spends 20 ms per item.
    load = StageLoad(
        stage="preprocess", window_s=3.0, arrived=300, consumed=150, lag=400, partitions=2,
        service=ServiceTotals(seconds=2.0, items=100), workers=1, members=1,
    )
    hint = capacity_hint(load, target=0.7)
    assert hint.arrival_per_s == pytest.approx(100.0)
    assert hint.done_per_s == pytest.approx(50.0)
    assert hint.per_item_s == pytest.approx(0.02)
    assert hint.needed == 3
    assert hint.advice == "scale up to 3; > 2 partitions: add partitions first; falling behind"


def test_inference_hint_uses_time_per_item_of_its_batches():
    # 8 batches of 4 items at 40 ms each: 10 ms of accelerator time per item.
    load = StageLoad(
        stage="inference", window_s=2.0, arrived=400, consumed=400, lag=0, partitions=12,
        service=ServiceTotals(seconds=8 * 0.04, items=32, batches=8), members=2,
    )
    hint = capacity_hint(load)
    assert hint.per_item_s == pytest.approx(0.01) and hint.mean_batch == pytest.approx(4.0)
    assert hint.needed == 3  # 200/s x 10 ms = 2 replicas busy, / 0.7
    assert hint.advice == "scale up to 3"


@pytest.mark.parametrize(
    ("needed", "members", "kwargs", "expected"),
    [
        (2, 2, {}, "ok"),
        (1, 3, {}, "ok (1 would do)"),
        (2, None, {}, "run 2"),
        (2, 0, {}, "run 2"),
        (None, 1, {"missing": "no metrics endpoint answered"}, "no metrics endpoint answered"),
        (2, 2, {"lag": 10, "done_per_s": 0.0, "arrival_per_s": 5.0}, "ok; not draining"),
        (2, 2, {"lag": 10, "done_per_s": 6.0, "arrival_per_s": 5.0}, "ok"),  # draining the backlog
    ],
)
def test_advice(needed, members, kwargs, expected):
    assert advice(needed, members, 4, **kwargs) == expected


def test_service_totals_window_and_restart():
    earlier = ServiceTotals(seconds=10.0, items=100, batches=20)
    assert ServiceTotals(12.0, 150, 30).since(earlier) == ServiceTotals(2.0, 50, 10)
    restarted = ServiceTotals(0.5, 5, 1)  # counters went down: the process started again
    assert restarted.since(earlier) == restarted
    assert ServiceTotals().per_item_s is None and ServiceTotals().mean_batch is None


def test_combine_service_prefers_the_window_then_falls_back_to_lifetime():
    before = {"a": MetricsPage("decode", ServiceTotals(1.0, 10)), "b": MetricsPage("decode", ServiceTotals(3.0, 10))}
    busy = {"a": MetricsPage("decode", ServiceTotals(1.5, 15)), "b": MetricsPage("decode", ServiceTotals(3.5, 15))}
    totals, recent = combine_service(before, busy, "decode")
    assert recent and totals == ServiceTotals(1.0, 10)  # two replicas' growth: 0.1 s per item
    totals, recent = combine_service(before, before, "decode")  # nothing served in the window
    assert not recent and totals.per_item_s == pytest.approx(0.2)
    assert combine_service(before, busy, "sink") == (None, True)


# --- Reading /metrics pages ---------------------------------------------------------------------


def page_of(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_parse_metrics_of_a_cpu_stage():
    registry = CollectorRegistry()
    metrics = StageMetrics("decode", registry)
    for seconds in (0.1, 0.2, 0.3):
        metrics.observe_service("decode", seconds)
    page = parse_metrics(page_of(registry))
    assert page.stage == "decode"
    assert page.totals.items == 3 and page.totals.per_item_s == pytest.approx(0.2)


def test_parse_metrics_of_inference_counts_each_batch_once():
    registry = CollectorRegistry()
    metrics = StageMetrics("inference", registry)
    # What the stage records: per batch in the batcher, and per *item* the batch's execute time.
    for model, size, seconds in (("resnet18", 4, 0.2), ("resnet18", 2, 0.1), ("all-minilm-l6-v2", 6, 0.3)):
        metrics.batch_size.labels(model).observe(size)
        metrics.batch_execute.labels(model).observe(seconds)
        for _ in range(size):
            metrics.observe_service("execute", seconds)
    page = parse_metrics(page_of(registry))
    assert page.stage == "inference"
    assert page.totals == ServiceTotals(seconds=pytest.approx(0.6), items=12, batches=3)
    assert page.totals.per_item_s == pytest.approx(0.05)  # 0.6 s of execution for 12 items
    assert page.totals.mean_batch == pytest.approx(4.0)


def test_parse_metrics_of_an_idle_process_uses_the_hint():
    registry = CollectorRegistry()
    StageMetrics("sink", registry)  # labelled series appear only once observed
    page = parse_metrics(generate_latest(registry).decode(), stage_hint="sink")
    assert page.stage == "sink" and page.totals.per_item_s is None


def test_endpoint_discovery():
    endpoints = up_endpoints(9100)
    assert endpoints[0].url == "http://127.0.0.1:9100/metrics" and endpoints[0].stage == "decode"
    assert {e.url for e in endpoints if e.stage == "inference"} >= {"http://127.0.0.1:9120/metrics", "http://127.0.0.1:9121/metrics"}
    assert [e.url for e in replica_endpoints("http://localhost:9100/metrics")] == ["http://localhost:9100/metrics"]


# --- Against the embedded broker ----------------------------------------------------------------


class FakeDecodeReplica:
    """A metrics endpoint like a decode process's, whose service counters grow while it runs."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = StageMetrics("decode", self.registry)
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def publish_until(stop: threading.Event, settings, interval_s: float = 0.2) -> None:
    while not stop.is_set():
        publish(settings, [make_event("text", text="arrives during the window")])
        stop.wait(interval_s)


@pytest.fixture
def lag_settings(broker, tmp_path, media_dir):
    settings = make_settings(broker.bootstrap, tmp_path, media_dir)
    asyncio.run(ensure_topics(settings))
    return settings


def test_capacity_report_against_the_broker(lag_settings):
    replica = FakeDecodeReplica()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            replica.metrics.observe_service("decode", 0.05)
            stop.wait(0.05)

    threads = [threading.Thread(target=publish_until, args=(stop, lag_settings)), threading.Thread(target=work)]
    for thread in threads:
        thread.start()
    try:
        report = asyncio.run(capacity_report(lag_settings, 2.0, metrics_urls=[replica.url]))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        replica.close()

    hints = {h.stage: h for h in report.hints}
    decode = hints["decode"]
    assert report.window_s >= 2.0 and report.endpoints_answered == 1
    assert decode.arrival_per_s > 0 and decode.partitions == 2
    assert decode.lag > 0 and decode.done_per_s == 0  # nobody consumes in this test
    assert decode.members == 0  # the broker says the group has no member
    assert decode.service_recent and decode.per_item_s == pytest.approx(0.05)
    assert decode.needed is not None and decode.advice.startswith(f"run {decode.needed}")
    assert hints["inference"].per_item_s is None and hints["inference"].advice.startswith("no metrics endpoint")
    assert {row.topic for row in report.partitions} >= {f"{lag_settings.topic_prefix}.events"}
    assert capacity_table(report).row_count == 4


def run_live(settings, monkeypatch, command: str, *options: str) -> str:
    """`mmpipe COMMAND` against the test broker: one short window, no metrics ports probed."""
    from mmpipe.cli import app

    monkeypatch.setenv("MMPIPE_TOPIC_PREFIX", settings.topic_prefix)
    result = CliRunner().invoke(
        app, [command, "--bootstrap", settings.bootstrap, "--window", "0.5", "--metrics-base-port", "0", *options],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_lag_command(lag_settings, monkeypatch):
    text = " ".join(run_live(lag_settings, monkeypatch, "lag").split())  # rich wraps to the terminal's width
    assert "replica hint" in text and "consumer lag" in text
    assert "no stage metrics reached" in text


def test_lag_prints_the_keda_numbers_of_its_measurements(lag_settings, monkeypatch):
    document = json.loads(run_live(lag_settings, monkeypatch, "lag", "--keda", "--json"))
    keda = document["keda"]
    assert [s["stage"] for s in keda["stages"]] == list(STAGE_NAMES)
    assert keda["source"].startswith("measured on") and keda["latency_budget_s"] == LATENCY_BUDGET_S
    assert all(s["max_replicas"] == lag_settings.partitions for s in keda["stages"])


def test_keda_command_live(lag_settings, monkeypatch):
    output = run_live(lag_settings, monkeypatch, "keda")
    rows = [line for line in output.splitlines() if line.count("│") > 5]
    assert len(rows) == 4 and all("no service time measured" in row for row in rows)  # no stage ran
    assert "measured on" in output and "replicas beyond 2 partitions get no work" in output


# --- KEDA's numbers -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("per_item", "workers", "budget", "expected"),
    [
        (0.1, 1, 1.0, 10),  # 10 items/s clear 10 in a second
        (0.08255, 2, 1.0, 24),  # two decode threads: 24.2/s
        (0.07, 1, 0.7, 10),  # float noise (9.999999999999998) must not round down to 9
        (2.0, 1, 1.0, 1),  # slower than the budget: still one item per replica
    ],
)
def test_lag_threshold(per_item, workers, budget, expected):
    assert lag_threshold(per_item, workers, budget) == expected


def test_lag_threshold_and_budget_refuse_nonsense():
    with pytest.raises(ValueError):
        lag_threshold(0.0, 1, 1.0)
    with pytest.raises(ValueError):
        lag_threshold(0.1, 0, 1.0)
    with pytest.raises(ValueError):
        stage_budget_s(0.0)
    assert stage_budget_s(4.0) == pytest.approx(1.0)  # four stages share it


def test_scaling_bounds():
    # 50 ms per item on one worker: 20/s; a 2 s budget gives each of 4 stages 0.5 s = 10 items.
    bounds = scaling_bounds("inference", 0.05, 1, 12, latency_budget_s=2.0, arrival_per_s=30.0, max_inflight=100)
    assert bounds.lag_threshold == 10
    assert bounds.min_replicas == 3  # 30/s x 0.05 s = 1.5 replicas busy, / 0.7 -> 3
    assert bounds.max_replicas == 12
    assert bounds.grace_period_s == 20  # 100 in flight x 50 ms + 15 s to commit and leave
    assert drain_seconds(0.05, 2, 100) == pytest.approx(2.5)
    assert bounds.note == "replicas beyond 12 partitions get no work"


def test_scaling_bounds_when_the_partitions_run_out_or_nothing_was_measured():
    crowded = scaling_bounds("decode", 0.1, 1, 4, arrival_per_s=100.0, max_inflight=256)
    assert crowded.min_replicas == 4 and crowded.max_replicas == 4  # 15 needed, 4 can work
    assert "15 needed: add partitions first" in crowded.note
    unmeasured = scaling_bounds("sink", None, 1, 4, max_inflight=256)
    assert unmeasured.lag_threshold is None and unmeasured.grace_period_s is None
    assert unmeasured.min_replicas == 1 and "no service time measured" in unmeasured.note
    with pytest.raises(ValueError):
        scaling_bounds("sink", 0.1, 1, 0, max_inflight=256)


def bench_result(runs: list[dict]) -> dict:
    return {"policies": {"headline": {"label": "dynamic b=8"}}, "runs": runs}


def flood_run(label: str, **stats) -> dict:
    return {"scenario": "flood", "label": label, "stats": stats}


def test_bench_service_times_read_the_headline_flood():
    stats = {
        "breakdown_ms": {"decode_ms": 80.0, "preprocess_ms": 20.0, "sink_ms": 10.0, "execute_ms": 750.0},
        # 2 batches of 8 at 800 ms, 1 of 4 at 400 ms: 2000 ms for 20 items = 100 ms per item
        # (the per-job mean of execute_ms, 750, counts a batch's time once per item).
        "batch_count": {"8": 2.0, "4": 1.0}, "batch_items": {"8": 16, "4": 4},
        "execute_ms_by_batch": {"8": 800.0, "4": 400.0},
    }
    other = flood_run("off", breakdown_ms={}, batch_count={}, batch_items={}, execute_ms_by_batch={})
    times = bench_service_times(bench_result([other, flood_run("dynamic b=8", **stats)]))
    assert list(times) == list(STAGE_NAMES)
    assert times == pytest.approx({"decode": 0.08, "preprocess": 0.02, "inference": 0.1, "sink": 0.01})
    with pytest.raises(ValueError, match="no flood run"):
        bench_service_times(bench_result([other]))


def test_live_scaling_bounds_use_what_the_window_measured(tmp_path):
    from mmpipe.report import CapacityReport, live_scaling_bounds, scaling_table

    settings = make_settings("127.0.0.1:9", tmp_path, tmp_path, partitions=6, max_inflight=64)
    measured = capacity_hint(StageLoad(
        stage="inference", window_s=2.0, arrived=40, consumed=40, lag=3, partitions=6,
        service=ServiceTotals(seconds=0.8, items=40, batches=10), members=1,
    ))
    idle = capacity_hint(StageLoad(stage="sink", window_s=2.0, arrived=0, consumed=0, lag=0, partitions=0, service=None))
    report = CapacityReport("127.0.0.1:9", 2.0, 0.7, [measured, idle], [], 1)
    inference, sink = live_scaling_bounds(report, settings, latency_budget_s=4.0)
    # 20 ms per item: 50/s clear 50 in the stage's 1 s; 20/s arriving need 0.4 replicas busy -> 1.
    assert (inference.lag_threshold, inference.min_replicas, inference.max_replicas) == (50, 1, 6)
    assert inference.grace_period_s == 17  # 64 x 20 ms + 15 s
    assert sink.lag_threshold is None and sink.max_replicas == 6  # no partitions read: the settings'
    assert scaling_table([inference, sink], 4.0, "test").row_count == 2
