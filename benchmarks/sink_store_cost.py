"""What the sink's own work costs per job, without Kafka: the SinkStage's handle (decode the
prediction, store the part and assemble the result in a group commit, encode the result) and
after_send (the publication mark, a second group commit), on a real SQLite store in a temp
folder, for predictions handled one at a time and four at a time (an inference batch's answers
arrive together at saturation, and their store calls share transactions). CPU of the whole
process (the loop and the store's thread) per job, from time.process_time. Set beside the sink
process's CPU per job in `mmpipe bench`, it says how much of that is Kafka, faust and the loop.

    .venv/bin/python benchmarks/sink_store_cost.py [--jobs 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry

from mmpipe.schemas import Prediction, to_json
from mmpipe.schemas.events import ModelRef
from mmpipe.schemas.settings import Settings
from mmpipe.stages.sink.stage import SinkStage
from mmpipe.streams.metrics import StageMetrics
from mmpipe.streams.stage import Incoming


def prediction_message(stage: SinkStage, offset: int) -> Incoming:
    """An image job's one prediction, as the inference stage sends it (top-5 output, a trace)."""
    now = time.time()
    trace = {"decode_in": now, "decode_out": now, "inference_in": now, "batch_start": now, "batch_end": now}
    prediction = Prediction(
        job_id=f"job-{uuid.uuid4().hex}", part=0, parts=1, kind="image", modality="image",
        model=ModelRef("resnet18", "imagenet1k-v1"), status="ok", created_at=now, trace=trace,
        output={"top5": [{"label": f"class {k}", "p": 0.1} for k in range(5)]}, meta={"batch_size": 4},
        weights="random",
    )
    return Incoming(topic=stage.topics.predictions, partition=offset % 4, offset=offset,
                    key=prediction.job_id.encode(), value=to_json(prediction), timestamp=0, received_at=now)


async def handle_all(stage: SinkStage, messages: list[Incoming], together: int) -> None:
    async def one(message: Incoming) -> None:
        await stage.after_send(await stage.handle(message))

    for start in range(0, len(messages), together):
        await asyncio.gather(*(one(m) for m in messages[start:start + together]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    settings = Settings(store_url=f"sqlite:///{folder / 'results.db'}", state_dir=folder)
    stage = SinkStage(settings, StageMetrics("sink", CollectorRegistry()))
    stage.setup()
    print(f"SinkStage handle + after_send on SQLite ({folder}), {args.jobs} image jobs per line, one prediction each:")
    for together in (1, 4, 1, 4):  # twice each, alternating: the second pair says how steady the first is
        messages = [prediction_message(stage, i) for i in range(args.jobs)]
        cpu, wall = time.process_time(), time.monotonic()
        asyncio.run(handle_all(stage, messages, together))
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        print(f"  {together} at a time: {cpu / args.jobs * 1000:.3f} ms CPU per job, {wall / args.jobs * 1000:.3f} ms wall")


if __name__ == "__main__":
    main()
