"""Random bytes into the event decoder, the media decoders and the decode stage itself: every
input either decodes or is refused with a reason; nothing else ever escapes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmpipe.stages.decode import samples
from mmpipe.stages.decode.media import DecodeLimits, MediaError, decode_audio, decode_image, decode_video
from mmpipe.schemas.settings import Settings
from mmpipe.schemas import SCHEMA_VERSION, BadMessage, MediaEvent, Payload, decode_event, decode_work_item, encode_event
from mmpipe.schemas.codec import to_json
from mmpipe.stages.decode.stage import DecodeStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Incoming, Outgoing

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = DecodeLimits(video_max_frames=2, audio_max_seconds=5)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
event_like = st.fixed_dictionaries(
    {},
    optional={
        "job_id": st.one_of(st.text(max_size=20), st.integers(-(2**63), 2**63 - 1), st.none()),
        "modality": st.sampled_from(["image", "audio", "video", "text", "smell", "", 3]),
        "payload": st.one_of(json_values, st.fixed_dictionaries({}, optional={
            "text": st.text(max_size=10), "uri": st.text(max_size=10), "data": st.text(max_size=12)})),
        "schema_version": st.one_of(st.just(1), st.integers(-2, 5), st.text(max_size=3)),
        "created_at": st.one_of(st.floats(allow_nan=False), st.text(max_size=3)),
        "deadline": st.one_of(st.none(), st.floats(allow_nan=False)),
        "model": json_values,
    },
)


@FUZZ
@given(st.binary(max_size=300))
def test_event_decoder_random_bytes(raw):
    try:
        assert isinstance(decode_event(raw), MediaEvent)
    except BadMessage as exc:
        assert exc.reason and exc.detail


@FUZZ
@given(event_like)
def test_event_decoder_random_structures(value):
    try:
        assert isinstance(decode_event(orjson.dumps(value)), MediaEvent)
    except BadMessage as exc:
        assert exc.reason in {"malformed_event", "unknown_modality", "unsupported_schema_version", "malformed_json"}


def _envelope(header: dict, body: bytes) -> bytes:
    head = orjson.dumps(header)
    return b"MME1" + len(head).to_bytes(4, "big") + head + body


@FUZZ
@given(st.binary(max_size=2000), st.sampled_from(["image", "audio", "video"]), st.integers(0, 2))
def test_events_with_inline_bytes_travel_as_an_envelope_and_come_back_equal(data, modality, priority):
    event = MediaEvent(job_id="env-1", modality=modality, payload=Payload(data=data), schema_version=SCHEMA_VERSION,
                       created_at=1.5, priority=priority, attributes={"a": "b"})
    raw = encode_event(event)
    assert raw[:4] == b"MME1" and raw.endswith(data)
    assert len(raw) < len(to_json(event)) or len(data) < 64  # no base64: a third fewer bytes
    assert decode_event(raw) == event == decode_event(to_json(event))  # JSON producers still read


def test_text_and_uri_events_stay_json():
    for payload in (Payload(text="hello"), Payload(uri="file:///x.png")):
        event = MediaEvent(job_id="env-2", modality="text" if payload.text else "image", payload=payload,
                           schema_version=SCHEMA_VERSION, created_at=1.0)
        assert encode_event(event) == to_json(event) and decode_event(encode_event(event)) == event


@pytest.mark.parametrize("raw, says", [
    (b"MME1\x00\x00", "shorter than its header"),
    (b"MME1\x00\x00\x01\x00{}", "runs past the message end"),
    (_envelope({"job_id": "e-1", "modality": "image", "schema_version": 1, "created_at": 1.0,
                "payload": {"uri": "file:///x.png"}}, b"\xff\xd8"), 'payload {"data": ""}'),
    (_envelope({"job_id": "e-1", "modality": "image", "schema_version": 1, "created_at": 1.0,
                "payload": {"data": "aGk="}}, b"\xff\xd8"), 'payload {"data": ""}'),
])
def test_a_malformed_envelope_is_refused_with_its_reason(raw, says):
    with pytest.raises(BadMessage) as refused:
        decode_event(raw)
    assert refused.value.reason == "malformed_event" and says in refused.value.detail


@FUZZ
@given(st.binary(max_size=300).map(lambda b: b"MME1" + b), event_like, st.binary(max_size=50))
def test_event_envelopes_of_random_headers_are_decoded_or_refused(raw, header, body):
    for message in (raw, _envelope(header, body)):
        try:
            assert isinstance(decode_event(message), MediaEvent)
        except BadMessage as exc:
            assert exc.reason and exc.detail


@FUZZ
@given(st.binary(max_size=400))
def test_work_item_decoder_random_bytes(raw):
    for data in (raw, b"MMW1" + raw):
        try:
            decode_work_item(data)
        except BadMessage as exc:
            assert exc.reason == "malformed_item"


def _tiny_video(fmt: str, codec: str) -> bytes:
    import io

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for i in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((24, 32, 3), i * 50, np.uint8), format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


@pytest.fixture(scope="module")
def real_media() -> dict[str, bytes]:
    """One real file per allowlisted container that PyAV can write here."""
    tone = samples.tone_pcm(0.5)
    picture = samples.synthetic_picture(64, 48)
    return {
        "image-png": samples.encode_image(picture),
        "image-jpeg": samples.encode_image(picture, "jpeg"),
        "audio-wav": samples.encode_audio(tone, fmt="wav"),
        "audio-flac": samples.encode_audio(tone, fmt="flac"),
        "audio-ogg": samples.encode_audio(tone, fmt="ogg"),
        "video-mp4": samples.encode_video(seconds=1.0, width=64, height=48, fps=10, audio=samples.tone_pcm(1.0)),
        "video-mkv": _tiny_video("matroska", "mpeg4"),
        "video-avi": _tiny_video("avi", "mpeg4"),
        "video-mpegts": _tiny_video("mpegts", "mpeg2video"),
    }


DECODERS = {"image": decode_image, "audio": decode_audio, "video": decode_video}
REFUSALS = {"undecodable_media", "empty_payload", "image_too_large", "audio_too_long", "video_too_long",
            "unsupported_sample_rate", "decode_out_of_memory"}


@pytest.mark.parametrize("kind", ["image-png", "image-jpeg", "audio-wav", "audio-flac", "audio-ogg",
                                  "video-mp4", "video-mkv", "video-avi", "video-mpegts"])
def test_media_decoders_random_and_mutated_bytes(kind, real_media):
    """Random bytes, and real files of every allowlisted container with random byte flips /
    truncations (the hard case: they pass the magic-byte check and reach the demuxer)."""
    decoder = DECODERS[kind.partition("-")[0]]
    assert decoder(real_media[kind], LIMITS)  # the unmutated file decodes

    @FUZZ
    @given(st.binary(max_size=2000) | _mutations(real_media[kind]))
    def check(data):
        try:
            decoder(data, LIMITS)
        except MediaError as exc:
            assert exc.reason in REFUSALS

    check()


def _mutations(original: bytes):
    flips = st.lists(st.tuples(st.integers(0, len(original) - 1), st.integers(0, 255)), min_size=1, max_size=20)
    return st.one_of(
        flips.map(lambda changes: _flip(original, changes)),
        st.integers(0, len(original)).map(lambda n: original[:n]),
    )


def _flip(data: bytes, changes: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, value in changes:
        out[position] = value
    return bytes(out)


@pytest.fixture(scope="module")
def decode_stage(tmp_path_factory) -> Iterator[DecodeStage]:
    settings = Settings(input_roots=[tmp_path_factory.mktemp("roots")], max_payload_bytes=100_000,
                        video_max_frames=2, audio_max_seconds=5)
    stage = DecodeStage(settings, StageMetrics("decode-fuzz", registry=_registry()))
    stage.setup()
    yield stage
    asyncio.run(stage.stop())


def _registry():
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


@FUZZ
@given(st.one_of(st.binary(max_size=300), event_like.map(orjson.dumps), st.builds(
    lambda modality, data: orjson.dumps({"job_id": "fuzz-1", "modality": modality, "schema_version": 1,
                                         "created_at": time.time(), "payload": {"data": data}}),
    st.sampled_from(["image", "audio", "video"]),
    st.binary(max_size=600).map(lambda b: __import__("base64").b64encode(b).decode()),
), st.builds(
    lambda modality, body: _envelope({"job_id": "fuzz-1", "modality": modality, "schema_version": 1,
                                      "created_at": time.time(), "payload": {"data": ""}}, body),
    st.sampled_from(["image", "audio", "video"]), st.binary(max_size=600),
)))
def test_decode_stage_answers_or_refuses_every_input(decode_stage, raw):
    message = Incoming("t.events", 0, 1, b"fuzz-1", raw, time.time(), time.time())
    try:
        out = asyncio.run(decode_stage.handle(message))
        assert out and all(isinstance(o, Outgoing) for o in out)
    except BadMessage as exc:
        assert exc.reason and exc.detail
