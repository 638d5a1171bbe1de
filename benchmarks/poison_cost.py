"""What the poison-message guard (streams/poison.py) costs per message: enter + leave (two
SQLite autocommits, WAL, synchronous=NORMAL) against an empty await, one run.

    flock /tmp/mmpipe-heavy.lock .venv/bin/python benchmarks/poison_cost.py [--messages 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from mmpipe.streams.poison import PoisonGuard


async def guarded(guard: PoisonGuard, messages: int) -> float:
    started = time.perf_counter()
    for offset in range(messages):
        await guard.enter("t.events", 0, offset)
        await guard.leave("t.events", 0, offset)
    return (time.perf_counter() - started) / messages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        guard = PoisonGuard(Path(tmp) / "poison.db", max_crashes=3)
        per_message = asyncio.run(guarded(guard, args.messages))
        guard.close()
    print(f"poison guard: {per_message * 1e6:.0f} us per message (enter + leave), {1 / per_message:.0f} messages/s on one core")


if __name__ == "__main__":
    main()
