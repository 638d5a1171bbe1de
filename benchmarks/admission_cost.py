"""What a stage's backpressure bookkeeping costs per message: the partition gate's count in and
out, the admission's count of what was sent, and its re-decision of which input partitions to
hold, as MessageDelivery runs them for every message (streams/delivery.py), with real
prometheus gauges and four assigned partitions. Two states: the next stage keeping up (nothing
held) and lagging (every partition held), with a read-out of the next stage's lag every
`--per-read-out` messages (the lag interval, 0.5 s, at 20 jobs/s: 10). The gate's pause
callback is a counter here, so the consumer's own pause work (faust and aiokafka) is not in the
times, only in the pause count.

    .venv/bin/python benchmarks/admission_cost.py [--messages 20000] [--compare-with TREE]

--compare-with runs the same measurement on another checkout (a folder whose `mmpipe` package
is imported first, e.g. a `git worktree` of an earlier commit laid out as the installed package)
in a subprocess right after this one, and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import namedtuple

TP = namedtuple("TP", "topic partition")
PARTITIONS = [TP("mm.events", p) for p in range(4)]


def measure(messages: int, lag: int, per_read_out: int) -> dict[str, float]:
    from prometheus_client import CollectorRegistry

    from mmpipe.streams.admission import DownstreamAdmission
    from mmpipe.streams.backpressure import PartitionGate
    from mmpipe.streams.metrics import StageMetrics

    pauses = [0]
    gate = PartitionGate(high=8, low=4, max_total=64, pause=lambda tps: pauses.__setitem__(0, pauses[0] + 1),
                         resume=lambda tps: None, metrics=StageMetrics("decode", CollectorRegistry()))
    admission = DownstreamAdmission(high=16, low=8, aging_s=1.0, gate=gate, assigned=lambda: PARTITIONS,
                                    shedding=lambda: False)

    async def one_message_at_a_time() -> float:
        started = time.perf_counter()
        for offset in range(messages):
            if offset % per_read_out == 0:
                admission.update({tp.partition: lag for tp in PARTITIONS})
            tp = PARTITIONS[offset % len(PARTITIONS)]
            await gate.acquire(tp)
            admission.count_sent([tp.partition])
            admission.release(tp.partition, offset, topic=tp.topic)
            gate.release(tp)
            admission.refresh()
        return time.perf_counter() - started

    elapsed = asyncio.run(one_message_at_a_time())
    return {"us_per_message": 1e6 * elapsed / messages, "pauses_per_message": pauses[0] / messages}


def run(messages: int, per_read_out: int) -> dict[str, dict[str, float]]:
    return {"keeping up": measure(messages, 0, per_read_out), "lagging": measure(messages, 1000, per_read_out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--per-read-out", type=int, default=10)
    parser.add_argument("--compare-with", help="another tree to measure in the same run")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the subprocess's output
    args = parser.parse_args()
    here = run(args.messages, args.per_read_out)
    if args.json:
        print(json.dumps(here))
        return
    there = None
    if args.compare_with:
        env = {**os.environ, "PYTHONPATH": args.compare_with}
        out = subprocess.run([sys.executable, __file__, "--messages", str(args.messages),
                              "--per-read-out", str(args.per_read_out), "--json"],
                             env=env, check=True, capture_output=True, text=True).stdout
        there = json.loads(out)
    for state, figures in here.items():
        line = f"{state:>10}: {figures['us_per_message']:6.1f} us and {figures['pauses_per_message']:.2f} pauses per message"
        if there is not None:
            other = there[state]
            line += (f"; {args.compare_with}: {other['us_per_message']:6.1f} us and {other['pauses_per_message']:.2f}"
                     f" pauses (this / that {figures['us_per_message'] / other['us_per_message']:.2f})")
        print(line)


if __name__ == "__main__":
    main()
