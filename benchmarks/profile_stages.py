"""Where each stage process spends its CPU at saturation: py-spy samples every stage process
(and the bench's own client) during a flood of image jobs, and this prints, per process, the
functions with the most samples (self time) and the project's functions with the most samples
anywhere below them (inclusive time). Idle threads are left out by py-spy's own test, which
still counts a thread just woken in epoll as active: the shares overstate event-loop waiting
and are not CPU time (the CPU ms per job beside each table are, from /proc).

With `--gil` py-spy samples only the thread holding the GIL: the shares are then of the time the
process runs Python (its own code and the libraries'), and the samples per second say how much
of a core that is; CPU that releases the GIL (socket writes, pickling pipes, native decoders,
the kernel) is left out. Beside each table: user and system CPU ms per job from /proc, the
process and its children together (decode's PyAV workers), and the process alone.

Read it to find what to cut; measure a cut with `mmpipe bench --scenario efficiency`, not here
(py-spy's sampling costs each process a little CPU of its own).

    pip install py-spy   # not a project dependency
    .venv/bin/python benchmarks/profile_stages.py [--jobs 300] [--outstanding 32] [--top 12] [--gil]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from mmpipe.harness.bench import traffic
from mmpipe.harness.bench.pipeline_run import BenchPipeline, Policy
from mmpipe.harness.bench.resources import ResourceSampler, tree_cpu_times
from mmpipe.harness.bench.workload import Workload
from mmpipe.schemas.settings import load_settings
from mmpipe.streams.broker import free_port_block
from mmpipe.supervisor import METRICS_PORT_SPAN

PROJECT_DIRS = ("mmpipe/", "streams/", "stages/", "models/", "schemas/")  # py-spy prints paths short


def parse_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) format: `frame;frame;...;leaf count` per line, root first."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def short(frame: str) -> str:
    """`func (path/to/file.py:line)` -> `func (file.py)`: one row per function, not per line."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(Path(file).parts[-2:])})"


def summarise(stacks: list[tuple[list[str], int]]) -> tuple[int, collections.Counter, collections.Counter]:
    total = sum(count for _, count in stacks)
    self_time: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    for frames, count in stacks:
        self_time[short(frames[-1])] += count
        for frame in {short(f) for f in frames if f.partition(" (")[2].startswith(PROJECT_DIRS)}:
            inclusive[frame] += count
    return total, self_time, inclusive


def cpu_times(pid: int) -> dict[str, float]:
    """User and system CPU seconds of a process, alone and with its descendants."""
    proc = psutil.Process(pid)
    own = proc.cpu_times()
    tree_user, tree_system = tree_cpu_times(proc)
    return {"user": own.user, "system": own.system, "tree_user": tree_user, "tree_system": tree_system}


def split_line(before: dict[str, float], after: dict[str, float], jobs: int) -> str:
    ms = {key: 1000 * (after[key] - before[key]) / jobs for key in after}
    return (f"user / system CPU ms per job: {ms['tree_user']:.1f} / {ms['tree_system']:.1f} with children, "
            f"{ms['user']:.1f} / {ms['system']:.1f} the process alone")


def print_process(console: Console, name: str, path: Path, top: int, cpu_ms_per_job: float,
                  what: str = "samples of active threads", split: str = "") -> None:
    total, self_time, inclusive = summarise(parse_collapsed(path))
    if not total:
        console.print(f"{name}: no samples")
        return
    table = Table(title=f"{name}: {total} {what}, {cpu_ms_per_job:.1f} CPU ms per job" + (f"\n{split}" if split else ""))
    table.add_column("self %", justify="right")
    table.add_column("leaf function")
    table.add_column("incl %", justify="right")
    table.add_column("project function (inclusive)")
    rows_self, rows_incl = self_time.most_common(top), inclusive.most_common(top)
    for i in range(top):
        s = rows_self[i] if i < len(rows_self) else ("", 0)
        c = rows_incl[i] if i < len(rows_incl) else ("", 0)
        table.add_row(f"{100 * s[1] / total:.1f}" if s[0] else "", s[0], f"{100 * c[1] / total:.1f}" if c[0] else "", c[0])
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--outstanding", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL (Python CPU)")
    parser.add_argument("--samples", type=Path, help="print the tables of an earlier run's folder of samples instead")
    args = parser.parse_args()
    if args.samples:
        for path in sorted(args.samples.glob("*.txt")):
            print_process(Console(width=200), path.stem, path, args.top, float("nan"))
        return
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    console = Console(width=200)
    workdir = Path(tempfile.mkdtemp(prefix="profile-stages-"))
    settings = load_settings().model_copy(update=dict(
        topic_prefix=f"prof{uuid.uuid4().hex[:8]}", store_url=f"sqlite:///{workdir / 'results.db'}",
        input_roots=[workdir / "media"], allow_random_weights=True, device="cpu", torch_threads=1,
        models=["resnet18"], metrics_host="127.0.0.1", log_level="warn"))
    sampler = ResourceSampler().start()
    sampler.watch("bench", os.getpid())
    bench = BenchPipeline(settings, workdir / "run", "resnet18", {}, sampler, free_port_block(METRICS_PORT_SPAN))
    work = Workload.prepare(workdir / "media", {"image"})
    try:
        bench.start(Policy("dynamic", args.max_batch, 40.0))
        bench.run(traffic.flood(4 * args.max_batch), work, "warm", timeout_s=120, outstanding=args.max_batch)
        time.sleep(2)
        targets = {p.name: p.process.pid for p in bench.pipeline.processes if p.alive()}
        spies = {name: subprocess.Popen(
            [py_spy, "record", "-p", str(pid), "-r", str(args.rate), "-f", "raw", "-o", str(workdir / f"{name}.txt"),
             "--threads", "--nonblocking", *(["--gil"] if args.gil else [])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets.items()}
        time.sleep(2)  # py-spy attached
        before = {name: cpu_times(pid) for name, pid in targets.items()}
        data = bench.run(traffic.flood(args.jobs, "image", args.seed), work, "flood", timeout_s=300,
                         outstanding=args.outstanding)
        after = {name: cpu_times(pid) for name, pid in targets.items()}
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples and exits
        for spy in spies.values():
            spy.wait(30)
    finally:
        bench.stop()
        sampler.stop()
    wall = data.resources["wall_s"]
    ok = sum(1 for r in data.results if r.status == "ok")
    console.print(f"flood: {ok}/{data.published} ok in {wall:.1f} s ({data.published / wall:.1f} jobs/s)")
    what = f"samples holding the GIL at {args.rate}/s" if args.gil else "samples of active threads"
    for name in sorted(targets):
        cores = data.resources["cpu_cores"].get(name, 0.0)
        print_process(console, name, workdir / f"{name}.txt", args.top, 1000 * cores * wall / data.published,
                      what, split_line(before[name], after[name], data.published))


if __name__ == "__main__":
    main()
