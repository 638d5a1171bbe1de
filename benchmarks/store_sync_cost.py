"""What synchronous=FULL costs the SQLite store against NORMAL: transactions per second of the
sink's unit of work (record_part + its group commit), one run, same disk, printed as a ratio.

    .venv/bin/python benchmarks/store_sync_cost.py [--jobs 2000] [--group 1]
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

from mmpipe.schemas import ModelRef, Prediction
from mmpipe.stages.sink.stage import assemble
from mmpipe.stages.sink.store.sqlite import SqliteStore


class _Store(SqliteStore):
    def __init__(self, url: str, synchronous: str) -> None:
        super().__init__(url)
        self.synchronous = synchronous

    def _connection(self) -> sqlite3.Connection:
        conn = super()._connection()
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        return conn


def run(synchronous: str, jobs: int, group: int, folder: Path) -> float:
    store = _Store(f"sqlite:///{folder / f'{synchronous}.db'}", synchronous)
    store.init_schema()
    predictions = [
        Prediction(job_id=f"job-{i}", part=0, parts=1, kind="text", modality="text", model=ModelRef("m", "1"),
                   status="ok", created_at=time.time(), trace={}, output={"embedding": [0.1] * 384})
        for i in range(jobs)
    ]
    started = time.perf_counter()
    for start in range(0, jobs, group):
        store.run_group([(store.record_part, (p, assemble)) for p in predictions[start : start + group]])
    elapsed = time.perf_counter() - started
    store.close()
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--group", type=int, default=1, help="store calls per transaction (the sink's group commit)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        rates = {mode: run(mode, args.jobs, args.group, Path(tmp)) for mode in ("NORMAL", "FULL")}
    print(f"jobs={args.jobs} group={args.group}: NORMAL {rates['NORMAL']:.0f} jobs/s, FULL {rates['FULL']:.0f} jobs/s, "
          f"FULL/NORMAL = {rates['FULL'] / rates['NORMAL']:.2f}")


if __name__ == "__main__":
    main()
