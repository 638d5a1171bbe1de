"""The end-to-end demo: real media (a video with a spoken audio track, an image, a speech clip,
a text) through the real pipeline on the embedded broker, results read from the results topic;
the video's spoken track comes back as text (Whisper tiny.en)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from mmpipe.client import Publisher, collect_results, make_event
from mmpipe.report import fitted, results_table
from mmpipe.schemas.settings import Settings
from mmpipe.supervisor import Pipeline
from mmpipe.schemas import JobResult, MediaEvent

DEMO_TEXTS = [
    "Streaming inference turns a model into a service that must behave under real traffic.",
    "The batcher stops waiting when the batch is full or the oldest request has waited long enough.",
    "Every result is written once per job id, so a redelivered message never doubles it.",
]


def make_demo_media(directory: Path) -> dict[str, Path]:
    """Write the demo's media files once (speech via espeak-ng, video and image via PyAV)."""
    from mmpipe.stages.decode import samples

    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "video": directory / "talking-scene.mp4",
        "image": directory / "scene.png",
        "audio": directory / "speech.wav",
    }
    if not all(path.exists() for path in files.values()):
        speech = samples.speech_pcm()
        files["audio"].write_bytes(samples.encode_audio(speech))
        # The video lasts as long as its spoken track, so the whole sentence can come back as text.
        files["video"].write_bytes(samples.encode_video(seconds=speech.size / 16_000, width=640, height=360, audio=speech))
        files["image"].write_bytes(samples.encode_image(samples.synthetic_picture(640, 480, seed=3)))
    return files


def demo_events(count: int, directory: Path, deadline_s: float | None = None) -> list[MediaEvent]:
    files = make_demo_media(directory)
    order = ["video", "image", "audio", "text"]
    events = []
    for i in range(count):
        modality = order[i % len(order)]
        job_id = f"demo-{modality}-{i}-{int(time.time() * 1000) % 10**8}"
        if modality == "text":
            events.append(make_event("text", text=DEMO_TEXTS[i % len(DEMO_TEXTS)], job_id=job_id, deadline_s=deadline_s))
        else:
            events.append(make_event(modality, uri=str(files[modality].resolve()), job_id=job_id, deadline_s=deadline_s))
    return events


@dataclass(frozen=True)
class DemoRun:
    """The demo's jobs in the order published and the results that came back for them."""

    events: list[MediaEvent]
    results: dict[str, JobResult]
    timeout_s: float

    def in_order(self) -> list[JobResult]:
        return [self.results[e.job_id] for e in self.events if e.job_id in self.results]

    def missing(self) -> list[str]:
        return [e.job_id for e in self.events if e.job_id not in self.results]

    def ok(self) -> bool:
        return not self.missing() and all(r.status == "ok" for r in self.results.values())


def run_demo(settings: Settings, jobs: int, timeout_s: float, console: Console) -> DemoRun:
    """Start the pipeline, publish the demo's jobs and wait for their results; `console` shows
    the progress."""
    with console.status("making demo media (espeak-ng speech, H.264 video, PNG image)..."):
        make_demo_media(settings.state_path("demo"))
    with console.status("starting the embedded broker and the four stages..."):
        started = time.monotonic()
        pipeline = Pipeline(settings.model_copy(update={"bootstrap": "127.0.0.1:0"}), workdir=settings.state_path("run", "demo")).start()
    console.print(f"pipeline up on {pipeline.settings.bootstrap} in {time.monotonic() - started:.1f}s "
                  f"(logs in {pipeline.workdir})")
    events = demo_events(jobs, settings.state_path("demo"))
    try:
        results = asyncio.run(_publish_and_collect(pipeline.settings, events, timeout_s, console))
    finally:
        with console.status("stopping..."):
            pipeline.stop()
    return DemoRun(events, results, timeout_s)


def print_demo(run: DemoRun, settings: Settings, console: Console) -> None:
    """The results table, what the video's speech came back as, and a word on random weights."""
    console.print(fitted(console, results_table(run.in_order())))
    _print_spoken_track(run.results, console)
    if any(r.weights == "random" for r in run.results.values()):
        console.print("[yellow]note:[/] resnet18 ran with RANDOM weights (no ImageNet weights on this machine:"
                      f" put resnet18-f37072fd.pth in {settings.weights_dir}); its labels are meaningless, its timings real.")


def print_missing(run: DemoRun, console: Console) -> None:
    missing = run.missing()
    if missing:
        console.print(f"[red]no result within {run.timeout_s:.0f}s for: {', '.join(missing)}[/]")


def _print_spoken_track(results: dict, console: Console) -> None:
    from mmpipe.stages.decode.samples import SPEECH_TEXT

    video = next((r for r in results.values() if r.modality == "video" and r.status == "ok"), None)
    transcript = ((video.prediction or {}).get("audio") or {}).get("transcript") if video else None
    if transcript is not None:
        console.print(f"the video's spoken track, as text ({transcript['model']}, weights {transcript['weights']}):\n"
                      f"  heard:  {transcript['text']!r}\n  spoken: {SPEECH_TEXT!r}")


async def _publish_and_collect(settings: Settings, events: list[MediaEvent], timeout_s: float, console: Console) -> dict:
    async with Publisher(settings) as publisher:
        await publisher.publish_many(events)
    wanted = {e.job_id for e in events}
    with Progress(TextColumn("results"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("results", total=len(wanted))
        return await collect_results(settings, wanted, timeout_s, on_result=lambda _: progress.advance(task))
