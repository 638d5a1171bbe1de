"""Hostile input, made at test time: every file of the corpus (bombs, lying headers, formats
no decoder here may open, junk, truncations), special files under the input roots and crafted
work items are refused with their reason, the decode workers' memory stays under 1 GiB, and
the stage keeps decoding good input afterwards. Crashes, overruns and memory exhaustion in a
decode worker refuse that one job and leave the pool working."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import resource
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil
import pytest
from prometheus_client import CollectorRegistry

from mmpipe.harness import hostile
from mmpipe.schemas import Refused, decode_event, decode_prediction, decode_work_item, payload_digest
from mmpipe.schemas.codec import _HEADER, _MAGIC
from mmpipe.schemas.settings import Settings
from mmpipe.stages.decode import samples
from mmpipe.stages.decode.isolation import DecodePool
from mmpipe.stages.decode.media import DecodeLimits, MediaError, decode_media
from mmpipe.stages.decode.stage import DecodeStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.failure import dead_letter
from mmpipe.streams.stage import Incoming

GIB = 1024**3


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("roots")


@pytest.fixture(scope="module")
def stage(roots) -> Iterator[DecodeStage]:
    settings = Settings(input_roots=[roots], decode_workers=1, video_max_frames=2)
    decode = DecodeStage(settings, StageMetrics("decode-hostile", registry=CollectorRegistry()))
    decode.setup()
    yield decode
    asyncio.run(decode.stop())


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    """A TCP port an HLS playlist points at: nothing may ever connect to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    yield sock
    sock.close()


def _event(modality: str, **payload: object) -> bytes:
    if "data" in payload:
        payload["data"] = base64.b64encode(payload["data"]).decode()
    return orjson.dumps({"job_id": f"hostile-{time.monotonic_ns()}", "modality": modality, "schema_version": 1,
                         "created_at": time.time(), "payload": payload})


def _refusal(stage: DecodeStage, raw: bytes) -> Refused:
    message = Incoming("t.events", 0, 7, b"hostile", raw, time.time(), time.time())
    with pytest.raises(Refused) as refused:
        asyncio.run(stage.handle(message))
    letter = dead_letter("decode", message, refused.value.reason, refused.value.detail)  # what the runtime sends
    assert letter.reason == refused.value.reason and letter.detail and letter.source_offset == 7
    return refused.value


def _good_image_decodes(stage: DecodeStage) -> None:
    data = samples.encode_image(samples.synthetic_picture(64, 48))
    out = asyncio.run(stage.handle(Incoming("t.events", 0, 8, b"ok", _event("image", data=data), time.time(), time.time())))
    # The one work item (status reports are not outputs: streams/status.py).
    assert [o.topic for o in out] == [stage.topics.decoded]


def _workers_peak_rss() -> int:
    """The highest peak RSS (VmHWM) of the decode workers alive now: spawned children of this
    process. Read per worker from /proc, not from RUSAGE_CHILDREN, which in a whole test run
    also holds the peak of every stage process an earlier test started and reaped."""
    peaks = [0]
    for child in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing" not in " ".join(child.cmdline()):
                continue
            status = Path(f"/proc/{child.pid}/status").read_text()
        except (psutil.Error, OSError):
            continue  # gone meanwhile (a worker replaced after a refusal)
        hwm = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), "0")
        peaks.append(int(hwm) * 1024)
    return max(peaks)


def test_every_hostile_file_is_refused_with_its_reason(stage, roots, listener):
    corpus = hostile.corpus(segment_url=f"http://127.0.0.1:{listener.getsockname()[1]}/segment.ts")
    self_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reasons = {}
    workers_peak = 0
    for item in corpus:
        for raw in (_event(item.modality, data=item.data), _file_event(roots, item)):
            refused = _refusal(stage, raw)
            assert refused.reason in item.reasons, (item.name, refused)
            reasons[item.name] = refused.reason
            workers_peak = max(workers_peak, _workers_peak_rss())
        _good_image_decodes(stage)  # the stage is still up and decoding
    with pytest.raises(BlockingIOError):
        listener.accept()  # the playlist's segment URL was never fetched
    assert reasons["cdg-looking-png-garbage"] == "undecodable_media"
    assert reasons["png-bomb-16000x16000"] == "image_too_large"
    assert 0 < workers_peak < GIB
    # The stage process itself never decodes: a hostile file costs it no more than its bytes.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self_before < 200 * 1024**2


def _file_event(roots: Path, item: hostile.Hostile) -> bytes:
    path = roots / f"{item.name}.bin"
    path.write_bytes(item.data)
    return _event(item.modality, uri=str(path))


def test_special_files_under_the_roots_are_refused_without_blocking(stage, roots):
    fifo = roots / "pipe.mp4"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    links = roots / "zero.wav"
    links.symlink_to("/dev/zero")
    device = roots / "zero-device.wav"
    try:
        os.mknod(device, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        device = None
    cases = [("video", fifo, "bad_uri"), ("audio", links, "uri_outside_input_roots")]
    if device is not None:
        cases.append(("audio", device, "bad_uri"))
    for modality, path, reason in cases:
        assert _refusal(stage, _event(modality, uri=str(path))).reason == reason


def test_inline_text_on_a_media_job_is_refused_and_never_opened_as_a_path(stage, tmp_path):
    """A str reaching a decoder would be opened as a file: outside the input roots, or a FIFO
    that blocks a worker. Only text jobs carry inline text; the decoders take bytes or a
    checked Path."""
    outside = tmp_path / "outside.png"
    outside.write_bytes(samples.encode_image(samples.synthetic_picture(16, 16)))
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    for path in (outside, fifo):
        refused = _refusal(stage, _event("image", text=str(path)))
        assert refused.reason == "malformed_event" and "payload.text is for text jobs" in refused.detail
    with pytest.raises(MediaError, match="bytes or a checked file"):
        decode_media("image", str(outside), DecodeLimits())
    _good_image_decodes(stage)


@pytest.mark.parametrize("times", [{"created_at": "nan"}, {"deadline": "inf"}, {"created_at": "-inf"}])
def test_non_finite_event_times_are_malformed_events(stage, times):
    raw = orjson.loads(_event("text", text="hello"))
    raw.update(times)
    assert _refusal(stage, orjson.dumps(raw)).reason == "malformed_event"


@pytest.mark.parametrize("change", [{"modality": "im\u0000age"}, {"model": {"name": "resnet\u000018", "version": "1"}},
                                    {"deadline": 1.0, "model": {"name": "x\u0000", "version": "1"}}, {"key": b"job\x00id"}])
def test_nul_bytes_never_reach_a_dead_letter_or_the_store(stage, change):
    """PostgreSQL refuses NUL in text, and the sink would retry such a write as an outage for
    ever: a NUL in the modality or the model name refuses the event, and no letter carries one
    (a key that is no job ID becomes a locator, an unknown modality is dropped)."""
    raw = orjson.loads(_event("image", data=b"\x89PNG"))
    key = change.pop("key", b"hostile")
    raw.update(change)
    message = Incoming("t.events", 0, 9, key, orjson.dumps(raw), time.time(), time.time())
    with pytest.raises(Refused) as refused:
        asyncio.run(stage.handle(message))
    letter = dead_letter("decode", message, refused.value.reason, refused.value.detail)
    assert refused.value.reason in {"malformed_event", "unknown_modality"} or key != b"hostile"
    assert "\x00" not in letter.job_id and "\x00" not in (letter.modality or "")
    assert letter.job_id == "hostile" or letter.job_id.startswith("unknown:")


def test_an_event_past_its_deadline_is_answered_expired_with_its_payload_digest(stage):
    """The digest lets the sink refuse the answer when the job ID belongs to another payload."""
    raw = orjson.loads(_event("text", text="too late"))
    raw["deadline"] = 1.0
    event = decode_event(orjson.dumps(raw))
    (out,) = asyncio.run(stage.handle(Incoming("t.events", 0, 10, event.job_id.encode(), orjson.dumps(raw), time.time(), time.time())))
    answer = decode_prediction(out.value)
    assert out.topic == stage.topics.predictions and answer.status == "expired"
    assert answer.meta["payload_digest"] == payload_digest(event)


def test_a_work_item_with_shape_minus_one_is_refused_before_any_copy():
    with pytest.raises(Refused) as refused:
        decode_work_item(hostile.work_item_of_unknown_lengths("j"))
    assert refused.value.reason == "malformed_item" and "[-1]" in refused.value.detail


@pytest.mark.parametrize("shape", [[10**9, 10**9], [0, 10**30], [2**62, 4]])
def test_work_item_shapes_beyond_the_message_are_refused(shape):
    header = json.dumps({"job_id": "j", "part": 0, "parts": 1, "kind": "image", "modality": "image",
                         "model": ["m", "v"], "created_at": 0.0, "deadline": 0.0, "trace": {}, "meta": {},
                         "tensors": [{"name": "x", "dtype": "float32", "shape": shape}]}).encode()
    with pytest.raises(Refused, match="malformed_item"):
        decode_work_item(_HEADER.pack(_MAGIC, len(header)) + header + bytes(64))


@pytest.fixture
def pool() -> Iterator[DecodePool]:
    decode_pool = DecodePool(1, 512 * 1024**2, timeout_s=5.0)
    yield decode_pool
    decode_pool.close()


def _decodes(pool: DecodePool) -> bool:
    data = samples.encode_image(samples.synthetic_picture(64, 48))
    return asyncio.run(pool.decode("image", data, DecodeLimits())).width == 64


def test_a_worker_that_dies_refuses_only_its_job(pool):
    with pytest.raises(MediaError) as refused:
        asyncio.run(pool.run(os.abort))  # a crash in native code, as a hostile file could cause
    assert refused.value.reason == "decoder_crashed" and "signal 6" in refused.value.detail
    assert _decodes(pool)


def test_a_decode_over_its_time_budget_is_refused(pool):
    pool.timeout_s = 0.5
    with pytest.raises(MediaError) as refused:
        asyncio.run(pool.run(time.sleep, 30))
    assert refused.value.reason == "decode_timeout"
    pool.timeout_s = 5.0
    assert _decodes(pool)


def test_a_decode_over_the_memory_limit_is_refused(pool):
    with pytest.raises(MediaError) as refused:
        asyncio.run(pool.run(bytearray, 600 * 1024**2))  # more than the worker's 512 MiB
    assert refused.value.reason == "decode_out_of_memory"
    assert _decodes(pool)
