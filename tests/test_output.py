"""Output for people and scripts: tables that fit the terminal or stack when they don't (a
pipe is 80 columns), JSON, negative lag explained, and top's percentiles read from real
Prometheus histograms the way Prometheus's histogram_quantile reads them."""

from __future__ import annotations

import json

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from rich.console import Console
from typer.testing import CliRunner

from mmpipe import demo
from mmpipe.cli import app
from mmpipe.client import make_event
from mmpipe.report import (
    END_BEHIND_COMMIT_NOTE,
    fitted,
    partition_json,
    partition_lag_table,
    results_table,
    to_jsonable,
    waiting,
)
from mmpipe.schemas import JobResult, ModelRef
from mmpipe.schemas.events import Timings
from mmpipe.streams.kafka import PartitionLag
from mmpipe.streams.metrics import LATENCY_BUCKETS
from mmpipe.top import buckets, histogram_quantile, parse_pages, window_buckets

RESULT = JobResult(
    job_id="demo-video-0-12345678", status="ok", modality="audio", model=ModelRef("silero-vad", "v6"),
    prediction={"speech_s": 7.1, "duration_s": 10.1, "segments": [{"start_s": 1.0, "end_s": 1.5}, {"start_s": 1.9, "end_s": 5.2}]},
    timings=Timings(queue_decode_ms=120, decode_ms=93, preprocess_ms=26, execute_ms=1070, sink_ms=5,
                    end_to_end_ms=1448, batch_size=1),
    created_at=1.0, completed_at=2.4, weights="pretrained",
)


def render(width: int, renderable_of) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable_of(console))
    return console.export_text()


def test_results_stack_at_80_columns_and_keep_every_value_whole() -> None:
    text = render(80, lambda c: fitted(c, results_table([RESULT])))
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[1] == "demo-video-0-12345678"  # the heading of its block, not folded
    for value in ("status ok", "model silero-vad:v6", "weights pretrained", "e2e 1448", "execute 1070",
                  "speech 7.1s of 10.1s: 1.0-1.5s 1.9-5.2s"):
        assert value in text, value


def test_results_are_a_table_where_they_fit() -> None:
    text = render(250, lambda c: fitted(c, results_table([RESULT])))
    header = next(line for line in text.splitlines() if "prediction" in line)
    assert all(col in header for col in ("job", "status", "model", "weights", "e2e", "execute", "batch"))


ROWS = [
    PartitionLag("mm-decode", "mm.events", 0, 5, 7),  # a producer's batches read short on Tansu
    PartitionLag("mm-decode", "mm.events", 1, 16, 12),
    PartitionLag("mm-decode", "mm.events", 2, 3, None),
]


def test_negative_lag_is_explained_not_shown_bare() -> None:
    text = render(120, lambda c: fitted(c, partition_lag_table(ROWS, "127.0.0.1:9092")))
    row = next(line for line in text.splitlines() if "(-2" in line)
    assert [cell.strip() for cell in row.split("│")[1:-1]] == ["mm-decode", "mm.events", "0", "5", "7", "0 (-2\u2020)"]
    assert "end offset behind the committed offset: nothing waits" in " ".join(text.split())
    assert waiting(ROWS) == 4 + 3  # what waits: not reduced by the short end offset
    assert [partition_json(r)["end_behind_commit"] for r in ROWS] == [True, False, False]
    assert "\u2020" not in render(120, lambda c: partition_lag_table(ROWS[1:], "b"))
    assert END_BEHIND_COMMIT_NOTE.startswith("\u2020")


def test_json_is_plain_json() -> None:
    decoded = json.loads(json.dumps(to_jsonable({"result": RESULT, "rows": ROWS})))
    assert decoded["result"]["timings"]["end_to_end_ms"] == 1448
    assert decoded["rows"][0] == {"group": "mm-decode", "topic": "mm.events", "partition": 0, "end_offset": 5,
                                  "committed": 7}


def test_demo_json_gives_stdout_to_the_results_alone(monkeypatch) -> None:
    events = [make_event("audio", uri="/media/a.wav", job_id=RESULT.job_id), make_event("text", text="t", job_id="lost")]

    def run_demo(settings, jobs, timeout_s, console):  # the pipeline's part, done
        console.print("pipeline up on 127.0.0.1:1")
        return demo.DemoRun(events, {RESULT.job_id: RESULT}, timeout_s)

    monkeypatch.setattr(demo, "run_demo", run_demo)
    result = CliRunner().invoke(app, ["demo", "--json", "--jobs", "2"])
    assert result.exit_code == 1, "a job without a result fails the demo"
    assert [json.loads(line)["job_id"] for line in result.stdout.splitlines()] == [RESULT.job_id]
    assert "pipeline up" in result.stderr and "no result within 300s for: lost" in result.stderr


def histogram_page(values: list[float], **labels: str) -> str:
    registry = CollectorRegistry()
    histogram = Histogram("mm_queue_wait_seconds", "wait", list(labels), buckets=LATENCY_BUCKETS, registry=registry)
    for value in values:
        histogram.labels(**labels).observe(value)
    return generate_latest(registry).decode()


def test_quantiles_from_histogram_buckets_land_in_the_right_bucket() -> None:
    rng = np.random.default_rng(7)
    values = list(rng.lognormal(mean=np.log(0.05), sigma=0.8, size=2000))
    counts = buckets(parse_pages({"u": histogram_page(values, stage="decode")})["u"], "mm_queue_wait_seconds",
                     {"stage": "decode"})
    bounds = (0.0, *LATENCY_BUCKETS)
    for q in (0.5, 0.99):
        exact = float(np.quantile(values, q))
        estimate = histogram_quantile(q, counts)
        upper = next(b for b in LATENCY_BUCKETS if b >= exact)
        lower = bounds[bounds.index(upper) - 1]
        assert lower <= estimate <= upper, (q, exact, estimate)
    assert histogram_quantile(0.5, {}) is None


def test_window_counts_only_what_was_observed_between_scrapes_and_survives_a_restart() -> None:
    before = parse_pages({"a": histogram_page([0.01] * 10, stage="sink"), "b": histogram_page([0.2] * 5, stage="sink")})
    # a: 10 more observations since; b restarted (its counters began again) and saw 3.
    after = parse_pages({"a": histogram_page([0.01] * 10 + [1.0] * 10, stage="sink"),
                         "b": histogram_page([0.2] * 3, stage="sink")})
    counts, recent = window_buckets(before, after, "mm_queue_wait_seconds", stage="sink")
    assert recent and counts[float("inf")] == 13
    idle, recent = window_buckets(after, after, "mm_queue_wait_seconds", stage="sink")
    assert not recent and idle[float("inf")] == 23  # nothing new: the lifetime counts, marked as such
