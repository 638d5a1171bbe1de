"""Real media made on the spot with PyAV (and espeak-ng for speech): the demo's inputs, the
tests' fixtures and the benchmark's workload. Deterministic for a given seed."""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

SPEECH_TEXT = (
    "Hello. This is a short test of the streaming inference pipeline. "
    "The voice activity detector should find this speech."
)


def speech_pcm(text: str = SPEECH_TEXT, rate: int = 16_000, lead_s: float = 1.0, tail_s: float = 1.0) -> np.ndarray:
    """Spoken text (espeak-ng) between stretches of silence, as mono float32 PCM."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "speech.wav"
        subprocess.run([espeak, "-s", "150", "-w", str(wav), text], check=True, capture_output=True)
        pcm = _read_pcm(wav, rate)
    silence = lambda s: np.zeros(int(s * rate), dtype=np.float32)  # noqa: E731
    return np.concatenate([silence(lead_s), pcm, silence(tail_s)])


def tone_pcm(seconds: float = 2.0, freq: float = 440.0, rate: int = 16_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _read_pcm(path: Path, rate: int) -> np.ndarray:
    with av.open(str(path)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks = [out.to_ndarray().reshape(-1) for f in container.decode(audio=0) for out in resampler.resample(f)]
        chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    return np.concatenate(chunks).astype(np.float32)


def encode_audio(pcm: np.ndarray, rate: int = 16_000, fmt: str = "wav") -> bytes:
    """PCM -> a WAV (pcm_s16le), FLAC or Ogg/Opus file in memory."""
    codec = {"wav": "pcm_s16le", "flac": "flac", "ogg": "libopus"}[fmt]
    out_rate = 48_000 if fmt == "ogg" else rate
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=out_rate, layout="mono")
        _write_audio(container, stream, pcm, rate)
    return buf.getvalue()


def _write_audio(container: av.container.OutputContainer, stream: av.audio.stream.AudioStream, pcm: np.ndarray, rate: int) -> None:
    resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=stream.codec_context.sample_rate)
    step = 1024
    for start in range(0, pcm.size, step):
        frame = av.AudioFrame.from_ndarray(pcm[None, start : start + step].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        for resampled in resampler.resample(frame):
            container.mux(stream.encode(resampled))
    for resampled in resampler.resample(None):
        container.mux(stream.encode(resampled))
    container.mux(stream.encode(None))


def synthetic_picture(width: int = 640, height: int = 480, seed: int = 0, t: float = 0.0) -> np.ndarray:
    """A textured scene (gradients, moving discs, grain) - not a flat picture, so encoders and
    decoders do realistic work."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), dtype=np.float32)
    img[..., 0] = 127 + 100 * np.sin(x / 37.0 + t * 2.0)
    img[..., 1] = 127 + 100 * np.cos(y / 23.0 - t * 1.5)
    img[..., 2] = 127 + 100 * np.sin((x + y) / 51.0 + t)
    for k in range(6):
        cx = (0.5 + 0.4 * np.sin(t * (k + 1) * 0.7 + k)) * width
        cy = (0.5 + 0.4 * np.cos(t * (k + 1) * 0.5 + 2 * k)) * height
        r = (0.05 + 0.03 * k) * min(width, height)
        mask = (x - cx) ** 2 + (y - cy) ** 2 < r**2
        img[mask] = rng.integers(0, 255, 3)
    img += rng.normal(0, 18, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode_image(rgb: np.ndarray, fmt: str = "png") -> bytes:
    codec = {"png": "png", "jpeg": "mjpeg"}[fmt]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="image2pipe") as container:
        stream = container.add_stream(codec, rate=1)
        stream.width, stream.height = rgb.shape[1], rgb.shape[0]
        stream.pix_fmt = "rgb24" if fmt == "png" else "yuvj420p"
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        container.mux(stream.encode(frame if fmt == "png" else frame.reformat(format="yuvj420p")))
        container.mux(stream.encode(None))
    return buf.getvalue()


def encode_video(
    seconds: float = 4.0,
    width: int = 640,
    height: int = 360,
    fps: int = 25,
    bitrate: int = 1_000_000,
    audio: np.ndarray | None = None,
    audio_rate: int = 16_000,
    seed: int = 0,
) -> bytes:
    """H.264 (+ AAC when `audio` is given) in MP4, moving noisy content at a set bitrate."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        video.bit_rate = bitrate
        video.options = {"preset": "veryfast", "tune": "grain"}
        audio_stream = container.add_stream("aac", rate=44_100, layout="mono") if audio is not None else None
        frames = int(seconds * fps)
        base = synthetic_picture(width, height, seed)
        rng = np.random.default_rng(seed + 1)
        for i in range(frames):
            t = i / fps
            shift = int(t * 40) % width
            rgb = np.roll(base, shift, axis=1)
            rgb = np.clip(rgb.astype(np.int16) + rng.integers(-12, 12, rgb.shape, dtype=np.int16), 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if audio_stream is not None:
            _write_audio(container, audio_stream, audio, audio_rate)
    return buf.getvalue()


def corrupt(data: bytes, seed: int = 0) -> bytes:
    """Keep the first bytes (so the format is sniffed) and scramble the rest."""
    rng = np.random.default_rng(seed)
    head = data[:64]
    tail = rng.integers(0, 256, max(len(data) - 64, 256), dtype=np.uint8).tobytes()
    return head + tail
