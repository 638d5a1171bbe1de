"""Decode and preprocess fused into one process (Settings.fuse_preprocess): the topology that
runs, where wake-ups go, and every modality end to end with nothing on `decoded`."""

from __future__ import annotations

import asyncio
import time

import pytest

from mmpipe.client import make_event
from mmpipe.schemas.settings import Settings
from mmpipe.stages.decode import samples
from mmpipe.stages.sink.store import open_store
from mmpipe.streams import wakeup
from mmpipe.streams.kafka import LagReader, downstream_of, stage_input_topics
from mmpipe.streams.topics import TopicNames
from mmpipe.streams.topology import NotRunStage, stage_names, stage_spec
from mmpipe.supervisor import Pipeline
from tests.conftest import make_settings
from tests.helpers import publish, wait_for_results


def test_fused_the_decode_stage_feeds_inference_and_no_preprocess_stage_runs(tmp_path):
    apart, fused = Settings(state_dir=tmp_path), Settings(state_dir=tmp_path, fuse_preprocess=True)
    prefix = apart.topic_prefix
    assert stage_names(apart) == ("decode", "preprocess", "inference", "sink")
    assert stage_names(fused) == ("decode", "inference", "sink")
    assert stage_spec("decode", fused).entry == "mmpipe.stages.fused:DecodeAndPreprocessStage"
    assert stage_input_topics(fused, "decode") == stage_input_topics(apart, "decode")
    assert downstream_of(apart, "decode") == ([f"{prefix}.decoded", f"{prefix}.decoded.high"], f"{prefix}-preprocess")
    assert downstream_of(fused, "decode") == ([f"{prefix}.ready", f"{prefix}.ready.high"], f"{prefix}-inference")
    with pytest.raises(NotRunStage, match="fused"):
        stage_spec("preprocess", fused)
    # Wake-ups: nobody listens on `decoded`; whoever writes `ready` wakes inference as before.
    assert wakeup.listening_folder(fused, "preprocess") is None
    folders = wakeup.reader_folders(fused)
    assert f"{prefix}.decoded" not in folders and folders[f"{prefix}.ready"] == wakeup.listening_folder(fused, "inference")


@pytest.mark.timeout(400)
def test_every_modality_through_fused_decode_and_preprocess(broker, tmp_path, media_dir):
    clip = media_dir / "fused-clip.mp4"
    clip.write_bytes(samples.encode_video(seconds=2.0, width=320, height=180, audio=samples.speech_pcm()[: 2 * 16000]))
    settings = make_settings(broker.bootstrap, tmp_path, media_dir, fuse_preprocess=True)
    with Pipeline(settings, workdir=tmp_path / "run", embedded_broker=False) as pipeline:
        assert sorted(p.stage for p in pipeline.processes) == ["decode", "inference", "sink"]
        settings = pipeline.settings
        events = [
            make_event("video", uri=str(clip)),
            make_event("image", data=samples.encode_image(samples.synthetic_picture(320, 240, seed=3), "jpeg")),
            make_event("text", text="fused decode and preprocess", priority=0),
            make_event("image", data=b"not an image at all", job_id="fused-garbage"),
        ]
        results = wait_for_results(settings, publish(settings, events))
        video, image, text, garbage = (results[e.job_id] for e in events)
        for result in (video, image, text):
            assert result.status == "ok", result.error
            t = result.timings
            assert t.decode_ms > 0 and t.preprocess_ms >= 0 and t.execute_ms > 0
            parts = (t.queue_decode_ms + t.decode_ms + t.queue_preprocess_ms + t.preprocess_ms + t.queue_inference_ms
                     + t.batch_wait_ms + t.execute_ms + t.queue_sink_ms + t.sink_ms)
            assert parts == pytest.approx(t.end_to_end_ms, abs=1.0)  # the spans still tile the path
            assert t.queue_preprocess_ms < 50  # handed on in process, not through a topic
        assert [f["t_s"] for f in video.prediction["frames"]] == [0.0, 1.0]
        assert len(image.prediction["labels"]) == 5 and len(text.prediction["embedding"]) == 384
        assert garbage.status == "error" and garbage.error["code"] == "undecodable_media"
        store = open_store(settings.store_url)
        assert [letter["stage"] for letter in store.dead_letters("fused-garbage")] == ["decode"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not {"decoding", "preprocessing", "inferring"} <= set(store.get_job(image.job_id).state_times):
            time.sleep(0.2)
        assert {"decoding", "preprocessing", "inferring", "finished"} <= set(store.get_job(image.job_id).state_times)
        assert _records_on(settings, TopicNames(settings.topic_prefix).decoded) == 0  # the hop is gone


def _records_on(settings: Settings, topic: str) -> int:
    async def read() -> int:
        reader = LagReader(settings)
        try:
            return sum(row.end_offset for row in await reader.read("probe", [topic, f"{topic}.high"]))
        finally:
            await reader.close()

    return asyncio.run(read())
