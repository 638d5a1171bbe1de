"""Speech to text end to end through real stage processes (Whisper tiny.en, real packaged
weights, served by the continuous batcher): a video's spoken track comes back as text, silence
as an empty transcript, and audio longer than one 30 s window is transcribed per window, cut in
a pause."""

from __future__ import annotations

import numpy as np
import pytest

from mmpipe.client import make_event
from mmpipe.schemas import ModelRef
from mmpipe.stages.decode import samples
from tests.helpers import publish, wait_for_results

pytestmark = pytest.mark.timeout(600)

RATE = 16_000
FIRST = "Good morning everyone, the meeting starts now."
SECOND = "Please close the door when you leave."


def words(text: str) -> set[str]:
    return {w.strip(".,!?").lower() for w in text.split()}


@pytest.fixture(scope="module")
def media(media_dir):
    speech = samples.speech_pcm(samples.SPEECH_TEXT, lead_s=0.5, tail_s=0.5)
    first, second = samples.speech_pcm(FIRST, lead_s=1.0, tail_s=0.0), samples.speech_pcm(SECOND, lead_s=0.0, tail_s=1.0)
    # The second sentence starts at 28.6 s and runs past 30 s: the window is cut in the pause
    # before it (a fixed cut at 30 s split its words between two windows).
    gap = np.zeros(int(28.6 * RATE) - first.size, dtype=np.float32)
    files = {
        "video": media_dir / "talking.mp4",
        "silence": media_dir / "silence.wav",
        "long": media_dir / "long.flac",
    }
    files["video"].write_bytes(samples.encode_video(seconds=speech.size / RATE, width=160, height=90, fps=10, audio=speech))
    files["silence"].write_bytes(samples.encode_audio(np.zeros(3 * RATE, dtype=np.float32)))
    files["long"].write_bytes(samples.encode_audio(np.concatenate([first, gap, second]), fmt="flac"))
    return files


def test_speech_comes_back_as_text_silence_as_nothing_and_long_audio_per_window(shared_pipeline, media):
    settings = shared_pipeline.settings
    events = {name: make_event("video" if name == "video" else "audio", uri=str(path)) for name, path in media.items()}
    results = wait_for_results(settings, publish(settings, events.values()), timeout_s=300)
    video, silence, long = (results[events[name].job_id] for name in ("video", "silence", "long"))
    assert all(r.status == "ok" for r in (video, silence, long)), [r.error for r in (video, silence, long)]

    spoken = video.prediction["audio"]["transcript"]
    assert spoken["model"] == "whisper-tiny-en:ct2-f16" and spoken["weights"] == "pretrained"
    assert {"test", "streaming", "inference", "pipeline", "speech"} <= words(spoken["text"]), spoken["text"]
    (segment,) = spoken["segments"]
    assert 0.2 <= segment["start_s"] < segment["end_s"] and segment["tokens"] and not segment["truncated"]

    assert silence.model == ModelRef("whisper-tiny-en", "ct2-f16")
    assert silence.prediction["transcript"] == {"text": "", "segments": [], "model": "whisper-tiny-en:ct2-f16",
                                                "weights": "pretrained"}
    assert silence.prediction["segments"] == []

    assert long.parts == 2  # two windows of at most 30 s
    first, second = long.prediction["transcript"]["segments"]
    assert first["start_s"] < 5 and 28.0 <= second["start_s"] < 30.0 < second["end_s"]
    assert {"good", "morning", "everyone", "meeting"} <= words(first["text"]), first["text"]
    assert {"close", "door", "leave"} <= words(second["text"]), second["text"]
