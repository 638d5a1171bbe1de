"""What one decoder step of Whisper tiny.en (real packaged weights) costs as the number of
active rows grows, at two positions: the curve continuous batching lives on. One run, CPU.

    .venv/bin/python benchmarks/whisper_step_cost.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from mmpipe.models.whisper import WhisperSpec

ROWS = (1, 2, 4, 8, 16)
POSITIONS = (10, 60)
STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = WhisperSpec().load("cpu", "", False)
    torch.set_num_threads(args.threads)  # after loading: silero_vad's import sets 1 for the process
    model.reserve_cache(max(ROWS) * model.bytes_per_sequence)
    decoder, cache = model.net.decoder, model.cache
    with torch.inference_mode():
        for rows in ROWS:
            tokens = torch.full((rows,), model.eot)
            for position in POSITIONS:
                positions = torch.full((rows,), position)
                for _ in range(3):
                    decoder.step(cache, tokens, positions)
                started = time.perf_counter()
                for _ in range(STEPS):
                    decoder.step(cache, tokens, positions)
                ms = (time.perf_counter() - started) / STEPS * 1000
                print(f"rows {rows:2d} position {position:3d}: {ms:6.1f} ms per step, {ms / rows:5.1f} ms per row, "
                      f"{rows / ms * 1000:6.0f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
