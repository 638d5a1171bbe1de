"""The ResultStore contract (mmpipe/store/base.py), run against both backends: SQLite in a temp
dir and a real PostgreSQL server on loopback (tests/pg.py)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmpipe.stages.sink.store import Final, ResultStore, StoreUnavailable, open_store
from mmpipe.stages.sink.store.group import GroupCommit
from mmpipe.stages.sink.store.postgres import POOL_MAX_SIZE, PostgresStore
from mmpipe.stages.sink.store.sqlite import SqliteStore
from mmpipe.schemas import DeadLetter, JobResult, ModelRef, Prediction
from mmpipe.stages.sink.stage import assemble, failed_result
from tests import pg
from mmpipe.streams.broker import free_port
from tests.pg import PostgresServer

pytestmark = pytest.mark.timeout(120)

RESNET_V1 = ModelRef("resnet18", "1")
RESNET_V2 = ModelRef("resnet18", "2")
VAD = ModelRef("silero-vad", "6")
T0 = 1_700_000_000.0


# Fixtures -----------------------------------------------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'results.db'}"
    return request.getfixturevalue("fresh_postgres_url")


@pytest.fixture
def open_fresh(store_url: str) -> Iterator[Callable[[], ResultStore]]:
    """Opens stores on the test's database (each one is what a separate sink would hold)."""
    opened: list[ResultStore] = []

    def open_one() -> ResultStore:
        store = open_store(store_url)
        opened.append(store)
        store.init_schema()
        return store

    yield open_one
    for store in opened:
        store.close()


@pytest.fixture
def store(open_fresh: Callable[[], ResultStore]) -> ResultStore:
    return open_fresh()


# Builders ------------------------------------------------------------------------------------
def new_job_id() -> str:
    return f"job-{uuid.uuid4().hex[:12]}"


def frame(job_id: str, part: int, parts: int, model: ModelRef = RESNET_V1, label: str | None = None) -> Prediction:
    """One frame of a video job, as the inference stage answers it."""
    return Prediction(
        job_id=job_id, part=part, parts=parts, kind="image", modality="video", model=model, status="ok",
        created_at=T0, trace={"sink_in": T0 + 1 + part}, output={"label": label or f"class-{part}", "score": 0.5},
        meta={"frame": part, "t_s": part * 0.5, "batch_size": 4},
    )


def image(job_id: str, model: ModelRef = RESNET_V1) -> Prediction:
    return Prediction(
        job_id=job_id, part=0, parts=1, kind="image", modality="image", model=model, status="ok",
        created_at=T0, trace={"sink_in": T0 + 1}, output={"label": "tabby", "score": 0.9},
    )


def speech_window(job_id: str, part: int, parts: int) -> Prediction:
    """One 1-second VAD window of an audio job, with speech across the window boundary."""
    return Prediction(
        job_id=job_id, part=part, parts=parts, kind="audio", modality="audio", model=VAD, status="ok",
        created_at=T0, trace={"sink_in": T0 + 1 + part},
        output={"segments": [{"start_s": 0.2, "end_s": 1.0}], "duration_s": 1.0}, meta={"offset_s": float(part)},
    )


def expired_part(job_id: str, part: int, parts: int) -> Prediction:
    return Prediction(
        job_id=job_id, part=part, parts=parts, kind="image", modality="video", model=RESNET_V1, status="expired",
        created_at=T0, trace={}, error="deadline passed before inference",
    )


def dead_letter(job_id: str, offset: int = 7, reason: str = "undecodable_media") -> DeadLetter:
    return DeadLetter(
        job_id=job_id, stage="decode", reason=reason, detail="no video stream", source_topic="t.events",
        source_partition=1, source_offset=offset, failed_at=T0 + 2, created_at=T0, modality="video",
    )


def same_content(a: JobResult, b: JobResult) -> bool:
    """Equal apart from when it was assembled (completed_at and the timings derived from it)."""
    fields = ("job_id", "status", "modality", "model", "prediction", "created_at", "error", "weights", "parts")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def store_all(store: ResultStore, parts: list[Prediction]) -> list[Final | None]:
    return [store.record_part(p, assemble) for p in parts]


# Jobs ----------------------------------------------------------------------------------------
def test_accept_job_is_idempotent(store: ResultStore) -> None:
    job_id = new_job_id()
    assert store.accept_job(job_id, "video", "resnet18:1", T0) is True
    assert store.accept_job(job_id, "audio", "other:9", T0 + 5) is False
    store.mark_accepted(job_id, T0 + 1)
    job = store.get_job(job_id)
    assert (job.state, job.modality, job.model, job.created_at) == ("accepted", "video", "resnet18:1", T0)
    assert job.state_times == {"accepted": T0 + 1}
    assert store.counts()["jobs"] == 1


def test_a_job_whose_publish_failed_stays_unpublished_until_marked(store: ResultStore) -> None:
    """Recorded but never published: the store remembers it (the API republishes on a resubmit,
    after a restart too); the accepted time is the publish's, stamped once; a job the pipeline
    has reached is never unpublished, even if the stamp was lost."""
    job_id, reached = new_job_id(), new_job_id()
    store.accept_job(job_id, "image", "resnet18:1", T0)
    store.accept_job(reached, "image", "resnet18:1", T0)
    assert store.is_unpublished(job_id) and store.get_job(job_id).state_times == {}
    store.mark_accepted(job_id, T0 + 1)
    store.mark_accepted(job_id, T0 + 9)
    assert not store.is_unpublished(job_id) and store.get_job(job_id).state_times == {"accepted": T0 + 1}
    store.record_status(reached, "decoding", T0 + 2)
    assert not store.is_unpublished(reached)
    assert not store.is_unpublished(new_job_id())  # unknown


def test_status_only_moves_forward(store: ResultStore) -> None:
    job_id = new_job_id()
    store.accept_job(job_id, "video", None, T0)
    store.record_status(job_id, "preprocessing", T0 + 2)
    store.record_status(job_id, "inferring", T0 + 3)
    store.record_status(job_id, "preprocessing", T0 + 9)  # redelivered: keeps its first time
    assert store.get_job(job_id).state == "inferring"
    assert store.get_job(job_id).state_times["preprocessing"] == T0 + 2

    parts = [frame(job_id, 0, 1)]
    final = store.record_part(parts[0], assemble)
    job = store.get_job(job_id)
    assert job.state == "done"
    assert job.state_times["finished"] == final.result.completed_at
    assert "decoding" not in job.state_times

    store.record_status(job_id, "decoding", T0 + 1)  # late: fills its time, state stays done
    store.record_status(job_id, "inferring", T0 + 8)
    job = store.get_job(job_id)
    assert job.state == "done"
    assert job.state_times["decoding"] == T0 + 1
    assert job.state_times["inferring"] == T0 + 3
    assert job.updated_at == final.result.completed_at


def test_a_stored_part_the_model_ran_stamps_inferring(store: ResultStore) -> None:
    """The inference stage sends no status record: the sink stamps "inferring" from a stored
    part's batch_end, moving the state while parts are missing and filling only the time when
    the part completes the job."""
    job_id = new_job_id()
    store.accept_job(job_id, "video", None, T0)
    store.record_status(job_id, "preprocessing", T0 + 1)
    first = frame(job_id, 1, 2)
    first.trace["batch_end"] = T0 + 2
    assert store.record_part(first, assemble) is None
    job = store.get_job(job_id)
    assert (job.state, job.state_times["inferring"]) == ("inferring", T0 + 2)

    last = frame(job_id, 0, 2)
    last.trace["batch_end"] = T0 + 1.5  # ran earlier, arrived later: the first stamp stays
    assert store.record_part(last, assemble).created
    job = store.get_job(job_id)
    assert (job.state, job.state_times["inferring"]) == ("done", T0 + 2)

    alone = new_job_id()
    single = image(alone)
    single.trace["batch_end"] = T0 + 3
    store.record_part(single, assemble)
    job = store.get_job(alone)
    assert (job.state, job.state_times["inferring"]) == ("done", T0 + 3)
    assert job.state_times["inferring"] <= job.state_times["finished"]

    unrun = new_job_id()  # a part answered without the model (failed in preprocess): no stamp
    store.record_part(image(unrun), assemble)
    assert "inferring" not in store.get_job(unrun).state_times


def test_a_finished_job_has_every_state_time_from_its_traces_when_reports_were_lost(store: ResultStore) -> None:
    """Status reports are a live view sent off the ack path (streams/status.py): when they are
    lost, storing the result fills each state's time from the earliest trace among the parts;
    a report that did arrive keeps its time."""
    job_id = new_job_id()
    store.accept_job(job_id, "video", None, T0)
    store.record_status(job_id, "preprocessing", T0 + 1.5)  # this one report arrived
    parts = [frame(job_id, part, 2) for part in range(2)]
    for part, (decode_in, preprocess_in, batch_end) in zip(parts, [(T0 + 0.2, T0 + 1.2, T0 + 2.5), (T0 + 0.2, T0 + 1.1, T0 + 2.1)]):
        part.trace.update(decode_in=decode_in, preprocess_in=preprocess_in, batch_end=batch_end)
    assert store.record_part(parts[0], assemble) is None
    final = store.record_part(parts[1], assemble)
    job = store.get_job(job_id)
    assert job.state == "done"
    assert job.state_times == {
        "decoding": T0 + 0.2, "preprocessing": T0 + 1.5, "inferring": T0 + 2.5, "finished": final.result.completed_at,
    }

    expired = new_job_id()  # decoded, then expired before preprocess: no reports, no model run
    late = expired_part(expired, 0, 1)
    late.trace.update(decode_in=T0 + 0.3)
    store.record_part(late, assemble)
    job = store.get_job(expired)
    assert (job.state, set(job.state_times)) == ("expired", {"decoding", "finished"})
    assert job.state_times["decoding"] == T0 + 0.3


def test_status_of_a_job_never_accepted_here_creates_it(store: ResultStore) -> None:
    job_id = new_job_id()
    store.record_status(job_id, "decoding", T0 + 1)
    job = store.get_job(job_id)
    assert (job.state, job.state_times) == ("decoding", {"decoding": T0 + 1})
    assert store.accept_job(job_id, "image", None, T0) is False  # the job is known now


# Parts and results ---------------------------------------------------------------------------
def test_parts_first_write_wins(store: ResultStore) -> None:
    job_id = new_job_id()
    assert store.record_part(frame(job_id, 0, 2, label="first"), assemble) is None
    assert store.record_part(frame(job_id, 0, 2, label="second"), assemble) is None
    assert store.counts()["parts"] == 1

    final = store.record_part(frame(job_id, 1, 2), assemble)
    assert final.created
    assert [f["label"] for f in final.result.prediction["frames"]] == ["first", "class-1"]
    assert store.conflicts() == []  # same model: a plain redelivery, not a conflict


def test_result_is_assembled_once_when_the_last_part_arrives(store: ResultStore) -> None:
    job_id = new_job_id()
    parts = [frame(job_id, i, 3) for i in range(3)]
    assert store_all(store, [parts[2], parts[0]]) == [None, None]
    assert store.get_result(job_id) is None
    assert store.counts()["results"] == 0

    final = store.record_part(parts[1], assemble)
    assert (final.created, final.published) == (True, False)
    assert same_content(final.result, assemble(parts))
    assert [f["frame"] for f in final.result.prediction["frames"]] == [0, 1, 2]
    assert store.get_result(job_id) == final.result
    assert store.get_job(job_id).state == "done"
    assert store.counts()["results"] == 1
    assert list(store.iter_results()) == [final.result]


def test_audio_windows_are_merged_into_one_timeline(store: ResultStore) -> None:
    job_id = new_job_id()
    final = store_all(store, [speech_window(job_id, i, 3) for i in (1, 2, 0)])[-1]
    assert final.result.prediction == {
        "segments": [{"start_s": 0.2, "end_s": 1.0}, {"start_s": 1.2, "end_s": 2.0}, {"start_s": 2.2, "end_s": 3.0}],
        "duration_s": 3.0,
        "speech_s": 2.4,
    }


def test_an_expired_part_decides_the_job_at_once(store: ResultStore) -> None:
    job_id = new_job_id()
    assert store.record_part(frame(job_id, 0, 3), assemble) is None
    final = store.record_part(expired_part(job_id, 1, 3), assemble)
    assert (final.created, final.result.status) == (True, "expired")
    assert final.result.error["code"] == "deadline_exceeded"
    assert store.get_job(job_id).state == "expired"
    late = store.record_part(frame(job_id, 2, 3), assemble)
    assert (late.created, late.result) == (False, final.result)


def test_redelivered_part_after_finalisation_returns_the_stored_result(store: ResultStore) -> None:
    job_id = new_job_id()
    parts = [frame(job_id, i, 2) for i in range(2)]
    first = store_all(store, parts)[-1]
    before = store.counts()

    again = store.record_part(parts[1], assemble)
    assert (again.created, again.published) == (False, False)
    assert again.result == first.result  # the stored row itself, not a re-assembly
    store.mark_published(job_id)
    assert store.record_part(parts[0], assemble) == Final(first.result, created=False, published=True)
    assert store.counts() == before
    assert store.conflicts() == []


def test_mark_published(store: ResultStore) -> None:
    job_id = new_job_id()
    final = store.record_part(image(job_id), assemble)
    assert final.published is False
    store.mark_published(job_id)
    store.mark_published(job_id)  # a second confirmation changes nothing
    assert store.record_part(image(job_id), assemble).published is True
    store.mark_published(new_job_id())  # no result yet: nothing to mark, no error
    assert store.counts()["results"] == 1


def test_part_from_another_model_version_after_the_result_is_a_conflict(store: ResultStore) -> None:
    job_id = new_job_id()
    first = store.record_part(image(job_id, RESNET_V1), assemble)
    other = store.record_part(image(job_id, RESNET_V2), assemble)
    assert (other.created, other.result) == (False, first.result)
    assert store.get_result(job_id).model == RESNET_V1
    [conflict] = store.conflicts()
    assert (conflict["job_id"], conflict["kind"]) == (job_id, "part_model")
    assert (conflict["existing"], conflict["incoming"]) == ("resnet18:1", "resnet18:2")
    assert store.counts()["results"] == 1


def test_part_from_another_model_version_before_the_result_is_a_conflict(store: ResultStore) -> None:
    job_id = new_job_id()
    store.record_part(frame(job_id, 0, 2, RESNET_V1, label="v1"), assemble)
    assert store.record_part(frame(job_id, 0, 2, RESNET_V2, label="v2"), assemble) is None
    [conflict] = store.conflicts()
    assert (conflict["kind"], conflict["existing"], conflict["incoming"]) == ("part_0_model", "resnet18:1", "resnet18:2")
    final = store.record_part(frame(job_id, 1, 2, RESNET_V1), assemble)
    assert final.result.prediction["frames"][0]["label"] == "v1"
    assert store.counts()["parts"] == 2


def test_differing_result_for_a_finished_job_is_a_conflict(store: ResultStore) -> None:
    job_id = new_job_id()
    done = store.record_part(image(job_id), assemble)
    failed = store.record_result(failed_result(dead_letter(job_id), T0 + 3))
    assert (failed.created, failed.result) == (False, done.result)
    [conflict] = store.conflicts()
    assert (conflict["kind"], conflict["existing"], conflict["incoming"]) == ("result", "ok resnet18:1", "error None")
    assert store.counts()["results"] == 1
    assert store.get_job(job_id).state == "done"


# Dead letters --------------------------------------------------------------------------------
def test_record_result_for_a_dead_lettered_job(store: ResultStore) -> None:
    job_id = new_job_id()
    store.accept_job(job_id, "video", None, T0)
    final = store.record_result(failed_result(dead_letter(job_id), T0 + 3))
    assert (final.created, final.result.status, final.result.error["code"]) == (True, "error", "undecodable_media")
    assert store.get_job(job_id).state == "failed"

    again = store.record_result(failed_result(dead_letter(job_id), T0 + 4))  # redelivered letter
    assert (again.created, again.result) == (False, final.result)
    assert store.conflicts() == []
    late_part = store.record_part(frame(job_id, 0, 1), assemble)  # cannot replace the failure
    assert (late_part.created, late_part.result.status) == (False, "error")
    assert store.counts()["results"] == 1


def test_rejected_job_ends_rejected(store: ResultStore) -> None:
    """Admission control answers a job with one "rejected" part; it decides the job at once."""
    job_id = new_job_id()
    rejected = msgspec.structs.replace(expired_part(job_id, 0, 1), status="rejected", error="overloaded")
    final = store.record_part(rejected, assemble)
    assert final.created and final.result.status == "rejected"
    assert final.result.error["code"] == "overloaded"
    assert store.get_job(job_id).state == "rejected"


def test_group_commit_stores_all_and_isolates_a_failing_call(store: ResultStore) -> None:
    jobs = [new_job_id() for _ in range(3)]

    def broken() -> None:
        raise ValueError("a bug in one call")

    outcomes = store.run_group([
        (store.record_part, (image(jobs[0]), assemble)),
        (broken, ()),
        (store.record_part, (image(jobs[1]), assemble)),
        (store.accept_job, (jobs[2], "text", None, T0)),
    ])
    assert outcomes[0].created and outcomes[2].created and outcomes[3] is True
    assert isinstance(outcomes[1], ValueError)
    assert store.get_result(jobs[0]) is not None and store.get_result(jobs[1]) is not None
    assert store.get_job(jobs[2]).state == "accepted"
    # The same parts again in a group: stored results come back, nothing is added.
    again = store.run_group([(store.record_part, (image(j), assemble)) for j in jobs[:2]])
    assert [o.created for o in again] == [False, False]
    assert store.counts()["results"] == 2


def test_concurrent_writers_share_transactions_and_each_hears_its_own_outcome(store: ResultStore) -> None:
    """GroupCommit (the sink's and the job API's): calls queued while a transaction runs share
    the next one; each caller gets its own call's outcome, a failing call fails only itself,
    and a group the store refuses reaches every caller instead of leaving one waiting."""
    runs: list[int] = []
    real_run_group = store.run_group

    def counted(calls: list) -> list:
        runs.append(len(calls))
        return real_run_group(calls)

    store.run_group = counted  # type: ignore[method-assign]
    jobs = [new_job_id() for _ in range(12)]

    def broken() -> None:
        raise ValueError("a bug in one call")

    async def scenario() -> tuple[list, list]:
        with ThreadPoolExecutor(1) as thread:
            group = GroupCommit(store, thread)
            first = await asyncio.gather(*(group.outcome(store.accept_job, j, "text", None, T0) for j in jobs),
                                         group.outcome(broken), group.outcome(store.accept_job, jobs[0], "text", None, T0))
            store.run_group = lambda calls: (_ for _ in ()).throw(StoreUnavailable("down"))  # type: ignore[method-assign]
            refused = await asyncio.wait_for(asyncio.gather(*(group.outcome(store.mark_accepted, j, T0) for j in jobs[:3])), 10)
        return first, refused

    first, refused = asyncio.run(scenario())
    assert first[:12] == [True] * 12 and first[13] is False  # the 14th call found the 1st's row
    assert isinstance(first[12], ValueError)
    assert sum(runs) == 14 and len(runs) < 14  # calls that queued together shared a transaction
    assert all(isinstance(o, StoreUnavailable) for o in refused)
    assert all(store.get_job(j).state == "accepted" for j in jobs)


def test_dead_letters_are_idempotent_per_source_message(store: ResultStore) -> None:
    job_id = new_job_id()
    assert store.record_dead_letter(dead_letter(job_id, offset=7)) is True
    assert store.record_dead_letter(dead_letter(job_id, offset=7)) is False
    assert store.record_dead_letter(dead_letter(job_id, offset=8)) is True
    assert store.record_dead_letter(dead_letter(f"unknown:t.events:1:{2**40}", offset=2**40)) is True  # BIGINT offset
    assert len(store.dead_letters(job_id)) == 2
    assert store.counts()["dead_letters"] == 3


# Concurrency: several sinks on one database ------------------------------------------------------
def run_together(actions: list[Callable[[], Any]]) -> list[Any]:
    """Run the actions in separate threads, released at the same instant."""
    barrier = threading.Barrier(len(actions))

    def go(action: Callable[[], Any]) -> Any:
        barrier.wait()
        return action()

    with ThreadPoolExecutor(len(actions)) as pool:
        return [f.result() for f in [pool.submit(go, a) for a in actions]]


def test_sinks_racing_on_the_last_parts_make_exactly_one_result(open_fresh: Callable[[], ResultStore]) -> None:
    sinks = [open_fresh(), open_fresh()]
    jobs = [new_job_id() for _ in range(25)]
    for job_id in jobs:
        parts = [frame(job_id, i, 3) for i in range(3)]
        sinks[0].record_part(parts[0], assemble)
        # Each sink stores one of the two missing parts: whichever commits second must see both.
        finals = run_together([lambda s=s, p=p: s.record_part(p, assemble) for s, p in zip(sinks, parts[1:])])
        created = [f for f in finals if f is not None and f.created]
        assert len(created) == 1, f"{job_id}: {finals}"
        assert sinks[1].get_result(job_id) == created[0].result
    assert sinks[0].counts()["results"] == len(jobs)


def test_sinks_racing_on_redelivered_parts_agree_on_one_result(open_fresh: Callable[[], ResultStore]) -> None:
    sinks = [open_fresh(), open_fresh(), open_fresh()]
    job_id = new_job_id()
    parts = [frame(job_id, i, 4) for i in range(4)]
    # Every sink gets every part (a rebalance redelivered them all), in its own order.
    orders = [parts, parts[::-1], parts[1:] + parts[:1]]
    finals = run_together([lambda s=s, o=o: store_all(s, o) for s, o in zip(sinks, orders)])
    created = [f for per_sink in finals for f in per_sink if f is not None and f.created]
    assert len(created) == 1
    assert all(f.result == created[0].result for per_sink in finals for f in per_sink if f is not None)
    assert sinks[0].counts()["results"] == 1
    assert sinks[0].counts()["parts"] == 4


def test_racing_status_updates_never_move_a_job_back(open_fresh: Callable[[], ResultStore]) -> None:
    sinks = [open_fresh(), open_fresh()]
    jobs = [new_job_id() for _ in range(25)]
    for job_id in jobs:
        sinks[0].accept_job(job_id, "image", None, T0)
        run_together([
            lambda j=job_id: sinks[0].record_status(j, "done", T0 + 5),
            lambda j=job_id: sinks[1].record_status(j, "decoding", T0 + 1),
        ])
        job = sinks[0].get_job(job_id)
        assert job.state == "done", job
        assert job.state_times["decoding"] == T0 + 1


def test_init_schema_from_many_sinks_at_once(store_url: str) -> None:
    # 12 at once: on a fresh SQLite file, switching to WAL answered BUSY without waiting in about
    # one round in 150 at this count (and once in CI at 4).
    stores = [open_store(store_url) for _ in range(12)]
    try:
        run_together([s.init_schema for s in stores])
        assert stores[0].counts() == dict.fromkeys(("jobs", "parts", "results", "conflicts", "dead_letters"), 0)
    finally:
        for s in stores:
            s.close()


# Any order, any duplication: one result -------------------------------------------------------
deliveries = st.integers(min_value=1, max_value=5).flatmap(
    lambda parts: st.tuples(
        st.just(parts),
        st.lists(st.integers(0, parts - 1), max_size=6).flatmap(
            # every part at least once, plus redeliveries, in any order
            lambda extra: st.permutations(list(range(parts)) + extra)
        ),
    )
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(delivery=deliveries, kind=st.sampled_from(["video", "audio"]))
def test_any_delivery_order_gives_the_in_order_result_once(store: ResultStore, delivery, kind: str) -> None:
    parts_count, order = delivery
    job_id = new_job_id()  # the store outlives the examples: each one gets its own job
    build = frame if kind == "video" else speech_window
    parts = [build(job_id, i, parts_count) for i in range(parts_count)]

    finals = store_all(store, [parts[i] for i in order])

    last_new_part = max(order.index(i) for i in range(parts_count))
    assert all(f is None for f in finals[:last_new_part])
    assert finals[last_new_part].created
    assert all(not f.created and f.result == finals[last_new_part].result for f in finals[last_new_part + 1 :])
    assert same_content(store.get_result(job_id), assemble(parts))


def test_a_job_id_reused_for_another_payload_is_refused_and_recorded_never_merged(store: ResultStore) -> None:
    job_id = new_job_id()

    def part(index: int, digest: str) -> Prediction:
        p = frame(job_id, index, 2)
        return msgspec.structs.replace(p, meta={**p.meta, "payload_digest": digest})

    assert store.record_part(part(0, "video-a"), assemble) is None
    refused = store.record_part(part(1, "video-b"), assemble)  # the other video's second frame
    assert refused.reason == "job_id_conflict" and "video-a" in refused.detail
    assert store.counts()["parts"] == 1 and store.get_result(job_id) is None  # not merged
    assert [(c["kind"], c["existing"], c["incoming"]) for c in store.conflicts()] == [("job_id_conflict", "video-a", "video-b")]
    final = store.record_part(part(1, "video-a"), assemble)  # the first video's own frame completes it
    assert final.created and final.result.parts == 2


def test_an_expired_answer_of_another_job_with_the_same_id_is_refused_not_taken(store: ResultStore) -> None:
    """Answers without work carry their job's payload digest (streams/stage.py), so another
    job that reuses the ID cannot decide this one as expired; this job's own can."""
    job_id = new_job_id()

    def with_digest(p: Prediction, digest: str) -> Prediction:
        return msgspec.structs.replace(p, meta={**p.meta, "payload_digest": digest})

    assert store.record_part(with_digest(frame(job_id, 0, 2), "video-a"), assemble) is None
    refused = store.record_part(with_digest(expired_part(job_id, 0, 1), "image-b"), assemble)
    assert refused.reason == "job_id_conflict" and store.get_result(job_id) is None
    final = store.record_part(with_digest(expired_part(job_id, 1, 2), "video-a"), assemble)
    assert final.created and final.result.status == "expired"


def test_a_video_with_one_bad_frame_completes_with_that_frames_error(store: ResultStore) -> None:
    job_id = new_job_id()
    bad = msgspec.structs.replace(frame(job_id, 1, 3), status="error", output=None, error="bad_input: pixels: not finite")
    final = store_all(store, [frame(job_id, 0, 3), bad, frame(job_id, 2, 3)])[-1]
    assert final.result.status == "ok"
    frames = final.result.prediction["frames"]
    assert [f.get("label") for f in frames] == ["class-0", None, "class-2"]
    assert frames[1] == {"frame": 1, "t_s": 0.5, "error": "bad_input: pixels: not finite"}


def test_a_job_whose_every_part_failed_is_an_error_with_the_first_reason(store: ResultStore) -> None:
    job_id = new_job_id()
    parts = [msgspec.structs.replace(frame(job_id, i, 2), status="error", output=None, error="model_error: boom")
             for i in range(2)]
    final = store_all(store, parts)[-1]
    assert final.result.status == "error" and final.result.error == {"code": "model_error", "message": "boom"}


# Backends, outages, connections ------------------------------------------------------------
def test_open_store_routes_by_url(tmp_path, postgres_url: str) -> None:
    assert isinstance(open_store(f"sqlite:///{tmp_path / 'r.db'}"), SqliteStore)
    assert isinstance(open_store(postgres_url), PostgresStore)
    assert isinstance(open_store(postgres_url.replace("postgresql://", "postgres://", 1)), PostgresStore)
    with pytest.raises(ValueError):
        open_store("mysql://localhost/db")


def test_postgres_fixture_fails_without_binaries_where_postgres_is_expected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pg, "find_pg_bin", lambda: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt package `postgresql`"):
        pg.start_server()
    monkeypatch.delenv("CI")
    monkeypatch.setattr(pg, "postgres_expected", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="apt package `postgresql`"):
        pg.start_server()


def test_postgres_unreachable_is_store_unavailable() -> None:
    store = open_store(f"postgresql://postgres@127.0.0.1:{free_port()}/mmpipe")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.init_schema()
    with pytest.raises(StoreUnavailable):
        store.record_part(image(new_job_id()), assemble)
    assert time.monotonic() - started < 10
    store.close()


def test_postgres_outage_and_recovery(own_postgres_server: PostgresServer) -> None:
    server = own_postgres_server
    store = open_store(server.create_database("results"))
    store.init_schema()
    before = new_job_id()
    store.record_part(frame(before, 0, 2), assemble)

    server.stop()
    with pytest.raises(StoreUnavailable):
        store.record_part(frame(before, 1, 2), assemble)
    with pytest.raises(StoreUnavailable):  # still down: each call tries again and says so
        store.accept_job(new_job_id(), "image", None, T0)

    server.start(server.port)
    final = store.record_part(frame(before, 1, 2), assemble)  # the retried message
    assert final.created
    assert store.counts()["results"] == 1
    store.close()


def test_postgres_terminated_connection_is_replaced_by_the_pool(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database()
    store = open_store(url)
    store.init_schema()
    job_id = new_job_id()
    store.accept_job(job_id, "image", None, T0)

    database = url.rsplit("/", 1)[1]
    assert postgres_server.terminate_connections(database) == 1
    wait_until(lambda: postgres_server.connections(database) == 0)
    store.record_status(job_id, "decoding", T0 + 1)  # the pool checked the dead one and connected anew
    assert store.get_job(job_id).state == "decoding"

    store.close()
    wait_until(lambda: postgres_server.connections(database) == 0)  # close() released the connection


def test_connections_stay_within_the_pool_and_close_releases_them(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database()
    store = open_store(url)
    store.init_schema()
    database = url.rsplit("/", 1)[1]
    with ThreadPoolExecutor(8) as pool:
        barrier = threading.Barrier(8)  # eight callers at once: more than the pool holds
        list(pool.map(lambda _: (barrier.wait(), store.counts()), range(8)))
    assert 1 <= postgres_server.connections(database) <= POOL_MAX_SIZE
    store.close()
    wait_until(lambda: postgres_server.connections(database) == 0)


def test_sqlite_locked_is_store_unavailable_then_recovers(tmp_path) -> None:
    path = tmp_path / "results.db"
    store = SqliteStore(f"sqlite:///{path}", busy_timeout_s=0.1)
    store.init_schema()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the database
    try:
        with pytest.raises(StoreUnavailable):
            store.record_part(image(new_job_id()), assemble)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.record_part(image(new_job_id()), assemble).created
    store.close()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_callers_on_threads_that_come_and_go_share_one_connection(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database()
    store = open_store(url)
    store.init_schema()
    for _ in range(20):  # callers that come and go, each on a thread of its own
        worker = threading.Thread(target=store.counts)
        worker.start()
        worker.join()
    database = url.rsplit("/", 1)[1]
    assert postgres_server.connections(database) == 1  # reused from the pool, not one per thread
    store.close()


def test_postgres_over_the_unix_socket(postgres_server: PostgresServer) -> None:
    database = postgres_server.create_database().rsplit("/", 1)[1]
    store = open_store(f"postgresql://postgres@/{database}?host={postgres_server.socket_dir}&port={postgres_server.port}")
    store.init_schema()
    assert store.accept_job(new_job_id(), "text", None, T0)
    store.close()


def test_a_failed_statement_leaves_the_store_usable(store: ResultStore) -> None:
    with pytest.raises(Exception) as failure:  # noqa: B017 - each backend raises its own error type
        with store._transaction(lock_key="job-x") as cur:
            cur.execute("SELECT no_such_column FROM jobs")
    # A bug, not an outage: the sink must not retry it forever.
    assert not isinstance(failure.value, StoreUnavailable)
    assert store.accept_job(new_job_id(), "text", None, T0)  # no aborted transaction left behind
