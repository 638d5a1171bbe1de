"""Decode running preprocess's transform in its own process (stages/fused.py): fused
(Settings.fuse_preprocess: every part, no preprocess process) and the bypass (the default: only
parts preprocess would merely copy). The topology that runs, where wake-ups and admission look,
and every modality end to end."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from mmpipe.client import make_event
from mmpipe.models.registry import DEFAULTS, get_spec
from mmpipe.schemas.settings import Settings
from mmpipe.stages.decode import samples
from mmpipe.stages.sink.store import open_store
from mmpipe.streams import wakeup
from mmpipe.streams.kafka import LagReader, downstreams_of, stage_input_topics
from mmpipe.streams.topics import TopicNames
from mmpipe.streams.topology import NotRunStage, stage_names, stage_spec
from mmpipe.supervisor import Pipeline
from tests.conftest import make_settings
from tests.helpers import publish, wait_for_results


def test_fused_the_decode_stage_feeds_inference_and_no_preprocess_stage_runs(tmp_path):
    apart = Settings(state_dir=tmp_path, preprocess_bypass=False)
    fused = Settings(state_dir=tmp_path, fuse_preprocess=True)
    prefix = apart.topic_prefix
    decoded = ("preprocess", [f"{prefix}.decoded", f"{prefix}.decoded.high"], f"{prefix}-preprocess")
    ready = ("inference", [f"{prefix}.ready", f"{prefix}.ready.high"], f"{prefix}-inference")
    assert stage_names(apart) == ("decode", "preprocess", "inference", "sink")
    assert stage_names(fused) == ("decode", "inference", "sink")
    assert stage_spec("decode", apart).entry == "mmpipe.stages.decode.stage:DecodeStage"
    assert stage_spec("decode", fused).entry == "mmpipe.stages.fused:DecodeAndPreprocessStage"
    assert stage_input_topics(fused, "decode") == stage_input_topics(apart, "decode")
    assert downstreams_of(apart, "decode") == [decoded]
    assert downstreams_of(fused, "decode") == [ready]
    assert downstreams_of(apart, "sink") == []
    with pytest.raises(NotRunStage, match="fused"):
        stage_spec("preprocess", fused)
    # Wake-ups: nobody listens on `decoded`; whoever writes `ready` wakes inference as before.
    assert wakeup.listening_folder(fused, "preprocess") is None
    folders = wakeup.reader_folders(fused)
    assert f"{prefix}.decoded" not in folders and folders[f"{prefix}.ready"] == wakeup.listening_folder(fused, "inference")


def test_the_bypass_feeds_both_preprocess_and_inference_and_admission_counts_both(tmp_path):
    bypass = Settings(state_dir=tmp_path)  # the default
    prefix = bypass.topic_prefix
    assert stage_names(bypass) == ("decode", "preprocess", "inference", "sink")
    assert stage_spec("decode", bypass).entry == "mmpipe.stages.fused:DecodeAndPreprocessStage"
    assert [stage for stage, _, _ in downstreams_of(bypass, "decode")] == ["preprocess", "inference"]
    assert downstreams_of(bypass, "preprocess") == downstreams_of(bypass, "decode")[1:]
    folders = wakeup.reader_folders(bypass)
    assert folders[f"{prefix}.decoded"] == wakeup.listening_folder(bypass, "preprocess")
    assert folders[f"{prefix}.ready"] == wakeup.listening_folder(bypass, "inference")


def test_only_frames_decode_already_cut_to_the_crop_skip_preprocess():
    image = get_spec(DEFAULTS["image"])
    crop = np.zeros((224, 224, 3), np.uint8)
    assert not image.needs_preprocess({"rgb": crop}, {"center_crop": 224})
    assert image.needs_preprocess({"rgb": crop}, {})  # not cut by decode: a 224 frame is resized
    assert image.needs_preprocess({"rgb": np.zeros((256, 341, 3), np.uint8)}, {"center_crop": 224})
    pixels = image.preprocess({"rgb": crop + 7}, {"center_crop": 224})["pixels"]
    assert pixels.shape == (3, 224, 224) and pixels.flags.c_contiguous and int(pixels.min()) == 7
    for kind in ("audio", "text"):
        assert get_spec(DEFAULTS[kind]).needs_preprocess({}, {})


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shape", ["fused", "bypass"])
def test_every_modality_through_decode_running_preprocess(broker, tmp_path, media_dir, shape):
    clip = media_dir / "fused-clip.mp4"
    # Over resnet's 256 short side, so decode scales and cuts the frames: they may skip preprocess.
    clip.write_bytes(samples.encode_video(seconds=2.0, width=480, height=272, audio=samples.speech_pcm()[: 2 * 16000]))
    settings = make_settings(broker.bootstrap, tmp_path, media_dir, fuse_preprocess=shape == "fused",
                             preprocess_bypass=True)
    with Pipeline(settings, workdir=tmp_path / "run", embedded_broker=False) as pipeline:
        assert sorted(p.stage for p in pipeline.processes) == sorted(stage_names(settings))
        settings = pipeline.settings
        events = [
            make_event("video", uri=str(clip)),
            make_event("image", data=samples.encode_image(samples.synthetic_picture(400, 300, seed=3), "jpeg")),
            make_event("text", text="fused decode and preprocess", priority=0),
            make_event("image", data=b"not an image at all", job_id="fused-garbage"),
            # Under 256: decode leaves it whole, preprocess scales it up and cuts it.
            make_event("image", data=samples.encode_image(samples.synthetic_picture(320, 240, seed=4), "png")),
        ]
        results = wait_for_results(settings, publish(settings, events))
        video, image, text, garbage, small = (results[e.job_id] for e in events)
        for result in (video, image, text, small):
            assert result.status == "ok", result.error
            t = result.timings
            assert t.decode_ms > 0 and t.preprocess_ms >= 0 and t.execute_ms > 0
            parts = (t.queue_decode_ms + t.decode_ms + t.queue_preprocess_ms + t.preprocess_ms + t.queue_inference_ms
                     + t.batch_wait_ms + t.execute_ms + t.queue_sink_ms + t.sink_ms)
            assert parts == pytest.approx(t.end_to_end_ms, abs=1.0)  # the spans still tile the path
            if shape == "fused" or result is image:
                assert t.queue_preprocess_ms < 50  # handed on in process, not through a topic
        assert [f["t_s"] for f in video.prediction["frames"]] == [0.0, 1.0]
        assert len(image.prediction["labels"]) == len(small.prediction["labels"]) == 5
        assert len(text.prediction["embedding"]) == 384
        assert garbage.status == "error" and garbage.error["code"] == "undecodable_media"
        store = open_store(settings.store_url)
        assert [letter["stage"] for letter in store.dead_letters("fused-garbage")] == ["decode"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not {"decoding", "preprocessing", "inferring"} <= set(store.get_job(image.job_id).state_times):
            time.sleep(0.2)
        assert {"decoding", "preprocessing", "inferring", "finished"} <= set(store.get_job(image.job_id).state_times)
        # Fused, the hop is gone; with the bypass only the text, the video's audio windows and
        # the small image took it (the other frames were cut to the crop in decode).
        audio_windows = math.ceil(2.0 / get_spec(DEFAULTS["audio"]).config.decode.audio_window_s)
        expected = 0 if shape == "fused" else 1 + audio_windows + 1
        assert _records_on(settings, TopicNames(settings.topic_prefix).decoded) == expected


def _records_on(settings: Settings, topic: str) -> int:
    async def read() -> int:
        reader = LagReader(settings)
        try:
            return sum(row.end_offset for row in await reader.read("probe", [topic, f"{topic}.high"]))
        finally:
            await reader.close()

    return asyncio.run(read())
