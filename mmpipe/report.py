"""Terminal output: results, the stage breakdown of their latency, and consumer lag."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from mmpipe.settings import Settings
from schemas import JobResult
from streams.kafka import STAGE_GROUPS, LagReader, group_id, stage_input_topics

BREAKDOWN = (
    ("queue", ("queue_decode_ms", "queue_preprocess_ms", "queue_inference_ms", "queue_sink_ms")),
    ("decode", ("decode_ms",)),
    ("prep", ("preprocess_ms",)),
    ("batch wait", ("batch_wait_ms",)),
    ("execute", ("execute_ms",)),
    ("sink", ("sink_ms",)),
)


def summarize(result: JobResult) -> str:
    """One line a person can read: the top label, the speech found, the embedding's size."""
    p = result.prediction
    if result.status != "ok":
        return f"{(result.error or {}).get('code', result.status)}: {(result.error or {}).get('message', '')[:80]}"
    if result.modality == "image":
        top = p["labels"][0]
        return f"{top['label']} ({top['p']:.2f})"
    if result.modality == "text":
        return f"{p['dim']}-d embedding of {p['tokens']} tokens, first {p['embedding'][:3]}"
    if result.modality == "audio":
        return _speech(p)
    frames = p["frames"]
    labels = ", ".join(f"{f['t_s']:.0f}s:{f['labels'][0]['label']}" for f in frames[:3])
    audio = _speech(p["audio"]) if p.get("audio") else "no audio track"
    return f"{len(frames)} frames [{labels}{'...' if len(frames) > 3 else ''}]; {audio}"


def _speech(p: dict[str, Any]) -> str:
    segs = " ".join(f"{s['start_s']:.1f}-{s['end_s']:.1f}s" for s in p["segments"][:4])
    more = "..." if len(p["segments"]) > 4 else ""
    return f"speech {p['speech_s']:.1f}s of {p['duration_s']:.1f}s: {segs}{more}"


def results_table(results: list[JobResult]) -> Table:
    table = Table(title="results (times in ms)")
    for col in ("job", "status", "model", "weights", "prediction", "e2e"):
        table.add_column(col, overflow="fold")
    for name, _ in BREAKDOWN:
        table.add_column(name, justify="right")
    table.add_column("batch", justify="right")
    for r in results:
        t = r.timings
        model = f"{r.model.name}:{r.model.version}" if r.model else "-"
        row = [r.job_id, r.status, model, r.weights, summarize(r), f"{t.end_to_end_ms:.0f}"]
        row += [f"{sum(getattr(t, f) for f in fields):.0f}" for _, fields in BREAKDOWN]
        row.append(str(t.batch_size or "-"))
        table.add_row(*row)
    return table


def print_result(console: Console, result: JobResult) -> None:
    console.print(results_table([result]))


async def lag_table(settings: Settings) -> Table:
    reader = LagReader(settings)
    table = Table(title=f"consumer lag on {settings.bootstrap}")
    for col in ("group", "topic", "partition", "end offset", "committed", "lag"):
        table.add_column(col, justify="right" if col in ("partition", "end offset", "committed", "lag") else "left")
    try:
        for stage in STAGE_GROUPS:
            rows = await reader.read(group_id(settings, stage), stage_input_topics(settings, stage))
            for row in rows:
                committed = "-" if row.committed is None else str(row.committed)
                table.add_row(row.group, row.topic, str(row.partition), str(row.end_offset), committed, str(row.lag))
    finally:
        await reader.close()
    return table
