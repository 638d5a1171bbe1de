#!/usr/bin/env python
"""The benchmark as a script: same options and code as `mmpipe bench`.

    python benchmarks/run_bench.py --quick
    python benchmarks/run_bench.py --device cuda --out bench-out/gpu
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not only an install

import typer  # noqa: E402

from mmpipe.harness.bench.command import bench  # noqa: E402

if __name__ == "__main__":
    typer.run(bench)
