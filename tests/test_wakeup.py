"""Wake-ups between co-located stages (streams/wakeup.py): the gate's waits under a fake
clock, and real Unix datagram sockets between a sender and a listener."""

import asyncio
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmpipe.client import Publisher, make_event
from mmpipe.schemas.settings import Settings
from mmpipe.supervisor import Pipeline
from mmpipe.streams import wakeup
from mmpipe.streams.wakeup import UNANNOUNCED_HOLD_S, FetchGate, WakeListener, WakeSender, listening_folder, reader_folders
from tests.conftest import make_settings
from tests.helpers import publish, wait_for_results


def test_after_records_or_nothing_a_fetch_waits_for_a_wake_up_or_the_fallback():
    gate = FetchGate(fallback_ms=200)
    assert gate.next_wait_ms == 0  # the first fetch goes at once
    gate.wake(0.0)
    gate.after_fetch(True, 20, 0.1)
    assert gate.next_wait_ms == 200  # records known to be left are the transport's to announce
    gate.fetch_at_once()
    assert gate.next_wait_ms == 0
    gate.after_fetch(False, 20, 0.2)
    assert gate.next_wait_ms == 200
    gate.after_fetch(False, 500, 5.0)  # an idle consumer's backed-off wait is longer still
    assert gate.next_wait_ms == 500


def test_records_without_any_wake_up_switch_to_polling_until_one_comes():
    async def run() -> None:
        gate = FetchGate(fallback_ms=1)
        gate.after_fetch(False, 20, now=99.9)
        await gate.wait()  # times out: nobody wakes it
        gate.after_fetch(True, 20, now=100.0)  # records, and never a wake-up
        assert gate.polling and gate.next_wait_ms == 0
        gate.after_fetch(False, 20, now=100.1)
        # Polling as without wake-ups: no wait at the gate, the broker holds the fetch.
        assert gate.next_wait_ms == 0 and gate.fetch_max_wait_ms(20) == 20
        gate.wake(100.2)
        assert not gate.polling
        gate.fallback_ms = 200
        gate.after_fetch(False, 20, now=100.3)
        assert gate.next_wait_ms == 200 and gate.fetch_max_wait_ms(500) == gate.hold_ms  # wake-ups again

    asyncio.run(run())


def test_a_wake_up_late_for_its_record_does_not_switch_to_polling():
    async def run() -> None:
        gate = FetchGate(fallback_ms=1)
        gate.after_fetch(False, 20, now=49.9)
        gate.wake(50.0)
        await gate.wait()  # returns at once (woken) and clears the wake-up
        await gate.wait()  # times out: the record's wake-up is still on its way
        gate.after_fetch(True, 20, now=50.0 + UNANNOUNCED_HOLD_S / 2)
        assert not gate.polling

    asyncio.run(run())


def test_a_wake_up_ends_the_fallback_wait_and_a_cancelled_wait_returns():
    async def run() -> None:
        gate = FetchGate(fallback_ms=60_000)
        gate.after_fetch(False, 20, 0.0)
        waiting = asyncio.ensure_future(gate.wait())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        gate.wake(0.1)
        assert await asyncio.wait_for(waiting, 5)  # far sooner than the minute-long fallback
        assert not gate.woken.is_set()  # cleared for the next fetch
        waiting = asyncio.ensure_future(gate.wait())
        await asyncio.sleep(0.01)
        waiting.cancel()
        assert await asyncio.wait_for(waiting, 5) is False  # no fetch; aiokafka awaits cancelled fetch tasks

    asyncio.run(run())


def test_a_sent_wake_up_reaches_the_listener_of_the_stage_reading_the_topic(tmp_path):
    folder = tmp_path / "wake" / "preprocess"

    async def run() -> None:
        gate = FetchGate(fallback_ms=60_000)
        listener = WakeListener(folder, gate)
        listener.start()
        sender = WakeSender({"mm.decoded": folder})
        try:
            sender.notify("mm.other")  # a topic nobody here listens to: nothing sent
            await asyncio.sleep(0.05)
            assert not gate.woken.is_set()
            sender.notify("mm.decoded")
            await asyncio.wait_for(gate.woken.wait(), 5)
            assert gate.last_wake_at > 0
        finally:
            listener.close()
            sender.close()
        assert not listener.path.exists()

    asyncio.run(run())


def test_a_wake_up_for_a_record_the_last_answer_reported_sends_no_fetch(tmp_path):
    """A datagram read while the fetch that brought its record was on its way: once that
    answer is in (the partition's known end past the record), it is no reason to fetch."""
    folder = tmp_path / "wake" / "inference"
    ends: dict[tuple[str, int], int] = {}

    async def run() -> None:
        gate = FetchGate(fallback_ms=60_000, known_end=lambda topic, partition: ends.get((topic, partition)))
        gate.after_fetch(False, 20, 0.0)
        listener = WakeListener(folder, gate)
        listener.start()
        sender = WakeSender({"mm.ready": folder})
        try:
            sender.notify("mm.ready", 2, 9)
            await asyncio.wait_for(gate.woken.wait(), 5)
            ends[("mm.ready", 2)] = 10  # then the answer that carried offset 9 came in
            waiting = asyncio.ensure_future(gate.wait())
            await asyncio.sleep(0.05)
            assert not waiting.done() and gate.last_wake_at > 0  # no news: still waiting
            sender.notify("mm.ready", 2, 10)  # past the known end: news
            assert await asyncio.wait_for(waiting, 5)
            waiting = asyncio.ensure_future(gate.wait())
            sender.notify("mm.ready", 3, 0)  # a partition with no answer yet: news
            assert await asyncio.wait_for(waiting, 5)
            waiting = asyncio.ensure_future(gate.wait())
            sender.notify("mm.ready")  # a wake-up naming no record: news
            assert await asyncio.wait_for(waiting, 5)
        finally:
            listener.close()
            sender.close()

    asyncio.run(run())


def test_wake_up_payloads_name_a_record_or_nothing():
    assert wakeup.parse_wake(wakeup.wake_payload("mm.ready", 3, 99)) == ("mm.ready", 3, 99)
    assert wakeup.parse_wake(b"") is None  # a wake-up naming no record
    assert wakeup.parse_wake(b"garbage") is None


def test_a_socket_left_by_a_killed_process_is_removed_and_a_missing_folder_is_no_error(tmp_path):
    folder = tmp_path / "inference"
    folder.mkdir()
    left = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    left.bind(str(folder / "12345"))
    left.close()  # what SIGKILL leaves: the file, nobody reading it
    sender = WakeSender({"mm.ready": folder, "mm.predictions": tmp_path / "absent"})
    sender.notify("mm.ready")
    sender.notify("mm.predictions")
    sender.close()
    assert not (folder / "12345").exists()


def test_every_stage_run_listens_and_socket_paths_stay_short(tmp_path):
    deep = tmp_path / ("x" * 150)
    settings = Settings(state_dir=deep, topic_prefix="mm", fetch_wakeups=True)
    folders = reader_folders(settings)
    assert set(folders) == {"mm.events", "mm.events.high", "mm.decoded", "mm.decoded.high", "mm.ready",
                            "mm.ready.high", "mm.predictions", "mm.dead-letter", "mm.status"}
    assert folders["mm.events"] == listening_folder(settings, "decode")  # told by the project's producers
    assert listening_folder(settings, "no-such-stage") is None
    socket_path = folders["mm.ready"] / str(2 ** 22)  # the largest pid
    assert len(os.fsencode(socket_path)) < 108  # sun_path's limit
    assert reader_folders(settings.model_copy(update={"fetch_wakeups": False})) == {}
    other = settings.model_copy(update={"topic_prefix": "mm2"})
    assert wakeup.listening_folder(other, "sink") != listening_folder(settings, "sink")  # one folder per pipeline


@pytest.mark.parametrize("stage", ["decode", "preprocess", "inference", "sink"])
def test_listening_folders_are_per_stage(stage):
    settings = Settings(state_dir=Path("/tmp/state"))
    folder = listening_folder(settings, stage)
    assert folder is not None and folder.name == stage


class FakeFetcher:
    """What adapt_fetch_wait touches on aiokafka's fetcher: the wait, the fetch call and the
    records it buffered."""

    def __init__(self, answers: list[bool]) -> None:
        self._fetch_max_wait_ms = 1
        self._records: dict = {}
        self.answers = answers
        self.fetched = 0

    async def _proc_fetch_request(self, assignment, node_id, request) -> bool:
        self.fetched += 1
        return self.answers.pop(0)


NO_PARTITIONS = SimpleNamespace(topics=[])


def test_the_transport_holds_each_fetch_at_the_gate_and_sends_none_when_cancelled():
    from mmpipe.streams.fetch_wait import AdaptiveFetchWait
    from mmpipe.streams.transport import adapt_fetch_wait

    async def run() -> None:
        fetcher = FakeFetcher([True, False])
        gate = FetchGate(fallback_ms=60_000)
        adapt_fetch_wait(fetcher, AdaptiveFetchWait(20, 500, 1.0), gate)
        assert await fetcher._proc_fetch_request(None, 0, NO_PARTITIONS)  # the first fetch goes at once
        gate.wake(0.0)  # after records too, the next fetch waits for a wake-up
        assert not await asyncio.wait_for(fetcher._proc_fetch_request(None, 0, NO_PARTITIONS), 5)
        assert fetcher.fetched == 2 and gate.next_wait_ms == 60_000
        held = asyncio.ensure_future(fetcher._proc_fetch_request(None, 0, NO_PARTITIONS))
        await asyncio.sleep(0.05)
        assert fetcher.fetched == 2  # held: nothing woke it
        held.cancel()
        assert await asyncio.wait_for(held, 5) is False
        assert fetcher.fetched == 2  # a cancelled wait sends no fetch
        assert fetcher._fetch_max_wait_ms == gate.hold_ms  # gated fetches: a short hold, not the idle wait

    asyncio.run(run())


@pytest.mark.timeout(300)
def test_a_stage_whose_producer_sends_no_wake_ups_polls_and_loses_nothing(broker, tmp_path, media_dir):
    """Decode sends no wake-ups (as on another machine) while preprocess waits for them with a
    3 s fallback: preprocess notices records nobody announced and polls, so jobs after the
    first do not wait out the fallback, and every job comes back."""
    fallback_ms = 3000
    settings = make_settings(broker.bootstrap, tmp_path, media_dir, fetch_wake_fallback_ms=fallback_ms)
    pipeline = Pipeline(settings, workdir=tmp_path, embedded_broker=False,
                        replica_overrides={("decode", 0): {"fetch_wakeups": False}}).start()
    try:
        job_ids = []
        for i in range(8):  # one at a time: each would meet a consumer waiting out its fallback
            job_ids += publish(settings, [make_event("text", text=f"Sentence number {i} for the embedding model.")])
            time.sleep(0.4)
        results = wait_for_results(settings, job_ids)
    finally:
        pipeline.stop()
    assert all(result.status == "ok" for result in results.values())
    later = sorted(results[job_id].timings.queue_preprocess_ms for job_id in job_ids[4:])
    assert later[-1] < fallback_ms / 2, later  # polled, not held until the fallback
    assert "records arrive without wake-ups: polling" in (tmp_path / "preprocess-0.log").read_text()


@pytest.mark.timeout(120)
def test_the_publisher_wakes_the_decode_stage_once_the_broker_has_its_event(broker, tmp_path, media_dir):
    """The project's producer of events announces them, as a stage does its records, so decode
    fetches on wake-ups instead of polling; the wake-up follows the broker's acknowledgement."""
    settings = make_settings(broker.bootstrap, tmp_path, media_dir, fetch_wakeups=True)

    async def run() -> None:
        gate = FetchGate(fallback_ms=60_000)
        listener = WakeListener(listening_folder(settings, "decode"), gate)
        listener.start()
        try:
            async with Publisher(settings) as publisher:
                await publisher.publish(make_event("text", text="one"))
                await asyncio.wait_for(gate.woken.wait(), 5)
                gate.woken.clear()
                gate._announced.clear()
                await publisher.publish_many([make_event("text", text="two", priority=0),
                                              make_event("text", text="three")])
                await asyncio.wait_for(gate.woken.wait(), 5)  # both lanes are decode's
                await asyncio.sleep(0.05)
                # Each wake-up names its partition's last record, so decode can tell news.
                events = publisher.topics.events
                assert {topic for topic, _ in gate._announced} == {events, f"{events}.high"}
        finally:
            listener.close()
        quiet = Publisher(settings.model_copy(update={"fetch_wakeups": False}))
        assert quiet._wakes is None  # wake-ups off (Apache Kafka): nothing is sent

    asyncio.run(run())
