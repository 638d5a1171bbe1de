"""Every modality end to end through real stage processes on the embedded broker, bad input in
the dead-letter topic with its reason, and redelivery that must not double a result."""

from __future__ import annotations

import time

import orjson
import pytest

from mmpipe.stages.decode import samples
from mmpipe.client import make_event
from mmpipe.stages.sink.store import open_store
from mmpipe.schemas import ModelRef, Prediction, to_json
from tests.helpers import publish, publish_raw, topic_results, wait_for_results

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def media(media_dir):
    speech = samples.speech_pcm()
    files = {
        "video": media_dir / "clip.mp4",
        "image": media_dir / "picture.jpg",
        "audio": media_dir / "speech.flac",
    }
    files["video"].write_bytes(samples.encode_video(seconds=3.0, width=320, height=180, audio=speech[: 3 * 16000]))
    files["image"].write_bytes(samples.encode_image(samples.synthetic_picture(320, 240), "jpeg"))
    files["audio"].write_bytes(samples.encode_audio(speech, fmt="flac"))
    return files


def test_every_modality_end_to_end(shared_pipeline, media):
    settings = shared_pipeline.settings
    events = [
        make_event("video", uri=str(media["video"])),
        make_event("image", uri=str(media["image"])),
        make_event("image", data=samples.encode_image(samples.synthetic_picture(200, 150, seed=5))),
        make_event("audio", uri=str(media["audio"])),
        make_event("text", text="A sentence for the embedding model."),
    ]
    results = wait_for_results(settings, publish(settings, events))
    by_modality = {e.job_id: e.modality for e in events}
    for job_id, result in results.items():
        assert result.status == "ok", result.error
        assert result.modality == by_modality[job_id]
        t = result.timings
        assert t.end_to_end_ms > 0 and t.execute_ms > 0 and t.decode_ms > 0
        parts = (t.queue_decode_ms + t.decode_ms + t.queue_preprocess_ms + t.preprocess_ms + t.queue_inference_ms
                 + t.batch_wait_ms + t.execute_ms + t.queue_sink_ms + t.sink_ms)
        assert parts == pytest.approx(t.end_to_end_ms, abs=1.0)  # the spans tile the path

    video, image, inline_image, audio, text = (results[e.job_id] for e in events)
    assert video.model == ModelRef("resnet18", "imagenet1k-v1") and video.weights == "random"
    assert [f["t_s"] for f in video.prediction["frames"]] == [0.0, 1.0, 2.0]
    assert all(len(f["labels"]) == 5 for f in video.prediction["frames"])
    assert video.prediction["audio"]["speech_s"] > 0.5  # espeak speech in the audio track
    assert len(image.prediction["labels"]) == 5 and len(inline_image.prediction["labels"]) == 5
    # real speech between silences: the VAD finds it, and not in the leading second of silence
    segments = audio.prediction["segments"]
    assert segments and segments[0]["start_s"] >= 0.8 and audio.prediction["speech_s"] > 2.0
    assert audio.model == ModelRef("whisper-tiny-en", "ct2-f16") and audio.weights == "pretrained"
    assert "streaming" in audio.prediction["transcript"]["text"].lower()  # what was said, as text
    embedding = text.prediction["embedding"]
    assert len(embedding) == 384 and sum(x * x for x in embedding) == pytest.approx(1.0, abs=1e-3)

    # The job status table saw every state, in order (status messages may arrive after the
    # result: the table fills their timestamps without moving the state back).
    store = open_store(settings.store_url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        jobs = [store.get_job(e.job_id) for e in events]
        if all({"decoding", "preprocessing", "inferring", "finished"} <= set(j.state_times) for j in jobs):
            break
        time.sleep(0.2)
    for job in jobs:
        assert job.state == "done"
        t = job.state_times
        assert t["decoding"] <= t["preprocessing"] <= t["inferring"] <= t["finished"], t


def test_bad_input_goes_to_dead_letter_and_next_job_completes(shared_pipeline, media):
    settings = shared_pipeline.settings
    big = b"\0" * (settings.max_payload_bytes + 1)
    corrupt_video = samples.corrupt(media["video"].read_bytes())
    bad = {
        "malformed-json": b'{"job_id": "malformed-json", "modality": ',
        "unknown-modality": orjson.dumps({"job_id": "unknown-modality", "modality": "smell", "payload": {"text": "x"},
                                          "schema_version": 1, "created_at": time.time()}),
        "corrupt-media": to_json(make_event("video", data=corrupt_video, job_id="corrupt-media")),
        "oversized": to_json(make_event("image", data=big, job_id="oversized")),
        "unknown-model": to_json(make_event("image", data=b"x", model=ModelRef("resnet18", "v999"), job_id="unknown-model")),
        "outside-roots": to_json(make_event("image", uri="/etc/passwd", job_id="outside-roots")),
    }
    good = make_event("text", text="still working after the bad ones")
    publish_raw(settings, [(key.encode(), value) for key, value in bad.items()])
    publish(settings, [good])

    results = wait_for_results(settings, [good.job_id, *bad])
    assert results[good.job_id].status == "ok"
    expected_reason = {
        "malformed-json": "malformed_json",
        "unknown-modality": "unknown_modality",
        "corrupt-media": "undecodable_media",
        "oversized": "payload_too_large",
        "unknown-model": "unknown_model",
        "outside-roots": "uri_outside_input_roots",
    }
    store = open_store(settings.store_url)
    for job_id, reason in expected_reason.items():
        result = results[job_id]
        assert result.status == "error" and result.error["code"] == reason, (job_id, result.error)
        assert result.error["message"]
        letters = store.dead_letters(job_id)
        assert [(letter["stage"], letter["reason"]) for letter in letters] == [("decode", reason)]


def test_hostile_media_is_refused_and_the_decode_stage_stays_up_and_small(shared_pipeline, media_dir):
    """A few of the hostile corpus (mmpipe.harness.hostile) through the real stages: each ends
    as a failed job with its reason, the decode process is the same one afterwards, and its
    peak RSS and that of its decode workers stay under 1 GiB."""
    import psutil

    from mmpipe.harness import hostile

    settings = shared_pipeline.settings
    decode = shared_pipeline.process("decode")
    corpus = {h.name: h for h in hostile.corpus()}
    names = ["cdg-looking-png-garbage", "png-bomb-16000x16000", "wav-1hz", "avi-claiming-1e6-frames", "tty-text"]
    events = [make_event(corpus[n].modality, data=corpus[n].data, job_id=f"hostile-{n}") for n in names]
    playlist = media_dir / "playlist.m3u8"
    playlist.write_bytes(hostile.hls_playlist("http://127.0.0.1:9/segment.ts"))
    events.append(make_event("video", uri=str(playlist), job_id="hostile-hls"))
    good = make_event("image", data=samples.encode_image(samples.synthetic_picture(64, 48)))
    results = wait_for_results(settings, publish(settings, [*events, good]))
    assert results[good.job_id].status == "ok"
    for event, name in zip(events, [*names, "hls-playlist"]):
        result = results[event.job_id]
        assert result.status == "error" and result.error["code"] in corpus[name].reasons, (name, result.error)
    assert results["hostile-cdg-looking-png-garbage"].error["code"] == "undecodable_media"
    assert decode.alive()
    process = psutil.Process(decode.process.pid)
    for proc in [process, *process.children(recursive=True)]:
        peak_kib = int(next(line.split()[1] for line in open(f"/proc/{proc.pid}/status") if line.startswith("VmHWM")))
        assert peak_kib * 1024 < 1024**3, (proc.pid, proc.cmdline()[:3], peak_kib)


def test_a_crafted_work_item_on_decoded_is_dead_lettered_and_preprocess_stays_up(shared_pipeline):
    """Internal topics are not trusted either: a work item whose tensors all claim the shape
    [-1], written straight onto `decoded`, ends as malformed_item at preprocess, which goes on."""
    from mmpipe.harness import hostile
    from mmpipe.streams.topics import TopicNames

    settings = shared_pipeline.settings
    preprocess = shared_pipeline.process("preprocess")
    job_id = "crafted-minus-one"
    publish_raw(settings, [(job_id.encode(), hostile.work_item_of_unknown_lengths(job_id))],
                topic=TopicNames(settings.topic_prefix).decoded)
    good = make_event("text", text="after the crafted item")
    results = wait_for_results(settings, [job_id, *publish(settings, [good])])
    assert results[job_id].status == "error" and results[job_id].error["code"] == "malformed_item"
    assert results[good.job_id].status == "ok" and preprocess.alive()
    letters = open_store(settings.store_url).dead_letters(job_id)
    assert [(letter["stage"], letter["reason"]) for letter in letters] == [("preprocess", "malformed_item")]


def test_redelivered_job_and_duplicate_prediction_make_one_result(shared_pipeline):
    settings = shared_pipeline.settings
    event = make_event("text", text="only once, please")
    publish(settings, [event])
    first = wait_for_results(settings, [event.job_id])[event.job_id]
    # The same event again (a producer retry) and a replayed prediction (a sink redelivery).
    publish(settings, [event])
    duplicate = Prediction(
        job_id=event.job_id, part=0, parts=1, kind="text", modality="text", model=ModelRef("all-minilm-l6-v2", "1"),
        status="ok", created_at=event.created_at, trace={}, output={"embedding": [0.0] * 384},
    )
    _publish_to(settings, settings.topic_prefix + ".predictions", event.job_id.encode(), to_json(duplicate))
    marker = make_event("text", text="marker after the duplicates")
    publish(settings, [marker])
    wait_for_results(settings, [marker.job_id])

    store = open_store(settings.store_url)
    assert store.get_result(event.job_id).prediction == first.prediction
    with store._transaction() as cur:  # noqa: SLF001 - count rows directly
        cur.execute("SELECT COUNT(*) FROM results WHERE job_id = ?", (event.job_id,))
        assert cur.fetchone()[0] == 1
    on_topic = [r for r in topic_results(settings) if r.job_id == event.job_id]
    assert on_topic and {orjson.dumps(r.prediction) for r in on_topic} == {orjson.dumps(first.prediction)}


def _publish_to(settings, topic: str, key: bytes, value: bytes) -> None:
    import asyncio

    from mmpipe.streams.kafka import make_producer

    async def go() -> None:
        producer = make_producer(settings)
        await producer.start()
        try:
            await producer.send_and_wait(topic, value, key=key)
        finally:
            await producer.stop()

    asyncio.run(go())


def test_timeout_action_rejects_or_runs_late_a_job_past_its_deadline(shared_pipeline):
    settings = shared_pipeline.settings
    rejected = make_event("text", text="too late, reject me", deadline_s=-1.0)
    late = make_event("text", text="too late, run me anyway", deadline_s=-1.0, on_timeout="run_late", priority=0)
    in_time = make_event("text", text="in time", priority=2)
    results = wait_for_results(settings, publish(settings, [rejected, late, in_time]))
    assert results[rejected.job_id].status == "expired" and not results[rejected.job_id].late
    assert results[rejected.job_id].error["code"] == "deadline_exceeded"
    ran_late = results[late.job_id]
    assert ran_late.status == "ok" and ran_late.late and ran_late.priority == 0
    assert len(ran_late.prediction["embedding"]) == 384
    assert results[in_time.job_id].status == "ok" and not results[in_time.job_id].late
    assert results[in_time.job_id].priority == 2


def _stage_offsets(settings) -> dict[tuple[str, str], tuple[int, int]]:
    """(stage, topic) -> (records ever written, records the stage's group committed), summed
    over partitions, for every stage input topic."""
    import asyncio

    from mmpipe.streams.kafka import LagReader
    from mmpipe.streams.topology import STAGE_NAMES

    async def read() -> dict[tuple[str, str], tuple[int, int]]:
        reader = LagReader(settings)
        try:
            out: dict[tuple[str, str], tuple[int, int]] = {}
            for stage in STAGE_NAMES:
                for row in await reader.read_stage(stage):
                    ends, done = out.get((stage, row.topic), (0, 0))
                    out[(stage, row.topic)] = (ends + row.end_offset, done + (row.committed or 0))
            return out
        finally:
            await reader.close()

    return asyncio.run(read())


def test_high_priority_work_travels_its_own_lanes_and_every_stage_reads_them(shared_pipeline):
    """Priority 0 goes through events.high, decoded.high and ready.high (a FIFO topic with a
    backlog of lower levels would hold it back); other levels stay in the main topics."""
    settings = shared_pipeline.settings
    before = _stage_offsets(settings)
    urgent = [make_event("text", text=f"urgent {i}", priority=0) for i in range(3)]
    normal = make_event("text", text="normal", priority=1)
    results = wait_for_results(settings, publish(settings, [*urgent, normal]))
    assert all(results[e.job_id].status == "ok" and results[e.job_id].priority == 0 for e in urgent)
    assert results[normal.job_id].status == "ok"
    prefix = settings.topic_prefix
    lanes = {("decode", f"{prefix}.events.high"), ("preprocess", f"{prefix}.decoded.high"),
             ("inference", f"{prefix}.ready.high")}
    mains = {("decode", f"{prefix}.events"), ("preprocess", f"{prefix}.decoded"), ("inference", f"{prefix}.ready")}
    deadline = time.monotonic() + 30
    while True:
        after = _stage_offsets(settings)
        written = {key: after[key][0] - before.get(key, (0, 0))[0] for key in lanes | mains}
        drained = all(after[key][0] == after[key][1] for key in lanes)  # committed: nothing waits in a lane
        if drained or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert written == {**{key: 3 for key in lanes}, **{key: 1 for key in mains}}, written
    assert drained, after
