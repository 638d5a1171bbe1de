"""Status reports (streams/status.py): coalesced per flush window, sent off the ack path, a
failed send counted and never retried, and the sink writing every entry of a record (and
refusing, with a reason, a message holding a value PostgreSQL will not store)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from mmpipe.schemas import DeadLetter, Refused, decode_status, to_json
from mmpipe.schemas.settings import Settings
from mmpipe.stages.sink.stage import SinkStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Incoming
from mmpipe.streams.status import StatusReporter

TOPIC = "mm.status"


class FakeBroker:
    """Records each published record; an ack future per send, failed while `down`."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []
        self.down = False

    async def publish(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[Any]:
        ack = asyncio.get_running_loop().create_future()
        if self.down:
            ack.set_exception(ConnectionError("broker unreachable"))
        else:
            self.records.append((topic, key, value))
            ack.set_result(None)
        return ack

    def entries(self) -> list[tuple[str, str]]:
        return [(e.job_id, e.state) for _, _, value in self.records for e in decode_status(value).entries]


def reporter(broker: FakeBroker, dropped: list[int], flush_s: float = 0.05, max_entries: int = 256) -> StatusReporter:
    return StatusReporter("decode", TOPIC, broker.publish, flush_s, dropped.append, max_entries)


def test_reports_of_one_flush_window_travel_as_one_record_keyed_by_the_process() -> None:
    async def run() -> FakeBroker:
        broker = FakeBroker()
        reports = reporter(broker, [])
        for n in range(5):
            reports.report(f"job-{n}", "decoding", time.time())
        assert broker.records == []  # nothing sent before the window ends
        await asyncio.sleep(0.15)
        reports.report("job-5", "decoding", time.time())
        await reports.close()
        return broker

    broker = asyncio.run(run())
    assert len(broker.records) == 2
    assert {key for _, key, _ in broker.records} == {broker.records[0][1]}
    assert broker.records[0][1].startswith(b"decode:")
    assert broker.entries() == [(f"job-{n}", "decoding") for n in range(6)]


def test_a_full_buffer_is_sent_at_once_without_waiting_for_the_window() -> None:
    async def run() -> FakeBroker:
        broker = FakeBroker()
        reports = reporter(broker, [], flush_s=60.0, max_entries=3)
        for n in range(7):
            reports.report(f"job-{n}", "preprocessing", time.time())
        await asyncio.sleep(0.01)
        assert [len(decode_status(v).entries) for _, _, v in broker.records] == [3, 3]
        await reports.close()
        return broker

    broker = asyncio.run(run())
    assert len(broker.entries()) == 7


def test_a_failed_send_is_counted_as_dropped_and_later_reports_still_go() -> None:
    async def run() -> tuple[FakeBroker, list[int]]:
        broker, dropped = FakeBroker(), []
        reports = reporter(broker, dropped, flush_s=0.0)
        broker.down = True
        reports.report("lost-1", "decoding", time.time())
        reports.report("lost-2", "decoding", time.time())
        await asyncio.sleep(0.05)
        broker.down = False
        reports.report("sent", "decoding", time.time())
        await reports.close()
        return broker, dropped

    broker, dropped = asyncio.run(run())
    assert dropped == [2]
    assert broker.entries() == [("sent", "decoding")]


def test_the_sink_writes_every_entry_of_a_report(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, store_url=f"sqlite:///{tmp_path / 'results.db'}")
    sink = SinkStage(settings, StageMetrics("sink", CollectorRegistry()))
    sink.setup()
    broker = FakeBroker()

    async def run() -> None:
        reports = StatusReporter("preprocess", sink.topics.status, broker.publish, 0.01, lambda n: None)
        for n in range(3):
            reports.report(f"job-{n}", "preprocessing", 1000.0 + n)
        await reports.close()
        topic, key, value = broker.records[0]
        assert await sink.handle(Incoming(topic, 0, 0, key, value, time.time(), time.time())) == []
        await sink.stop()

    asyncio.run(run())
    store = sink.store.__class__(f"sqlite:///{tmp_path / 'results.db'}")
    jobs = [store.get_job(f"job-{n}") for n in range(3)]
    assert [(job.state, job.state_times) for job in jobs] == [
        ("preprocessing", {"preprocessing": 1000.0 + n}) for n in range(3)
    ]



def test_a_value_postgresql_will_not_store_is_dead_lettered_not_waited_out(postgres_url: str, tmp_path: Path) -> None:
    """A NUL byte in a text field (a crafted dead letter here): PostgreSQL refuses it, and the
    sink must refuse the message with a reason, not retry it as an outage for ever."""
    settings = Settings(state_dir=tmp_path, store_url=postgres_url)
    sink = SinkStage(settings, StageMetrics("sink", CollectorRegistry()))
    sink.setup()
    letter = DeadLetter(job_id="unknown:t:0:1", stage="decode", reason="undecodable_media", detail="bad\x00detail",
                        source_topic="t.events", source_partition=0, source_offset=1, failed_at=time.time())

    async def run() -> Refused:
        try:
            message = Incoming(sink.topics.dead_letter, 0, 5, b"x", to_json(letter), time.time(), time.time())
            with pytest.raises(Refused) as refused:
                await asyncio.wait_for(sink.handle(message), 30)
            return refused.value
        finally:
            await sink.stop()

    refused = asyncio.run(run())
    assert refused.reason == "unstorable_value" and "postgresql refused a value" in refused.detail
