"""Every metric a stage exports, defined once, plus the faust sensor that feeds the Kafka-level
ones. Stage code records through StageMetrics; nothing else creates Prometheus objects.

Exposed on http://<host>:<metrics_port>/metrics by each stage process, beside the probes an
orchestrator asks: /readyz (models loaded and the consumer group joined) and /healthz (the event
loop still beats).
"""

from __future__ import annotations

import logging
import threading
import time
from http import HTTPStatus
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from faust.sensors.prometheus import FaustMetrics, PrometheusMonitor
from faust.types import TP
from mode import Service
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

# Seconds. Fine at the low end (batch waits are a few ms), coarse up to minutes (backlogs).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)

# StageMonitor beats every HEARTBEAT_S; an event loop silent for STALL_AFTER_S is stuck (a blocking
# call, a deadlock) and /healthz fails so the orchestrator restarts the process.
HEARTBEAT_S = 5.0
STALL_AFTER_S = 60.0


class StageMetrics:
    """The per-stage metrics table of the design notes (queue, service, batch, lag, errors)."""

    def __init__(self, stage: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.stage = stage
        r = registry
        self.items = Counter("mm_items_total", "Messages handled, by outcome", ["stage", "outcome"], registry=r)
        self.queue_wait = Histogram(
            "mm_queue_wait_seconds",
            "Time a message waited in its input topic (consume time minus produce time)",
            ["stage"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.service = Histogram(
            "mm_service_seconds",
            "Time a stage spent working on one message (decode, preprocess, execute, sink)",
            ["stage", "step"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.inflight = Gauge("mm_inflight_items", "Items taken but not yet committed", ["stage"], registry=r)
        self.partition_inflight = Gauge(
            "mm_partition_inflight_items", "In-flight items per assigned partition",
            ["stage", "topic", "partition"], registry=r,
        )
        self.partition_paused = Gauge(
            "mm_partition_paused", "1 while backpressure holds the partition paused",
            ["stage", "topic", "partition"], registry=r,
        )
        self.pauses = Counter("mm_partition_pauses_total", "Partition pauses by backpressure", ["stage"], registry=r)
        self.admission_waits = Counter(
            "mm_admission_waits_total", "Times the stage waited at its process-wide in-flight cap",
            ["stage"], registry=r,
        )
        self.lag = Gauge(
            "mm_consumer_lag", "Log end offset minus committed offset",
            ["group", "topic", "partition"], registry=r,
        )
        # Records a partition holds on the embedded broker (it never deletes one), whose cost per
        # fetch grows with it: alert on it there (README, known limits).
        self.end_offset = Gauge(
            "mm_partition_end_offset", "Log end offset of a partition the stage reads or feeds",
            ["topic", "partition"], registry=r,
        )
        self.errors = Counter("mm_errors_total", "Errors by reason", ["stage", "reason"], registry=r)
        self.retries = Counter("mm_retries_total", "Retries of transient failures", ["stage", "reason"], registry=r)
        self.dead_letters = Counter("mm_dead_letters_total", "Messages sent to the dead-letter topic", ["stage", "reason"], registry=r)
        self.expired = Counter("mm_expired_total", "Items answered as expired (deadline passed)", ["stage"], registry=r)
        self.rejected = Counter("mm_rejected_total", "Jobs refused by admission control", ["stage"], registry=r)
        # Batching: the size / wait trade-off, per model.
        self.batch_size = Histogram(
            "mm_batch_size", "Items per executed batch", ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )
        self.batch_wait = Histogram(
            "mm_batch_wait_seconds", "Wait of the oldest item of a batch when it was flushed",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_execute = Histogram(
            "mm_batch_execute_seconds", "Model execution time per batch", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_flush = Counter(
            "mm_batch_flushes_total", "Batches flushed, by trigger (full, max_wait, timeout)",
            ["model", "trigger"], registry=r,
        )
        self.batcher_queue = Gauge("mm_batcher_queued_items", "Items waiting in the batcher", ["model"], registry=r)
        # Continuous batching of autoregressive models (streams/continuous.py), per model.
        self.active_sequences = Gauge("mm_active_sequences", "Sequences in the running set", ["model"], registry=r)
        self.kv_reserved = Gauge("mm_kv_reserved_bytes", "KV-cache bytes reserved by running sequences", ["model"], registry=r)
        self.kv_budget = Gauge("mm_kv_budget_bytes", "KV-cache budget admission reserves from", ["model"], registry=r)
        self.admission_wait = Histogram(
            "mm_admission_wait_seconds", "Arrival to admission into the running set (waiting for KV memory)",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_to_first_token = Histogram(
            "mm_time_to_first_token_seconds", "Arrival to the first generated token", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.time_per_output_token = Histogram(
            "mm_time_per_output_token_seconds", "Mean time between a sequence's generated tokens", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.generated_tokens = Counter(
            "mm_generated_tokens_total", "Decoder output tokens (tokens/s is its rate)", ["model"], registry=r,
        )
        self.sequences_finished = Counter(
            "mm_sequences_finished_total",
            "Sequences ended, by reason (eot, length, no_decoding, expired, kv_queue_full, kv_too_large, failed)",
            ["model", "reason"], registry=r,
        )
        self.decode_step_rows = Histogram(
            "mm_decode_step_rows", "Sequences in one decoder step", ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r,
        )
        self.gpu_memory = Gauge("mm_gpu_memory_bytes", "Peak GPU memory allocated by torch", registry=r)
        self.end_to_end = Histogram(
            "mm_end_to_end_seconds", "Job creation to stored result, by job modality and status",
            ["modality", "status"], buckets=LATENCY_BUCKETS, registry=r,
        )
        # Scheduling: waits and latency per priority level (0 = high), routing onto `ready`.
        self.priority_wait = Histogram(
            "mm_priority_queue_wait_seconds", "Wait of an item for a worker or a batch, by priority level",
            ["stage", "priority"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.priority_end_to_end = Histogram(
            "mm_priority_end_to_end_seconds", "Job creation to stored result, by priority level and status",
            ["priority", "status"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.late = Counter("mm_late_total", "Items run after their deadline (on_timeout = run_late)", ["stage"], registry=r)
        self.route_decisions = Counter(
            "mm_route_decisions_total", "Work items the router placed, by ready-topic partition",
            ["partition"], registry=r,
        )
        self.route_flips = Counter(
            "mm_route_flips_total", "Times the router's preferred partition changed (rate() = flips/s)", registry=r,
        )
        self.route_expected_wait = Gauge(
            "mm_route_expected_wait_seconds", "The router's expected wait per ready partition (lag x service time)",
            ["model", "partition"], registry=r,
        )
        self.route_measured_wait = Gauge(
            "mm_route_measured_wait_seconds", "Queue wait the owning inference worker last reported per partition",
            ["partition"], registry=r,
        )
        self.buffer_full = Counter(
            "mm_topic_buffer_full_total", "Faust's per-topic buffer filled (fetching paused)", ["stage"], registry=r,
        )
        # What the probes read (serve_metrics), also on the dashboard: members per stage.
        self.ready = Gauge(
            "mm_stage_ready", "1 once the stage's models are loaded and it has joined its consumer group",
            ["stage"], registry=r,
        )
        self.ready.labels(stage).set(0)  # a starting replica counts as a member not yet ready
        self.heartbeat = Gauge(
            "mm_heartbeat_timestamp_seconds", "Last beat of the stage's event loop (Unix time)", ["stage"], registry=r,
        )

    def mark_ready(self) -> None:
        self.ready.labels(self.stage).set(1)

    def beat(self) -> None:
        self.heartbeat.labels(self.stage).set_to_current_time()

    def observe_service(self, step: str, seconds: float) -> None:
        self.service.labels(self.stage, step).observe(max(seconds, 0.0))

    def count(self, outcome: str) -> None:
        self.items.labels(self.stage, outcome).inc()


class StageMonitor(PrometheusMonitor):
    """Faust's Prometheus sensor, extended with the events our backpressure cares about and the
    two signals the probes read: ready once the worker finished a rebalance (it joined its group,
    after the stage's setup() loaded its models), alive while its event loop keeps beating (the
    sensor is a service on the worker's loop)."""

    def __init__(self, stage_metrics: StageMetrics, faust_metrics: FaustMetrics, **kwargs: Any) -> None:
        super().__init__(metrics=faust_metrics, **kwargs)
        self.stage_metrics = stage_metrics

    def on_rebalance_end(self, app: Any, state: dict) -> None:
        super().on_rebalance_end(app, state)
        self.stage_metrics.mark_ready()

    @Service.timer(HEARTBEAT_S)
    async def _heartbeat(self) -> None:
        self.stage_metrics.beat()

    def on_topic_buffer_full(self, tp: TP) -> None:
        super().on_topic_buffer_full(tp)
        self.stage_metrics.buffer_full.labels(self.stage_metrics.stage).inc()


def _gauge_values(registry: CollectorRegistry, name: str) -> list[float]:
    return [s.value for family in registry.collect() if family.name == name for s in family.samples]


def probe(registry: CollectorRegistry, path: str, now: float) -> tuple[int, str] | None:
    """The answer to a probe path from the registry's own gauges (None: not a probe path)."""
    if path == "/readyz":
        if any(value == 1 for value in _gauge_values(registry, "mm_stage_ready")):
            return 200, "ready"
        return 503, "not ready: models loading or consumer group not joined yet"
    if path == "/healthz":
        beats = _gauge_values(registry, "mm_heartbeat_timestamp_seconds")
        silent_s = now - max(beats) if beats else 0.0  # no beat yet: still starting (/readyz tells)
        if silent_s > STALL_AFTER_S:
            return 503, f"event loop stalled: no heartbeat for {silent_s:.0f} s"
        return 200, "ok"
    return None


def metrics_app(registry: CollectorRegistry = REGISTRY) -> Any:
    """WSGI app: the probes, and the registry's metrics on every other path."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        answer = probe(registry, environ.get("PATH_INFO", ""), time.time())
        if answer is None:
            return metrics(environ, start_response)
        code, text = answer
        start_response(f"{code} {HTTPStatus(code).phrase}", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"{text}\n".encode()]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes and probes every few seconds
        pass


_server_started: set[int] = set()


def serve_metrics(port: int, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> None:
    """Serve metrics and probes on host:port in a daemon thread (once per process; port 0 disables)."""
    if port and port not in _server_started:
        server = make_server(host, port, metrics_app(registry), ThreadingWSGIServer, handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        _server_started.add(port)
        log.info("metrics on :%d/metrics, probes on /readyz and /healthz", port)
