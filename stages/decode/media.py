"""Media decoding with PyAV: images to RGB arrays, audio to mono float PCM at the model's
rate, video to sampled RGB frames plus its audio track.

Pure functions of (source, limits) -> arrays, so they are tested and fuzzed without Kafka.
Every failure is a MediaError with a reason; nothing here raises anything else for bad bytes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np

MAX_PIXELS = 40_000_000  # refuse decompression bombs before converting a frame


class MediaError(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DecodeLimits:
    image_short_side: int | None = 256  # frames are scaled so their short side is this
    audio_sample_rate: int = 16_000
    audio_max_seconds: float = 600.0
    video_sample_fps: float = 1.0
    video_max_frames: int = 16
    threads: int = 1  # codec threads per decode


@dataclass
class DecodedFrame:
    index: int  # position in the sampled sequence
    time_s: float
    rgb: np.ndarray  # HxWx3 uint8


@dataclass
class DecodedMedia:
    frames: list[DecodedFrame] = field(default_factory=list)
    pcm: np.ndarray | None = None  # float32 mono at limits.audio_sample_rate
    width: int = 0
    height: int = 0
    duration_s: float = 0.0
    frames_decoded: int = 0  # all frames the codec produced (sampled or not)


Source = bytes | str | Path


# Inline bytes have no file name, so FFmpeg probes every demuxer over the buffer; for a JPEG
# that probe goes on through the whole file (about 10 ms for an 80 KB 640x480 JPEG, ten times
# its decode). A file path is hinted by its extension instead. Known signatures get their
# demuxer named; anything else, or a hint that fails to open, gets the full probe as before.
_SIGNATURES = ((b"\xff\xd8\xff", "jpeg_pipe"),)


def _sniff(data: bytes) -> str | None:
    return next((fmt for magic, fmt in _SIGNATURES if data.startswith(magic)), None)


def _open(source: Source) -> av.container.InputContainer:
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            if len(source) == 0:
                raise MediaError("empty_payload", "payload has no bytes")
            data = bytes(source)
            hint = _sniff(data)
            if hint is not None:
                try:
                    return av.open(io.BytesIO(data), mode="r", format=hint)
                except av.error.FFmpegError:
                    pass  # not what it looked like: let FFmpeg probe
            return av.open(io.BytesIO(data), mode="r")
        return av.open(str(source), mode="r")
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, UnicodeDecodeError) as exc:
        raise MediaError("undecodable_media", f"container could not be opened: {exc}") from None


def _scaled_size(width: int, height: int, short_side: int | None) -> tuple[int, int]:
    if not short_side or min(width, height) <= short_side:
        return width, height
    scale = short_side / min(width, height)
    # even sizes keep swscale on its fast paths
    return max(2, round(width * scale / 2) * 2), max(2, round(height * scale / 2) * 2)


def _to_rgb(frame: av.VideoFrame, short_side: int | None) -> np.ndarray:
    if frame.width * frame.height > MAX_PIXELS:
        raise MediaError("image_too_large", f"{frame.width}x{frame.height} exceeds {MAX_PIXELS} pixels")
    width, height = _scaled_size(frame.width, frame.height, short_side)
    # One swscale pass converts YUV->RGB and downscales (bilinear, area-ish for shrink).
    return frame.to_ndarray(width=width, height=height, format="rgb24", interpolation="AREA")


def decode_image(source: Source, limits: DecodeLimits) -> DecodedMedia:
    with _guard(), _open(source) as container:
        if not container.streams.video:
            raise MediaError("undecodable_media", "no image stream found")
        stream = container.streams.video[0]
        for frame in container.decode(stream):
            rgb = _to_rgb(frame, limits.image_short_side)
            return DecodedMedia(
                frames=[DecodedFrame(0, 0.0, rgb)], width=frame.width, height=frame.height, frames_decoded=1
            )
    raise MediaError("undecodable_media", "image stream held no decodable frame")


def decode_audio(source: Source, limits: DecodeLimits) -> DecodedMedia:
    with _guard(), _open(source) as container:
        if not container.streams.audio:
            raise MediaError("undecodable_media", "no audio stream found")
        pcm = _decode_audio_stream(container, container.streams.audio[0], limits)
        return DecodedMedia(pcm=pcm, duration_s=pcm.size / limits.audio_sample_rate)


def decode_video(source: Source, limits: DecodeLimits) -> DecodedMedia:
    """Sampled frames (every 1/video_sample_fps seconds, at most video_max_frames) and the
    audio track. Every video packet is decoded (inter-frame codecs need it), but only sampled
    frames pay for the RGB conversion."""
    with _guard(), _open(source) as container:
        if not container.streams.video:
            raise MediaError("undecodable_media", "no video stream found")
        video = container.streams.video[0]
        video.thread_type = "AUTO" if limits.threads != 1 else "SLICE"
        video.codec_context.thread_count = limits.threads
        audio = container.streams.audio[0] if container.streams.audio else None
        result = DecodedMedia(width=video.codec_context.width, height=video.codec_context.height)
        resampler = _resampler(limits) if audio is not None else None
        chunks: list[np.ndarray] = []
        max_samples = int(limits.audio_max_seconds * limits.audio_sample_rate)
        sampled_samples = 0
        next_sample_t = 0.0
        interval = 1.0 / limits.video_sample_fps
        streams = [s for s in (video, audio) if s is not None]
        for packet in container.demux(*streams):
            if packet.stream is video:
                for frame in packet.decode():
                    result.frames_decoded += 1
                    t = _frame_time(frame, result.frames_decoded, video)
                    if len(result.frames) < limits.video_max_frames and t + 1e-6 >= next_sample_t:
                        result.frames.append(DecodedFrame(len(result.frames), round(t, 3), _to_rgb(frame, limits.image_short_side)))
                        next_sample_t = (math.floor(t / interval + 1e-6) + 1) * interval
            elif resampler is not None and sampled_samples < max_samples:
                for frame in packet.decode():
                    for out in resampler.resample(frame):
                        chunk = out.to_ndarray().reshape(-1)
                        chunks.append(chunk)
                        sampled_samples += chunk.size
        if resampler is not None:
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
        if not result.frames:
            raise MediaError("undecodable_media", "video stream held no decodable frame")
        if chunks:
            result.pcm = np.concatenate(chunks).astype(np.float32, copy=False)[:max_samples]
        result.duration_s = float(video.duration * video.time_base) if video.duration else (
            result.frames[-1].time_s
        )
        return result


def _frame_time(frame: av.VideoFrame, count: int, stream: av.video.stream.VideoStream) -> float:
    if frame.time is not None:
        return float(frame.time)
    rate = float(stream.average_rate or 25)
    return (count - 1) / rate


def _resampler(limits: DecodeLimits) -> av.AudioResampler:
    return av.AudioResampler(format="flt", layout="mono", rate=limits.audio_sample_rate)


def _decode_audio_stream(container: av.container.InputContainer, stream: av.audio.stream.AudioStream, limits: DecodeLimits) -> np.ndarray:
    resampler = _resampler(limits)
    max_samples = int(limits.audio_max_seconds * limits.audio_sample_rate)
    chunks: list[np.ndarray] = []
    total = 0
    for frame in container.decode(stream):
        for out in resampler.resample(frame):
            chunk = out.to_ndarray().reshape(-1)
            chunks.append(chunk)
            total += chunk.size
        if total > max_samples:
            raise MediaError(
                "audio_too_long", f"audio exceeds the {limits.audio_max_seconds:.0f} s limit"
            )
    for out in resampler.resample(None):
        chunks.append(out.to_ndarray().reshape(-1))
    if not chunks:
        raise MediaError("undecodable_media", "audio stream held no decodable samples")
    return np.concatenate(chunks).astype(np.float32, copy=False)


class _guard:
    """Turns PyAV/FFmpeg failures met while decoding into MediaError."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or isinstance(exc, MediaError):
            return False
        if isinstance(exc, (av.error.FFmpegError, OSError, ValueError, IndexError, KeyError, TypeError, EOFError, RuntimeError)):
            raise MediaError("undecodable_media", f"{type(exc).__name__}: {exc}") from None
        return False


def decode_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MediaError("undecodable_text", f"text payload is not UTF-8: {exc}") from None


def windows(pcm: np.ndarray, sample_rate: int, window_s: float | None) -> Iterator[tuple[float, np.ndarray]]:
    """Cut PCM into (offset_s, chunk) windows; the last one may be shorter."""
    if not window_s:
        yield 0.0, pcm
        return
    step = int(window_s * sample_rate)
    for start in range(0, max(pcm.size, 1), step):
        yield start / sample_rate, pcm[start : start + step]
