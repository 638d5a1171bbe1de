"""A corpus of hostile inputs, made on the spot: files that lie in their headers, bombs,
formats no decoder here may open, and junk. Each entry names the reasons it may end with.
Used by the tests (tests/test_hostile.py) and by the isolation-cost script
(benchmarks/decode_isolation.py)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import orjson

from mmpipe.schemas.codec import _HEADER, _MAGIC
from mmpipe.stages.decode import samples


@dataclass(frozen=True)
class Hostile:
    name: str
    modality: str
    data: bytes
    reasons: frozenset[str]  # what a refusal of it may say


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + kind + body + struct.pack("!I", zlib.crc32(kind + body))


def png_bomb(width: int = 16_000, height: int = 16_000, rows: int = 64) -> bytes:
    """An RGBA PNG whose header claims width x height; `rows` rows of zeros follow (a few KB)."""
    header = struct.pack("!IIBBBBB", width, height, 8, 6, 0, 0, 0)
    raw = (b"\0" + b"\0" * (width * 4)) * rows  # filter byte + pixels, per row
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(raw, 9)) + _png_chunk(b"IEND", b"")


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real small JPEG with its frame header (SOF0) patched to claim width x height."""
    data = bytearray(samples.encode_image(samples.synthetic_picture(64, 48), "jpeg"))
    sof = data.index(b"\xff\xc0")
    struct.pack_into("!HH", data, sof + 5, height, width)
    return bytes(data)


def wav_claiming_rate(rate: int) -> bytes:
    """A real WAV (one second of tone) whose header claims `rate` samples per second."""
    data = bytearray(samples.encode_audio(samples.tone_pcm(1.0), fmt="wav"))
    fmt = data.index(b"fmt ")
    struct.pack_into("<II", data, fmt + 12, rate, (rate * 2) & 0xFFFFFFFF)  # rate, byte rate
    return bytes(data)


def float_wav(values: np.ndarray, rate: int = 16_000) -> bytes:
    """A mono IEEE-float WAV (format 3) of exactly these samples: NaN and Inf included."""
    body = values.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body)) + body
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def avi_claiming_frames(frames: int) -> bytes:
    """A tiny real AVI (MJPEG, 16x16, 5 frames) whose headers claim `frames` frames."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="avi") as container:
        stream = container.add_stream("mjpeg", rate=25)
        stream.width, stream.height, stream.pix_fmt = 16, 16, "yuvj420p"
        for i in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), i * 40, np.uint8), format="rgb24")
            container.mux(stream.encode(frame.reformat(format="yuvj420p")))
        container.mux(stream.encode(None))
    data = bytearray(buf.getvalue())
    avih = data.index(b"avih")
    struct.pack_into("<I", data, avih + 8 + 16, frames)  # dwTotalFrames
    strh = data.index(b"strh")
    struct.pack_into("<I", data, strh + 8 + 32, frames)  # dwLength of the video stream
    return bytes(data)


def hls_playlist(segment_url: str) -> bytes:
    return (
        "#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:2\n#EXT-X-MEDIA-SEQUENCE:0\n"
        f"#EXTINF:2.0,\n{segment_url}\n#EXT-X-ENDLIST\n"
    ).encode()


def truncated(data: bytes, keep: float = 0.5) -> bytes:
    return data[: max(16, int(len(data) * keep))]


def work_item_of_unknown_lengths(job_id: str, tensors: int = 50, body_bytes: int = 100_000) -> bytes:
    """A work item (the binary format of `decoded` and `ready`) whose every tensor declares the
    shape [-1]: read naively, each would copy the rest of the message."""
    specs = [{"name": f"t{i}", "dtype": "uint8", "shape": [-1]} for i in range(tensors)]
    header = orjson.dumps({"job_id": job_id, "part": 0, "parts": 1, "kind": "image", "modality": "image",
                           "model": ["resnet18", "v1"], "created_at": 0.0, "deadline": 0.0, "trace": {},
                           "meta": {}, "tensors": specs})
    return _HEADER.pack(_MAGIC, len(header)) + header + bytes(body_bytes)


UNDECODABLE = frozenset({"undecodable_media"})
TOO_LARGE = frozenset({"image_too_large"})


def corpus(segment_url: str = "http://127.0.0.1:9/segment.ts") -> list[Hostile]:
    """Every hostile input that fits in a message (the FIFO and device files are made by the
    tests, under their input roots)."""
    rng = np.random.default_rng(13)
    png = samples.encode_image(samples.synthetic_picture(64, 48))
    wav = samples.encode_audio(samples.tone_pcm(1.0), fmt="wav")
    mp4 = samples.encode_video(seconds=1.0, width=64, height=48, fps=10, audio=samples.tone_pcm(1.0))
    entries: list[tuple[str, str, Callable[[], bytes], frozenset[str]]] = [
        ("png-bomb-16000x16000", "image", png_bomb, TOO_LARGE),
        ("jpeg-claiming-60000x60000", "image", lambda: jpeg_claiming(60_000, 60_000), TOO_LARGE | UNDECODABLE),
        ("wav-1hz", "audio", lambda: wav_claiming_rate(1), frozenset({"unsupported_sample_rate"})),
        ("wav-4ghz", "audio", lambda: wav_claiming_rate(4_000_000_000), frozenset({"unsupported_sample_rate"}) | UNDECODABLE),
        ("avi-claiming-1e6-frames", "video", lambda: avi_claiming_frames(1_000_000), frozenset({"video_too_long"})),
        ("hls-playlist", "video", lambda: hls_playlist(segment_url), UNDECODABLE),
        ("cdg-looking-png-garbage", "image", lambda: b"\x89PNG garbage" * 10, UNDECODABLE),
        ("tty-text", "video", lambda: b"\x1b[1;31mhello\x1b[0m world\r\n" * 40, UNDECODABLE),
        ("random-bytes", "image", lambda: rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), UNDECODABLE),
        ("truncated-png", "image", lambda: truncated(png), UNDECODABLE),
        ("truncated-wav-header", "audio", lambda: wav[:30], UNDECODABLE),
        ("truncated-mp4", "video", lambda: truncated(mp4), UNDECODABLE),
        ("video-as-image", "image", lambda: mp4, UNDECODABLE),
        ("float-wav-nan-inf", "audio", lambda: float_wav(np.tile(np.float32([np.nan, np.inf, -np.inf, 0.1]), 8000)), UNDECODABLE),
        ("png-8x100000", "image", lambda: samples.encode_image(np.zeros((100_000, 8, 3), np.uint8)), frozenset({"extreme_aspect_ratio"})),
    ]
    return [Hostile(name, modality, make(), reasons) for name, modality, make, reasons in entries]
