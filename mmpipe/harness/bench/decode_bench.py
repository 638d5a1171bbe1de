"""Decode cost: mmpipe.stages.decode.media.decode_video against a bare PyAV decode loop, one thread each.

Both decode every frame of the same 720p H.264 clip (inter-frame codecs need every packet);
decode_video also samples frames and converts the sampled ones to downscaled RGB, which is what
the decode stage does per video job. The ratio of their frame rates is the decode stage's
overhead over the codec itself. Runs alternate (bare, stage, bare, stage...) and each side
keeps its fastest run.

With one codec thread, FFmpeg decodes in the calling thread, so the thread's CPU time is the
whole cost; the ratio is taken on CPU time, which other processes on a shared machine barely
disturb (wall-clock frame rates are reported beside it).
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass

import av

from mmpipe.stages.decode.media import DecodeLimits, decode_video


@dataclass
class DecodeResult:
    clip_bytes: int
    width: int
    height: int
    frames: int
    bitrate_kbps: float
    bare_fps: float  # frames per CPU second of the decoding thread, best run
    stage_fps: float
    bare_wall_fps: float  # frames per wall-clock second, best run
    stage_wall_fps: float
    sampled_frames: int
    repeats: int

    @property
    def ratio(self) -> float:
        return self.stage_fps / self.bare_fps


def bare_decode(data: bytes) -> int:
    """The floor: demux and decode every video frame, nothing else."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "SLICE"
        stream.codec_context.thread_count = 1
        return sum(1 for _ in container.decode(stream))


def stage_decode(data: bytes, limits: DecodeLimits) -> tuple[int, int]:
    media = decode_video(data, limits)
    return media.frames_decoded, len(media.frames)


def run(data: bytes, repeats: int, limits: DecodeLimits | None = None) -> DecodeResult:
    limits = limits or DecodeLimits(threads=1)  # the decode stage's defaults, one codec thread
    bare_cpu, stage_cpu, bare_wall, stage_wall = [], [], [], []
    frames = sampled = 0
    bare_decode(data)  # first-call set-up (codec tables) is not billed to either side
    for _ in range(repeats):
        with _timed(bare_cpu, bare_wall):
            frames = bare_decode(data)
        with _timed(stage_cpu, stage_wall):
            stage_frames, sampled = stage_decode(data, limits)
        if stage_frames != frames:
            raise RuntimeError(f"decode_video decoded {stage_frames} frames, the bare loop {frames}")
    width, height, duration = _clip_info(data)
    return DecodeResult(
        clip_bytes=len(data),
        width=width,
        height=height,
        frames=frames,
        bitrate_kbps=round(len(data) * 8 / duration / 1000, 1) if duration else 0.0,
        bare_fps=round(frames / min(bare_cpu), 2),
        stage_fps=round(frames / min(stage_cpu), 2),
        bare_wall_fps=round(frames / min(bare_wall), 2),
        stage_wall_fps=round(frames / min(stage_wall), 2),
        sampled_frames=sampled,
        repeats=repeats,
    )


@contextlib.contextmanager
def _timed(cpu: list[float], wall: list[float]) -> Iterator[None]:
    cpu_start, wall_start = time.thread_time(), time.perf_counter()
    yield
    cpu.append(time.thread_time() - cpu_start)
    wall.append(time.perf_counter() - wall_start)


def _clip_info(data: bytes) -> tuple[int, int, float]:
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        duration = float(stream.duration * stream.time_base) if stream.duration else 0.0
        return stream.codec_context.width, stream.codec_context.height, duration
