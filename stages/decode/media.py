"""Media decoding with PyAV: images to RGB arrays, audio to mono float PCM at the model's
rate, video to sampled RGB frames plus its audio track.

Pure functions of (source, limits) -> arrays, so they are tested and fuzzed without Kafka.
Every failure is a MediaError (a Refused) with a reason; nothing here raises anything else for
bad bytes. The input is untrusted, so before any decoding:

* the container must be one of its modality's allowlist, recognised by its magic bytes and
  opened with that demuxer named (no probing of every demuxer FFmpeg has: 130 bytes of junk
  are not "CD+G graphics"), and the demuxer FFmpeg used must be the one named;
* FFmpeg may open nothing but the input itself (protocol_whitelist file,pipe: an HLS playlist
  or a concat list cannot make it fetch URLs or other files);
* every stream's codec must be on the allowlist, and what the headers declare (frame size,
  frame count, duration, sample rate, channels) within the limits; the codec's own max_pixels
  check stops a frame buffer larger than the limit from ever being allocated.
Headers can lie in the other direction, so the same limits are checked again while decoding.
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from mmpipe.schemas.errors import Refused

MAX_PIXELS = 40_000_000  # per frame: refuse decompression bombs before a buffer is allocated
# Models scale the short side up to their input size: an 8x1,000,000 strip (8 Mpixels, within
# MAX_PIXELS) would become 256x32,000,000 in preprocess, gigabytes for no picture.
MAX_ASPECT_RATIO = 20
MIN_SAMPLE_RATE = 1_000  # a 1 Hz "WAV" resampled to 16 kHz would be a 16000x sample bomb
MAX_SAMPLE_RATE = 384_000
MAX_CHANNELS = 32
HEAD_BYTES = 192  # enough for every signature below (two MPEG-TS sync bytes)


class MediaError(Refused):
    """Media refused: not an allowed format, over a limit, or undecodable."""


@dataclass(frozen=True)
class DecodeLimits:
    image_short_side: int | None = 256  # frames are scaled so their short side is this
    image_center_crop: int | None = None  # then cut to this centre square (see _center_crop)
    audio_sample_rate: int = 16_000
    audio_max_seconds: float = 600.0
    video_sample_fps: float = 1.0
    video_max_frames: int = 16
    video_max_seconds: float = 600.0
    video_max_source_frames: int = 36_000  # frames the codec may decode (10 min at 60 fps)
    max_pixels: int = MAX_PIXELS
    threads: int = 1  # codec and swscale threads per decode


@dataclass
class DecodedFrame:
    index: int  # position in the sampled sequence
    time_s: float
    rgb: np.ndarray  # HxWx3 uint8
    center_crop: int | None = None  # rgb is the centre square of this side of the scaled frame


@dataclass
class DecodedMedia:
    frames: list[DecodedFrame] = field(default_factory=list)
    pcm: np.ndarray | None = None  # float32 mono at limits.audio_sample_rate
    width: int = 0
    height: int = 0
    duration_s: float = 0.0
    frames_decoded: int = 0  # all frames the codec produced (sampled or not)


Source = bytes | Path  # a str is never opened: it could name any file (see _head)


# Allowlists ------------------------------------------------------------------------------
MP4 = "mov,mp4,m4a,3gp,3g2,mj2"  # one FFmpeg demuxer reads MP4, MOV and M4A
MKV = "matroska,webm"


def _riff(kind: bytes):  # noqa: ANN202 - a signature predicate
    return lambda head: head[:4] == b"RIFF" and head[8:12] == kind


def _mpeg_audio_sync(head: bytes) -> bool:
    return len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06 != 0


def _adts_sync(head: bytes) -> bool:
    return len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0


def _mpegts(head: bytes) -> bool:
    # a sync byte opens every 188-byte packet
    return head[:1] == b"G" and (len(head) <= 188 or head[188:189] == b"G")


# (matches the first bytes, FFmpeg demuxer to open with, what to call it), most specific first.
SIGNATURES = (
    (lambda h: h.startswith(b"\x89PNG\r\n\x1a\n"), "png_pipe", "PNG"),
    (lambda h: h.startswith(b"\xff\xd8\xff"), "jpeg_pipe", "JPEG"),
    (_riff(b"WEBP"), "webp_pipe", "WebP"),
    (lambda h: h[:2] == b"BM" and len(h) >= 26, "bmp_pipe", "BMP"),
    (lambda h: h[:6] in (b"GIF87a", b"GIF89a"), "gif", "GIF"),
    (lambda h: h[:4] in (b"II*\x00", b"MM\x00*"), "tiff_pipe", "TIFF"),
    (_riff(b"WAVE"), "wav", "WAV"),
    (lambda h: h.startswith(b"fLaC"), "flac", "FLAC"),
    (lambda h: h.startswith(b"OggS"), "ogg", "Ogg"),
    (lambda h: h[4:8] == b"ftyp" or h[4:8] in (b"moov", b"mdat", b"wide", b"free"), MP4, "MP4/MOV/M4A"),
    (lambda h: h.startswith(b"\x1a\x45\xdf\xa3"), MKV, "Matroska/WebM"),
    (_riff(b"AVI "), "avi", "AVI"),
    (lambda h: h.startswith(b"ID3"), "mp3", "MP3"),
    (_adts_sync, "aac", "AAC (ADTS)"),
    (_mpeg_audio_sync, "mp3", "MP3"),
    (_mpegts, "mpegts", "MPEG-TS"),
)

ALLOWED_FORMATS = {
    "image": {"png_pipe", "jpeg_pipe", "webp_pipe", "bmp_pipe", "gif", "tiff_pipe"},
    "audio": {"wav", "flac", "ogg", MP4, "mp3", "aac"},
    "video": {MP4, MKV, "avi", "mpegts"},
}
_AUDIO_CODECS = {"flac", "mp3", "vorbis", "opus", "aac", "alac"}  # and every pcm_* codec
ALLOWED_CODECS = {
    "image": {"png", "mjpeg", "webp", "bmp", "gif", "tiff"},
    "audio": _AUDIO_CODECS,
    "video": {"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mpeg1video", "mjpeg"},
}
# Not allowed anywhere, but worth naming in a refusal.
KNOWN_OTHERS = (
    (b"#EXTM3U", "an HLS/M3U playlist"),
    (b"ffconcat", "an FFmpeg concat list"),
    (b"<?xml", "an XML document (DASH manifest?)"),
    (b"%PDF", "a PDF document"),
    (b"PK\x03\x04", "a ZIP archive"),
)


def sniff(head: bytes) -> tuple[str, str] | None:
    """(FFmpeg demuxer, format label) for the first bytes of a file, or None."""
    return next(((fmt, label) for match, fmt, label in SIGNATURES if match(head)), None)


def looks_like(head: bytes) -> str:
    """What a refused input looked like, for the dead-letter detail."""
    found = sniff(head)
    if found is not None:
        return found[1]
    known = next((what for magic, what in KNOWN_OTHERS if head.startswith(magic)), None)
    if known is not None:
        return known
    if head and all(32 <= b < 127 or b in b"\r\n\t\x1b" for b in head):
        return "text"
    return f"no known format (first bytes {head[:16]!r})"


def _head(source: Source) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[:HEAD_BYTES])
    if not isinstance(source, Path):  # only a path that inputs.resolve_local_uri checked is opened
        raise MediaError("undecodable_media", f"media must be bytes or a checked file, not {type(source).__name__}")
    with open(source, "rb") as f:
        return f.read(HEAD_BYTES)


def _open(source: Source, modality: str, limits: DecodeLimits) -> av.container.InputContainer:
    """Open an allowed container with its demuxer named; anything else is undecodable_media."""
    try:
        if isinstance(source, (bytes, bytearray, memoryview)) and len(source) == 0:
            raise MediaError("empty_payload", "payload has no bytes")
        head = _head(source)
        found = sniff(head)
        if found is None or found[0] not in ALLOWED_FORMATS[modality]:
            raise MediaError(
                "undecodable_media",
                f"not an allowed {modality} format: it looks like {looks_like(head)}",
            )
        demuxer, label = found
        options = {"protocol_whitelist": "file,pipe", "max_pixels": str(limits.max_pixels)}
        file = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else str(source)
        container = av.open(file, mode="r", format=demuxer, options=options)
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, UnicodeDecodeError) as exc:
        raise MediaError("undecodable_media", f"{modality} container could not be opened: {exc}") from None
    if container.format.name != demuxer:  # belt and braces: FFmpeg used what we named
        container.close()
        raise MediaError("undecodable_media", f"FFmpeg read it as {container.format.name}, not {label}")
    return container


def _checked_codec(stream: av.stream.Stream, modality: str) -> None:
    if stream.codec_context is None:  # a codec FFmpeg does not know
        raise MediaError("undecodable_media", f"{stream.type} stream of an unknown codec")
    name = stream.codec_context.codec.canonical_name
    allowed = ALLOWED_CODECS[modality]
    if name not in allowed and not (modality == "audio" and name.startswith("pcm_")):
        raise MediaError("undecodable_media", f"{stream.type} codec {name} is not allowed for {modality}")


def _declared_image_size(source: Source) -> tuple[int, int]:
    """The size an image header declares, read by Pillow without decoding any pixels."""
    from PIL import Image

    file = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file) as image:
                return image.size
    except Image.DecompressionBombError:
        return (2**31, 2**31)  # over any limit
    except Exception:  # any unreadable header: no size
        return (0, 0)


def _checked_video_stream(container: av.container.InputContainer, source: Source, modality: str,
                          limits: DecodeLimits) -> av.video.stream.VideoStream:
    if not container.streams.video:
        raise MediaError("undecodable_media", f"no {modality} stream found")
    stream = container.streams.video[0]
    _checked_codec(stream, modality)
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height == 0:
        # With max_pixels set, FFmpeg leaves the size unset for a frame over the limit (and
        # for one it could not read at all): ask the header which it was, for the reason.
        width, height = _declared_image_size(source) if modality == "image" else (0, 0)
        if width * height <= limits.max_pixels:
            raise MediaError("undecodable_media", f"no readable frame size in the {modality} header")
    if width * height > limits.max_pixels:
        raise MediaError("image_too_large", f"{width}x{height} exceeds {limits.max_pixels} pixels")
    stream.codec_context.options = {"max_pixels": str(limits.max_pixels)}
    return stream


def _declared_seconds(container: av.container.InputContainer, stream: av.stream.Stream) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    return container.duration / av.time_base if container.duration else 0.0


def _check_video_length(container: av.container.InputContainer, stream: av.video.stream.VideoStream, limits: DecodeLimits) -> None:
    seconds = _declared_seconds(container, stream)
    if stream.frames > limits.video_max_source_frames or seconds > limits.video_max_seconds:
        raise MediaError(
            "video_too_long",
            f"the header declares {stream.frames} frames / {seconds:.0f} s; the limits are "
            f"{limits.video_max_source_frames} frames and {limits.video_max_seconds:.0f} s",
        )


def _checked_audio_stream(container: av.container.InputContainer, limits: DecodeLimits) -> av.audio.stream.AudioStream:
    stream = container.streams.audio[0]
    _checked_codec(stream, "audio")
    rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise MediaError("unsupported_sample_rate", f"{rate} Hz is outside {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise MediaError("undecodable_media", f"{channels} audio channels (at most {MAX_CHANNELS})")
    seconds = _declared_seconds(container, stream)
    if seconds > limits.audio_max_seconds:
        raise MediaError("audio_too_long", f"the header declares {seconds:.0f} s; the limit is {limits.audio_max_seconds:.0f} s")
    return stream


def _scaled_size(width: int, height: int, short_side: int | None) -> tuple[int, int]:
    if not short_side or min(width, height) <= short_side:
        return width, height
    scale = short_side / min(width, height)
    # even sizes keep swscale on its fast paths
    return max(2, round(width * scale / 2) * 2), max(2, round(height * scale / 2) * 2)


def _to_frame(index: int, time_s: float, frame: av.VideoFrame, limits: DecodeLimits) -> DecodedFrame:
    if frame.width * frame.height > limits.max_pixels:
        raise MediaError("image_too_large", f"{frame.width}x{frame.height} exceeds {limits.max_pixels} pixels")
    if max(frame.width, frame.height) > MAX_ASPECT_RATIO * min(frame.width, frame.height):
        raise MediaError("extreme_aspect_ratio",
                         f"{frame.width}x{frame.height}: one side is more than {MAX_ASPECT_RATIO} times the other")
    width, height = _scaled_size(frame.width, frame.height, limits.image_short_side)
    # One swscale pass converts YUV->RGB and downscales (area averaging for shrink).
    rgb = _reformatter().reformat(frame, width=width, height=height, format="rgb24", interpolation="AREA",
                                  threads=limits.threads).to_ndarray()
    crop = limits.image_center_crop
    if crop and limits.image_short_side and min(width, height) == limits.image_short_side >= crop:
        return DecodedFrame(index, time_s, _center_crop(rgb, crop), center_crop=crop)
    return DecodedFrame(index, time_s, rgb)


_thread_state = threading.local()


def _reformatter() -> VideoReformatter:
    """This thread's swscale context, kept while frames keep their size and format.
    VideoFrame.to_ndarray builds one per frame, with as many threads as the machine has cores:
    0.55 of the 2.46 CPU ms decode_image took per 640x480 JPEG
    (benchmarks/results/decode-scale-cost-2026-12-07.txt)."""
    if not hasattr(_thread_state, "reformatter"):
        _thread_state.reformatter = VideoReformatter()
    return _thread_state.reformatter


def _center_crop(rgb: np.ndarray, side: int) -> np.ndarray:
    """The centre side x side square, placed as torchvision's CenterCrop places it, so the
    model's preprocess would cut the same pixels; only those travel on to preprocess."""
    top = int(round((rgb.shape[0] - side) / 2.0))
    left = int(round((rgb.shape[1] - side) / 2.0))
    return np.ascontiguousarray(rgb[top:top + side, left:left + side])


def decode_image(source: Source, limits: DecodeLimits) -> DecodedMedia:
    with _guard(), _open(source, "image", limits) as container:
        stream = _checked_video_stream(container, source, "image", limits)
        for frame in container.decode(stream):
            return DecodedMedia(
                frames=[_to_frame(0, 0.0, frame, limits)], width=frame.width, height=frame.height, frames_decoded=1
            )
    raise MediaError("undecodable_media", "image stream held no decodable frame")


def decode_audio(source: Source, limits: DecodeLimits) -> DecodedMedia:
    with _guard(), _open(source, "audio", limits) as container:
        if not container.streams.audio:
            raise MediaError("undecodable_media", "no audio stream found")
        pcm = _finite(_decode_audio_stream(container, _checked_audio_stream(container, limits), limits))
        return DecodedMedia(pcm=pcm, duration_s=pcm.size / limits.audio_sample_rate)


def decode_video(source: Source, limits: DecodeLimits) -> DecodedMedia:
    """Sampled frames (every 1/video_sample_fps seconds, at most video_max_frames) and the
    audio track. Every video packet is decoded (inter-frame codecs need it), but only sampled
    frames pay for the RGB conversion."""
    with _guard(), _open(source, "video", limits) as container:
        video = _checked_video_stream(container, source, "video", limits)
        _check_video_length(container, video, limits)
        video.thread_type = "AUTO" if limits.threads != 1 else "SLICE"
        video.codec_context.thread_count = limits.threads
        audio = _checked_audio_stream(container, limits) if container.streams.audio else None
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
                    if result.frames_decoded > limits.video_max_source_frames:
                        raise MediaError("video_too_long", f"more than {limits.video_max_source_frames} frames")
                    t = _frame_time(frame, result.frames_decoded, video)
                    if len(result.frames) < limits.video_max_frames and t + 1e-6 >= next_sample_t:
                        result.frames.append(_to_frame(len(result.frames), round(t, 3), frame, limits))
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
            result.pcm = _finite(np.concatenate(chunks).astype(np.float32, copy=False)[:max_samples])
        result.duration_s = float(video.duration * video.time_base) if video.duration else (
            result.frames[-1].time_s
        )
        return result


def _frame_time(frame: av.VideoFrame, count: int, stream: av.video.stream.VideoStream) -> float:
    if frame.time is not None:
        return float(frame.time)
    rate = float(stream.average_rate or 25)
    return (count - 1) / rate


def _finite(pcm: np.ndarray) -> np.ndarray:
    """Float codecs carry NaN and Inf as well as samples: the models would clip or propagate
    them into an "ok" answer about nothing, so such audio is not media."""
    if not np.isfinite(pcm).all():
        raise MediaError("undecodable_media", f"audio holds {int(np.count_nonzero(~np.isfinite(pcm)))} non-finite samples (NaN or Inf)")
    return pcm


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
        if isinstance(exc, MemoryError):  # FFmpeg's ENOMEM too: the worker's memory limit
            raise MediaError("decode_out_of_memory", f"{type(exc).__name__}: {exc}") from None
        if isinstance(exc, (av.error.FFmpegError, OSError, ValueError, IndexError, KeyError, TypeError, EOFError, RuntimeError)):
            raise MediaError("undecodable_media", f"{type(exc).__name__}: {exc}") from None
        return False


def decode_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MediaError("undecodable_text", f"text payload is not UTF-8: {exc}") from None


PAUSE_FRAME_S = 0.1  # the resolution of a window cut
PAUSE_SEARCH = 1 / 3  # a cut falls in the last third of a full window


def windows(pcm: np.ndarray, sample_rate: int, window_s: float | None) -> Iterator[tuple[float, np.ndarray]]:
    """Cut PCM into contiguous (offset_s, chunk) windows of at most window_s; the last one may
    be shorter. Where more audio follows, a window ends in the quietest PAUSE_FRAME_S of its
    last third, so a word spoken across a fixed 30 s mark is not split between two windows
    (each is heard alone by the model, and half a word is a wrong word or none)."""
    if not window_s:
        yield 0.0, pcm
        return
    size = int(window_s * sample_rate)
    start = 0
    while pcm.size - start > size:
        end = start + quietest_cut(pcm[start : start + size], sample_rate)
        yield start / sample_rate, pcm[start:end]
        start = end
    yield start / sample_rate, pcm[start:]


def quietest_cut(chunk: np.ndarray, sample_rate: int) -> int:
    """The sample in the last third of `chunk` at the middle of its quietest frame; the latest
    one on a tie, and the chunk's end when that is its last frame, so silence or steady noise
    keeps windows full (a 60 s silence is two windows, not two and a crumb)."""
    frame = max(1, int(PAUSE_FRAME_S * sample_rate))
    low = int(chunk.size * (1 - PAUSE_SEARCH))
    frames = (chunk.size - low) // frame
    if frames < 1:
        return chunk.size
    region = chunk[chunk.size - frames * frame :].astype(np.float32, copy=False)
    energy = np.square(region).reshape(frames, frame).mean(axis=1)
    latest_quietest = frames - 1 - int(np.argmin(energy[::-1]))
    if latest_quietest == frames - 1:
        return chunk.size
    return chunk.size - frames * frame + latest_quietest * frame + frame // 2


DECODERS = {"image": decode_image, "audio": decode_audio, "video": decode_video}


def decode_media(modality: str, source: Source, limits: DecodeLimits) -> DecodedMedia:
    """The decoder of a media modality (image, audio, video)."""
    return DECODERS[modality](source, limits)
