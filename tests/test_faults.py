"""Nothing lost, nothing doubled: real stage processes SIGKILLed mid-run, a consumer added to a
group mid-run and removed again, and the sink's database locked for a while.

The counts are checked in the store (one row per job) and on the results topic (every job
present, exactly one distinct result per job_id, however often it was re-published)."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from mmpipe.harness.chaos import ChaosRun, bad_workload, kill_every_stage_plan, workload
from mmpipe.schemas.settings import BatchingSettings
from mmpipe.stages.sink.store import open_store
from mmpipe.stages.sink.store.sqlite import sqlite_path
from mmpipe.stages.decode import samples
from mmpipe.supervisor import Pipeline
from tests.conftest import make_settings

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def fault_pipeline(broker, workdir, media_dir, **overrides) -> Pipeline:
    settings = make_settings(
        broker.bootstrap, workdir, media_dir,
        default_batching=BatchingSettings(max_batch_size=8, max_wait_ms=10),
        # A little model time per batch keeps batches in flight when the kill lands.
        inject_execute_delay_ms=15,
        **overrides,
    )
    return Pipeline(settings, workdir=workdir, embedded_broker=False)


def assert_exactly_once(report) -> None:
    assert report.missing == [], f"lost in the store: {report.missing[:10]}"
    assert report.missing_on_topic == [], f"lost on the topic: {report.missing_on_topic[:10]}"
    assert report.jobs_with_conflicting_results == [], report.jobs_with_conflicting_results[:10]
    assert report.topic_differs_from_store == [], report.topic_differs_from_store[:10]
    assert report.conflicts == 0
    assert report.stored_results == report.jobs + report.bad_inputs  # primary key: one row each
    assert report.topic_jobs == report.jobs + report.bad_inputs
    # High-priority jobs crossed the high lanes through the same faults, and came back as the others.
    assert set(report.statuses_by_priority) == {"0", "1"}, report.statuses_by_priority
    assert sum(report.statuses_by_priority["0"].values()) > 0


def assert_multi_part_jobs_covered(report) -> None:
    """The workload's multi-part jobs came back whole: each video as 3 parts (2 frames + its
    audio track), each long spoken clip as 2 (two Whisper windows)."""
    assert report.workload.get("video", 0) > 0 and report.workload.get("long_audio", 0) > 0, report.workload
    assert report.statuses_by_kind["long_audio"] == {"ok": report.workload["long_audio"]}, report.statuses_by_kind
    assert report.parts.get("3", 0) == report.workload["video"], report.parts
    assert report.parts.get("2", 0) == report.workload["long_audio"], report.parts


def test_sigkill_of_every_stage_mid_run_loses_and_doubles_nothing(broker, tmp_path, media_dir):
    pipeline = fault_pipeline(broker, tmp_path, media_dir)
    pipeline.start()
    try:
        run = ChaosRun(pipeline, workload(160, seed=1), bad_workload(12), rate=40)
        report = run.run(kill_every_stage_plan(run))
    finally:
        pipeline.stop()
    assert report.kills == ["decode-0", "preprocess-0", "inference-0", "sink-0"]
    assert_exactly_once(report)
    assert report.statuses == {"ok": report.jobs}
    assert_multi_part_jobs_covered(report)
    assert set(report.bad_input_reasons) == {"malformed_json", "undecodable_media", "unknown_model",
                                             "uri_outside_input_roots"}


def test_consumers_joining_and_leaving_mid_run_lose_and_double_nothing(broker, tmp_path, media_dir):
    pipeline = fault_pipeline(broker, tmp_path, media_dir, partitions=4)
    pipeline.start()
    try:
        run = ChaosRun(pipeline, workload(160, seed=2), [], rate=40)
        report = run.run([
            (0.2, lambda: run.add_consumer("inference", 1)),
            (0.35, lambda: run.add_consumer("decode", 1)),
            (0.55, lambda: run.remove_consumer("inference", 1)),
            (0.7, lambda: run.remove_consumer("decode", 1)),
        ])
    finally:
        pipeline.stop()
    assert report.rebalances == ["+inference-1", "+decode-1", "-inference-1", "-decode-1"]
    assert_exactly_once(report)
    assert report.statuses == {"ok": report.jobs}
    assert_multi_part_jobs_covered(report)


def test_locked_database_delays_results_but_loses_none(broker, tmp_path, media_dir):
    pipeline = fault_pipeline(broker, tmp_path, media_dir, retry_backoff_max_s=1.0)
    pipeline.start()
    lock_seconds = 8.0
    try:
        run = ChaosRun(pipeline, workload(60, seed=3), [], rate=20)
        held = threading.Event()
        counts_during_lock: list[int] = []
        path = sqlite_path(pipeline.settings.store_url)

        def lock_database() -> None:
            conn = sqlite3.connect(path, timeout=30, isolation_level=None)
            conn.execute("BEGIN EXCLUSIVE")  # no other writer until we let go
            held.set()
            counts_during_lock.append(_count_results(path))
            time.sleep(lock_seconds)
            counts_during_lock.append(_count_results(path))  # WAL readers still see the table
            conn.execute("ROLLBACK")
            conn.close()

        locker = threading.Thread(target=lock_database)
        report = run.run([(0.2, lambda: (locker.start(), held.wait()))])
        locker.join()
    finally:
        pipeline.stop()
    first, last = counts_during_lock
    assert first == last < report.jobs  # no result was written while the store was locked
    assert_exactly_once(report)
    assert report.statuses == {"ok": report.jobs}
    assert_multi_part_jobs_covered(report)
    store = open_store(pipeline.settings.store_url)
    assert store.dead_letters() == []  # waiting for the store is not a reason to fail a job


def _count_results(path: str) -> int:
    with sqlite3.connect(path, timeout=30) as conn:
        return conn.execute("SELECT COUNT(*) FROM results").fetchone()[0]


def _wait_exit(proc, timeout_s: float = 120.0) -> int:
    return proc.process.wait(timeout_s)


def test_crash_between_store_commit_and_publish_republishes_the_stored_result(broker, tmp_path, media_dir):
    """The named fault point sink.after_commit kills the sink right after a job's result is
    committed and before it is published; the restarted sink publishes that same stored
    result (once: the store remembers it is published)."""
    from tests.helpers import publish, topic_results, wait_for_results
    from mmpipe.client import make_event

    pipeline = fault_pipeline(broker, tmp_path, media_dir, state_dir=tmp_path / "state",
                              fault_points=["sink.after_commit"])
    pipeline.start()
    try:
        event = make_event("text", text="stored, then the sink dies")
        publish(pipeline.settings, [event])
        assert _wait_exit(pipeline.process("sink")) == -9
        stored = wait_for_results(pipeline.settings, [event.job_id])[event.job_id]
        assert [r for r in topic_results(pipeline.settings, idle_timeout_s=1.0) if r.job_id == event.job_id] == []
        pipeline.restart("sink")
        marker = make_event("text", text="after the restart")
        wait_for_results(pipeline.settings, publish(pipeline.settings, [marker]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            on_topic = [r for r in topic_results(pipeline.settings, idle_timeout_s=1.0) if r.job_id == event.job_id]
            if on_topic:
                break
    finally:
        pipeline.stop()
    assert [r.completed_at for r in on_topic] == [stored.completed_at]  # the stored result, once
    assert on_topic[0].prediction == stored.prediction


def test_a_job_that_kills_the_decode_stage_is_dead_lettered_as_crashed_stage(broker, tmp_path, media_dir):
    """A poison job (the fault point decode.handle armed for its id) kills decode each time it
    is handled: after poison_max_crashes crashes running alone it is dead-lettered as
    crashed_stage, and the jobs that were in flight beside it complete."""
    from tests.helpers import publish, wait_for_results
    from mmpipe.client import make_event

    pipeline = fault_pipeline(broker, tmp_path, media_dir, poison_max_crashes=2, partitions=1, state_dir=tmp_path / "state",
                              fault_points=["decode.handle:poison-1"])
    pipeline.start()
    try:
        events = [make_event("text", text=f"neighbour {i}") for i in range(2)]
        events.insert(1, make_event("image", data=samples.encode_image(samples.synthetic_picture(64, 48)),
                                    job_id="poison-1"))
        publish(pipeline.settings, events)
        crashes = 0
        store = open_store(pipeline.settings.store_url)
        while store.get_result("poison-1") is None and crashes < 5:
            if not pipeline.process("decode").alive():
                crashes += 1
                pipeline.restart("decode")
            time.sleep(0.2)
        results = wait_for_results(pipeline.settings, [e.job_id for e in events])
    finally:
        pipeline.stop()
    assert crashes == 3  # the first (with neighbours in flight), then two alone
    assert results["poison-1"].status == "error" and results["poison-1"].error["code"] == "crashed_stage"
    assert all(results[e.job_id].status == "ok" for e in events if e.job_id != "poison-1")


def test_crashes_at_named_points_lose_and_double_nothing(broker, tmp_path, media_dir):
    """A crash at each named point, once, while multi-part and single-part jobs flow: inside an
    inference batch, between the stored parts of one job, and between a result's commit and its
    publication. Each dead stage is restarted; every job ends once, as stored."""
    points = ["inference.batch", "sink.between_parts", "sink.after_commit"]
    pipeline = fault_pipeline(broker, tmp_path, media_dir, state_dir=tmp_path / "state", fault_points=points)
    pipeline.start()
    try:
        run = ChaosRun(pipeline, workload(40, seed=4), bad_workload(4), rate=20)
        report = run.run([])
    finally:
        pipeline.stop()
    assert report.fault_points_fired == sorted(points)
    assert sorted(report.kills) == ["inference-0@fault-point", "sink-0@fault-point", "sink-0@fault-point"]
    assert_exactly_once(report)
    assert report.statuses == {"ok": report.jobs}
    assert_multi_part_jobs_covered(report)
