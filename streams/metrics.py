"""Every metric a stage exports, defined once, plus the faust sensor that feeds the Kafka-level
ones. Stage code records through StageMetrics; nothing else creates Prometheus objects.

Exposed on http://<host>:<metrics_port>/metrics by each stage process.
"""

from __future__ import annotations

import logging
from typing import Any

from faust.sensors.prometheus import FaustMetrics, PrometheusMonitor
from faust.types import TP
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# Seconds. Fine at the low end (batch waits are a few ms), coarse up to minutes (backlogs).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


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
            "mm_batch_flushes_total", "Batches flushed, by trigger (full, max_wait, deadline, timeout)",
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
        self.buffer_full = Counter(
            "mm_topic_buffer_full_total", "Faust's per-topic buffer filled (fetching paused)", ["stage"], registry=r,
        )

    def observe_service(self, step: str, seconds: float) -> None:
        self.service.labels(self.stage, step).observe(max(seconds, 0.0))

    def count(self, outcome: str) -> None:
        self.items.labels(self.stage, outcome).inc()


class StageMonitor(PrometheusMonitor):
    """Faust's Prometheus sensor, extended with the events our backpressure cares about."""

    def __init__(self, stage_metrics: StageMetrics, faust_metrics: FaustMetrics, **kwargs: Any) -> None:
        super().__init__(metrics=faust_metrics, **kwargs)
        self.stage_metrics = stage_metrics

    def on_topic_buffer_full(self, tp: TP) -> None:
        super().on_topic_buffer_full(tp)
        self.stage_metrics.buffer_full.labels(self.stage_metrics.stage).inc()


_server_started: set[int] = set()


def serve_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Expose the default registry on host:port (once per process; port 0 disables)."""
    if port and port not in _server_started:
        start_http_server(port, addr=host)
        _server_started.add(port)
        log.info("metrics on :%d/metrics", port)
