"""How much one closed-loop saturation flood scatters: one pipeline (the bench's quick settings,
embedded broker), the headline flood several times in a row after the usual warm-up. Answers
whether the first flood after start-up is slower than later ones, or floods just scatter.

    .venv/bin/python benchmarks/flood_scatter.py [--floods 4] [--out /tmp/flood-scatter]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mmpipe.harness.bench import runner
from mmpipe.harness.bench.config import BenchConfig


class Floods(runner.Runner):
    """The bench's runner with its pipeline phase replaced by repeated headline floods."""

    floods = 4

    def pipeline_phase(self) -> None:
        self.start_pipeline()
        headline = self.policies["headline"]
        self.use(headline)
        self.out = []
        for i in range(self.floods):
            figures = self.closed_loop(headline, f"flood{i}", simulate_it=False)["stats"]
            alone = self.curve.throughput(max(1, round(figures["mean_batch"])))
            self.out.append((i, figures["throughput"], figures["mean_batch"], round(figures["throughput"] / alone, 3)))
            self.say(f"flood {i}: {figures['throughput']:.2f} jobs/s, mean batch {figures['mean_batch']}, "
                     f"/ model alone {figures['throughput'] / alone:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--floods", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("/tmp/flood-scatter"))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = BenchConfig.quick_preset(out_dir=args.out, device="cpu", scenarios=("poisson",))
    floods = Floods(cfg, runner.wide_console())
    floods.floods = args.floods
    floods.pipeline_phases({})
    print("RESULT", floods.out)


if __name__ == "__main__":
    main()
