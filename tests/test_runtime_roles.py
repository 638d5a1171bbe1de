"""The stage runtime's roles, each against fakes (no broker, no faust): the failure policy,
delivery's sender, downstream admission, one message's delivery, and the shared retry helper."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, MessageSizeTooLargeError
from faust.exceptions import ProducerSendError
from prometheus_client import CollectorRegistry

from mmpipe.schemas import BadMessage, decode_dead_letter, to_json
from mmpipe.schemas.events import WorkerState
from mmpipe.schemas.settings import Settings
from mmpipe.streams.admission import DownstreamAdmission
from mmpipe.streams.backpressure import PartitionGate
from mmpipe.streams.delivery import MessageDelivery, Sender
from mmpipe.streams.failure import FailurePolicy
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.poison import PoisonGuard
from mmpipe.streams.retry import poll_until, retry_async
from mmpipe.streams.stage import DependencyUnavailable, Incoming, Outgoing, Stage, TransientError
from mmpipe.streams.worker_state import WorkerReporter, WorkerStateFeed

DLQ = "mm.dead-letter"


def message(offset: int = 7, partition: int = 1) -> Incoming:
    return Incoming("mm.events", partition, offset, b"job-1", b'{"created_at": 1.0, "modality": "image"}', 0.0, 0.0)


class FakeSleep:
    """Records the waits instead of sleeping them (yielding to the loop, as a sleep does)."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.sleep(0)


async def eventually(ready, deadline_s: float = 5.0) -> None:
    """Yield to the loop until `ready()` holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not ready():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.001)


def policy(max_retries: int = 2) -> tuple[FailurePolicy, StageMetrics, FakeSleep]:
    metrics = StageMetrics("test", CollectorRegistry())
    sleep = FakeSleep()
    settings = Settings(max_retries=max_retries, retry_backoff_s=0.1, retry_backoff_max_s=0.4)
    return FailurePolicy("test", settings, metrics, DLQ, sleep=sleep), metrics, sleep


def scripted(*steps: object):
    """A handler that raises or returns each step in turn, counting its calls."""
    calls = {"n": 0}

    async def handle(_: Incoming) -> list[Outgoing]:
        step = steps[min(calls["n"], len(steps) - 1)]
        calls["n"] += 1
        if isinstance(step, BaseException):
            raise step
        return step  # type: ignore[return-value]

    return handle, calls


def letter_of(outgoing: list[Outgoing]):
    (out,) = outgoing
    assert out.topic == DLQ and out.key == b"job-1"
    return decode_dead_letter(out.value)


def counter(metrics: StageMetrics, name: str, **labels: str) -> float:
    return getattr(metrics, name).labels(**labels)._value.get()


# Failure policy ---------------------------------------------------------------------------------
async def test_bad_input_is_dead_lettered_at_once_with_its_reason():
    fp, metrics, sleep = policy()
    handle, calls = scripted(BadMessage("undecodable_media", "not a PNG"))
    letter = letter_of(await fp.run(handle, message()))
    assert (letter.reason, letter.detail, letter.stage) == ("undecodable_media", "not a PNG", "test")
    assert (letter.source_partition, letter.source_offset, letter.modality) == (1, 7, "image")
    assert calls["n"] == 1 and sleep.waits == []
    assert counter(metrics, "dead_letters", stage="test", reason="undecodable_media") == 1


async def test_transient_errors_retry_with_bounded_jittered_waits_then_succeed():
    fp, metrics, sleep = policy(max_retries=3)
    out = [Outgoing("mm.decoded", b"job-1", b"x")]
    handle, calls = scripted(TransientError("flaky"), TransientError("flaky"), out)
    assert await fp.run(handle, message()) == out
    assert calls["n"] == 3
    assert len(sleep.waits) == 2 and all(0 <= w <= cap for w, cap in zip(sleep.waits, (0.1, 0.2)))
    assert counter(metrics, "retries", stage="test", reason="transient") == 2
    assert counter(metrics, "items", stage="test", outcome="ok") == 1


async def test_transient_errors_past_max_retries_become_retries_exhausted():
    fp, _, sleep = policy(max_retries=2)
    handle, calls = scripted(TransientError("still flaky"))
    letter = letter_of(await fp.run(handle, message()))
    assert letter.reason == "retries_exhausted" and "still flaky" in letter.detail
    assert calls["n"] == 3 and len(sleep.waits) == 2


async def test_an_unavailable_dependency_is_waited_for_beyond_max_retries():
    fp, metrics, sleep = policy(max_retries=1)
    out = [Outgoing("mm.results", b"job-1", b"r")]
    handle, calls = scripted(*([DependencyUnavailable("db locked")] * 6), out)
    assert await fp.run(handle, message()) == out
    assert calls["n"] == 7 and len(sleep.waits) == 6
    assert max(sleep.waits) <= 0.4  # capped
    assert counter(metrics, "retries", stage="test", reason="dependency_unavailable") == 6


async def test_a_bug_is_dead_lettered_as_internal_error_not_retried():
    fp, _, sleep = policy()
    handle, calls = scripted(KeyError("oops"))
    letter = letter_of(await fp.run(handle, message()))
    assert letter.reason == "internal_error" and "KeyError" in letter.detail
    assert calls["n"] == 1 and sleep.waits == []


async def test_cancellation_is_not_swallowed():
    fp, _, _ = policy()
    handle, _ = scripted(asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await fp.run(handle, message())


# Sender (delivery) --------------------------------------------------------------------------------
class FakeProducer:
    """send() returns a future resolved with record metadata, or raises the scripted error."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.sent: list[Outgoing] = []

    async def __call__(self, out: Outgoing) -> asyncio.Future:
        if self.errors:
            raise self.errors.pop(0)
        self.sent.append(out)
        future = asyncio.get_running_loop().create_future()
        future.set_result(SimpleNamespace(topic=out.topic, partition=len(self.sent) % 4))
        return future


def sender(producer: FakeProducer) -> Sender:
    fp, _, _ = policy()
    return Sender(producer, fp, Settings(retry_backoff_s=0.001, retry_backoff_max_s=0.002))


async def test_sender_waits_for_every_ack_and_returns_the_metadata():
    producer = FakeProducer()
    outs = [Outgoing("mm.decoded", b"job-1", b"a"), Outgoing("mm.status", b"job-1", b"s")]
    metadata = await sender(producer).send_all(outs, message())
    assert producer.sent == outs and [md.topic for md in metadata] == ["mm.decoded", "mm.status"]


async def test_sender_retries_broker_errors_until_taken():
    producer = FakeProducer(KafkaConnectionError(), KafkaConnectionError())
    outs = [Outgoing("mm.decoded", b"job-1", b"a")]
    await sender(producer).send_all(outs, message())
    assert producer.sent == outs


def faust_wrapped(error: KafkaError) -> ProducerSendError:
    """What faust's producer raises when aiokafka refuses to queue a record."""
    try:
        raise ProducerSendError(f"Error while sending: {error!r}") from error
    except ProducerSendError as wrapped:
        return wrapped


@pytest.mark.parametrize("wrap", [False, True], ids=["aiokafka", "faust-wrapped"])
async def test_sender_turns_an_output_too_large_into_a_dead_letter(wrap):
    error = MessageSizeTooLargeError()
    producer = FakeProducer(faust_wrapped(error) if wrap else error)
    await sender(producer).send_all([Outgoing("mm.decoded", b"job-1", b"x" * 10)], message())
    assert letter_of(producer.sent).reason == "output_too_large"


async def test_sender_retries_a_faust_wrapped_queueing_timeout():
    producer = FakeProducer(faust_wrapped(KafkaTimeoutError()))
    outs = [Outgoing("mm.decoded", b"job-1", b"a")]
    await sender(producer).send_all(outs, message())
    assert producer.sent == outs


# Downstream admission -----------------------------------------------------------------------------
class FakeGate:
    def __init__(self) -> None:
        self.held: dict[int, bool] = {}
        self.told = 0  # hold_for_downstream calls, one per partition told

    def hold_for_downstream(self, tps, full: bool) -> None:
        for tp in tps:
            self.held[tp.partition] = full
            self.told += 1


def admission(shedding: bool = False, high: int = 4, low: int = 1) -> tuple[DownstreamAdmission, FakeGate, FakeSleep]:
    gate, sleep = FakeGate(), FakeSleep()
    tps = [SimpleNamespace(topic="mm.events", partition=p) for p in range(2)]
    flags = {"shedding": shedding}
    adm = DownstreamAdmission(high=high, low=low, aging_s=1.0, gate=gate, assigned=lambda: tps,  # type: ignore[arg-type]
                              shedding=lambda: flags["shedding"], sleep=sleep)
    adm.flags = flags  # type: ignore[attr-defined]
    return adm, gate, sleep


def test_nothing_is_held_before_the_first_read_out():
    adm, gate, _ = admission()
    adm.count_sent([0, 0, 0, 0, 0])
    assert not adm.known and gate.held == {}


def test_a_partition_is_held_above_high_and_released_at_low_with_hysteresis():
    adm, gate, _ = admission(high=4, low=1)
    adm.update({0: 2, 1: 0})
    assert gate.held == {1: False}  # partition 0 between low and high: unchanged
    adm.count_sent([0, 0, 0])  # the estimate grows by what was sent since the read-out
    assert gate.held[0] is True and adm.lag_at(0) == 5
    adm.update({0: 3, 1: 0})  # drained below high but above low: still held
    assert gate.held[0] is True
    adm.update({0: 1, 1: 0})
    assert gate.held[0] is False


def test_messages_tell_the_gate_only_changes_and_a_read_out_tells_every_hold_again():
    """The gate's pause and metrics cost more than a message's own bookkeeping, so a message
    that changes no decision tells the gate nothing; a read-out repeats every hold, since faust
    resumes all partitions after a rebalance's recovery."""
    adm, gate, _ = admission(high=4, low=1)
    adm.update({0: 9, 1: 0})
    assert gate.held == {0: True, 1: False} and gate.told == 2
    for _ in range(5):
        adm.count_sent([0])
        adm.refresh()
    assert gate.told == 2  # partition 0 stayed held, partition 1 free
    adm.update({0: 9, 1: 0})
    assert gate.told == 4  # the read-out told both again
    adm.update({0: 0, 1: 0})
    adm.count_sent([1])
    adm.refresh()
    assert gate.held == {0: False, 1: False} and gate.told == 6


async def test_admission_waits_for_room_and_reserves_it():
    adm, _, sleep = admission(high=2)
    adm.update({0: 1, 1: 0})
    assert await adm.wait_for_room(0, offset=10, topic="mm.events")  # 1 + 0 admitted < 2
    assert adm.estimate(0) == 2  # the reservation counts until release

    async def drain() -> None:
        while not sleep.waits:
            await asyncio.sleep(0)
        adm.release(0, 10, topic="mm.events")
        adm.update({0: 0, 1: 0})

    admitted, _ = await asyncio.gather(adm.wait_for_room(0, offset=11, topic="mm.events"), drain())
    assert admitted and sleep.waits and adm.estimate(0) == 1


async def test_a_shedding_stage_turns_the_message_away_instead_of_waiting():
    adm, gate, sleep = admission(shedding=True, high=2)
    adm.update({0: 5, 1: 0})
    assert not await adm.wait_for_room(0, offset=1, topic="mm.events")
    assert sleep.waits == [] and gate.held[0] is False  # shedding never holds the input


def test_releasing_twice_or_an_unreserved_message_changes_nothing():
    adm, _, _ = admission()
    adm.update({0: 0, 1: 0})
    adm.release(0, 99, topic="mm.events")
    assert adm.estimate(0) == 0


async def test_the_same_partition_and_offset_in_two_lanes_are_two_reservations():
    """A stage reads a topic and its high lane, whose offsets are independent: events p0@5 and
    events.high p0@5 in flight together must each hold and each give back their room."""
    adm, _, _ = admission(high=10)
    adm.update({0: 0, 1: 0})
    assert await adm.wait_for_room(0, offset=5, topic="mm.events")
    assert await adm.wait_for_room(0, offset=5, priority=0, topic="mm.events.high")
    assert await adm.wait_for_room(0, offset=5, topic="mm.events")  # the same message again (a retry)
    assert adm.estimate(0) == 2
    adm.release(0, 5, topic="mm.events.high")
    adm.release(0, 5, topic="mm.events")
    assert adm.estimate(0) == 0


# One message's delivery ---------------------------------------------------------------------------
DOWNSTREAM = "mm.decoded"


class FakeStage(Stage):
    """Reserves room downstream, as decode does, then answers with what `answer` says."""

    name = "test"

    def __init__(self, answer) -> None:
        super().__init__(Settings(), StageMetrics("test", CollectorRegistry()))
        self.answer = answer
        self.handled = 0

    async def handle(self, message: Incoming) -> list[Outgoing]:
        self.handled += 1
        assert await self.wait_for_room(message)
        return await self.answer(message)


class HeldProducer(FakeProducer):
    """Sends at once, but the broker acknowledges only when the test says so."""

    def __init__(self, *errors: BaseException) -> None:
        super().__init__(*errors)
        self.acks = asyncio.Event()

    async def __call__(self, out: Outgoing) -> asyncio.Future:
        acked = await super().__call__(out)
        held = asyncio.get_running_loop().create_future()

        async def ack_later() -> None:
            await self.acks.wait()
            held.set_result(acked.result())

        asyncio.ensure_future(ack_later())
        return held


def delivery(stage: FakeStage, producer: FakeProducer, poison_db: Path) -> MessageDelivery:
    fp, _, _ = policy()
    gate = PartitionGate(high=4, low=1, max_total=8, pause=lambda tps: None, resume=lambda tps: None)
    adm = DownstreamAdmission(high=4, low=1, aging_s=1.0, gate=gate, assigned=list, shedding=lambda: False)
    stage.admit = lambda message, priority: adm.wait_for_room(message.partition, message.offset, priority, topic=message.topic)
    return MessageDelivery(stage, fp, sender(producer), PoisonGuard(poison_db, max_crashes=1), gate, adm, [DOWNSTREAM])


async def deliver(run: MessageDelivery, incoming: Incoming, acks: list[int]) -> None:
    """As the agent does: count the message in flight, then carry it."""
    tp = (incoming.topic, incoming.partition)
    await run.gate.acquire(tp)
    await run.process(incoming, lambda: acks.append(incoming.offset), tp)


def all_released(run: MessageDelivery, incoming: Incoming) -> bool:
    """Nothing of the message is held: no place in the gate, no reservation, no poison mark."""
    return (run.gate.total == 0 and run.admission.estimate(incoming.partition) == run.admission.lag_at(incoming.partition)
            and run.poison.crashes(incoming.topic, incoming.partition, incoming.offset) == (0, 0))


async def test_an_input_is_acked_only_after_its_outputs_are_acknowledged(tmp_path):
    async def two_outputs(_: Incoming) -> list[Outgoing]:
        return [Outgoing(DOWNSTREAM, b"job-1", b"a"), Outgoing("mm.status", b"job-1", b"s")]

    producer, acks = HeldProducer(), []
    run = delivery(FakeStage(two_outputs), producer, tmp_path / "poison.db")
    run.admission.update({p: 0 for p in range(4)})
    carried = asyncio.ensure_future(deliver(run, message(), acks))
    await eventually(lambda: len(producer.sent) == 2)
    await asyncio.sleep(0.01)
    assert acks == [] and run.gate.total == 1, "sent but not acknowledged: the input waits"
    assert run.admission.estimate(1) == 1, "its room downstream stays reserved meanwhile"
    producer.acks.set()
    await carried
    assert acks == [7] and all_released(run, message())
    assert run.admission.lag_at(1) == 1, "what went downstream counts toward the next stage's lag"


@pytest.mark.parametrize("failure", ["handler cancelled", "producer failed"])
async def test_a_failure_releases_the_gate_and_the_reservation_and_acks_nothing(tmp_path, failure):
    async def fail_in_handler(_: Incoming) -> list[Outgoing]:
        raise asyncio.CancelledError()

    async def one_output(_: Incoming) -> list[Outgoing]:
        return [Outgoing(DOWNSTREAM, b"job-1", b"a")]

    if failure == "handler cancelled":
        stage, producer, raised = FakeStage(fail_in_handler), FakeProducer(), asyncio.CancelledError
    else:  # not a broker error, so not retried: it ends the message's task
        stage, producer, raised = FakeStage(one_output), FakeProducer(RuntimeError("producer closed")), RuntimeError
    run, acks = delivery(stage, producer, tmp_path / "poison.db"), []
    run.admission.update({p: 0 for p in range(4)})
    with pytest.raises(raised):
        await deliver(run, message(), acks)
    assert stage.handled == 1 and acks == []
    assert all_released(run, message())


async def test_a_message_the_poison_guard_refuses_is_dead_lettered_as_crashed_stage(tmp_path):
    incoming, db = message(), tmp_path / "poison.db"
    where = (incoming.topic, incoming.partition, incoming.offset)
    # Two starts that never finished (the process died): the second ran alone (max_crashes=1).
    for _ in range(2):
        crashed = PoisonGuard(db, max_crashes=1)
        assert await crashed.enter(*where)
        crashed.close()  # no leave(): the process died

    async def never(_: Incoming) -> list[Outgoing]:
        raise AssertionError("a given-up message is not handled again")

    stage, producer, acks = FakeStage(never), FakeProducer(), []
    run = delivery(stage, producer, db)
    await deliver(run, incoming, acks)
    letter = letter_of(producer.sent)
    assert letter.reason == "crashed_stage" and "killed the stage 1 times while it ran alone" in letter.detail
    assert stage.handled == 0 and acks == [7], "given up for good: acked, so it is not redelivered"
    assert run.gate.total == 0


# The retry helper ---------------------------------------------------------------------------------
async def test_retry_async_gives_up_when_told_and_raises_the_error_itself():
    calls = {"n": 0}

    async def failing() -> None:
        calls["n"] += 1
        raise ConnectionError("down")

    sleep = FakeSleep()
    with pytest.raises(ConnectionError):
        await retry_async(failing, ConnectionError, base_s=1, cap_s=8, give_up=lambda exc, n: n >= 4, sleep=sleep)
    assert calls["n"] == 5
    caps = [min(8, 2**i) for i in range(4)]
    assert all(0 <= w <= cap for w, cap in zip(sleep.waits, caps))


async def test_retry_async_counts_the_bare_first_attempt_like_any_other():
    outcomes = iter([ConnectionError("down"), ConnectionError("down"), "up"])
    retried: list[tuple[int, float]] = []

    async def flaky() -> str:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    sleep = FakeSleep()
    assert await retry_async(flaky, ConnectionError, base_s=1, cap_s=8, sleep=sleep,
                             on_retry=lambda exc, attempt, delay: retried.append((attempt, delay))) == "up"
    assert [attempt for attempt, _ in retried] == [0, 1] and len(sleep.waits) == 2
    with pytest.raises(ValueError):  # not a retryable error: raised at once, nothing retried
        await retry_async(lambda: (_ for _ in ()).throw(ValueError("bad")), ConnectionError, base_s=1, cap_s=8, sleep=sleep)
    assert len(sleep.waits) == 2


def test_poll_until_stops_at_the_first_answer_and_lets_other_errors_through():
    answers = iter([OSError("refused"), OSError("refused"), "ok"])

    def call() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert poll_until(call, every_s=0.0, deadline_s=5) == "ok"
    with pytest.raises(RuntimeError):
        poll_until(lambda: (_ for _ in ()).throw(RuntimeError("exited")), every_s=0.0, deadline_s=5,
                   retry_if=lambda exc: not isinstance(exc, RuntimeError))


# The worker state feed: reconnects on the retry helper ---------------------------------------------
class FakeWorkersReader:
    """A reader of the `workers` topic: its start fails, or it delivers one report and then
    nothing more."""

    def __init__(self, fails: bool, report: bytes) -> None:
        self.fails = fails
        self.report = [SimpleNamespace(key=b"w-1", value=report), SimpleNamespace(key=b"w-1", value=None)]
        self.stopped = False

    async def start(self) -> None:
        if self.fails:
            raise KafkaConnectionError()

    async def getmany(self, timeout_ms: int) -> dict:
        report, self.report = self.report, []
        if not report:
            await asyncio.sleep(timeout_ms / 1000)
        return {"workers/0": report}

    async def stop(self) -> None:
        self.stopped = True


async def test_the_worker_state_feed_reconnects_until_the_broker_answers(monkeypatch):
    state = WorkerState(worker="w-1", partitions=[0], ready=True, models=["m"], item_s=0.1, waits_s={}, at=1.0)
    readers: list[FakeWorkersReader] = []

    def connect(*args, **kwargs) -> FakeWorkersReader:
        readers.append(FakeWorkersReader(fails=len(readers) < 3, report=to_json(state)))
        return readers[-1]

    monkeypatch.setattr("mmpipe.streams.worker_state.groupless_consumer", connect)
    seen: list[WorkerState] = []
    gone: list[str] = []
    feed = WorkerStateFeed(Settings(), seen.append, gone.append)
    feed.RECONNECT_BACKOFF_S = (0.001, 0.002)
    feed.start()
    try:
        await eventually(lambda: gone)
    finally:
        await feed.stop()
    assert seen == [state] and gone == ["w-1"] and len(readers) == 4  # the report, then its tombstone
    assert all(reader.stopped for reader in readers), "every connection is closed, failed ones too"


class FakeStateProducer:
    """A producer of the `workers` topic whose start fails, or that records what it sends."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.sent: list[bytes] = []
        self.stopped = False

    async def start(self) -> None:
        if self.fails:
            raise KafkaConnectionError()

    async def send_and_wait(self, topic: str, value: bytes | None, key: bytes) -> None:
        self.sent.append(value)

    async def stop(self) -> None:
        self.stopped = True


async def test_the_worker_state_reporter_keeps_trying_until_the_broker_answers(monkeypatch):
    state = WorkerState(worker="w-1", partitions=[0], ready=True, models=["m"], item_s=0.1, waits_s={}, at=1.0)
    producers: list[FakeStateProducer] = []

    def connect(*args, **kwargs) -> FakeStateProducer:
        producers.append(FakeStateProducer(fails=len(producers) < 3))
        return producers[-1]

    monkeypatch.setattr("mmpipe.streams.worker_state.make_producer", connect)
    reporter = WorkerReporter(Settings(), lambda: state)
    reporter.CONNECT_BACKOFF_S = (0.001, 0.002)
    reporter.start()
    try:
        await eventually(lambda: producers and producers[-1].sent)
    finally:
        await reporter.stop()
    assert len(producers) == 4 and producers[-1].sent[0] == to_json(state)
    assert producers[-1].sent[-1] is None, "a stopping worker leaves a tombstone"
    assert all(p.stopped for p in producers), "every producer is closed, failed ones too"
