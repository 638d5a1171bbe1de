"""Kafka requests per image job on the embedded broker, by client (stage process) and API.

The broker's CPU per job is mostly the requests around each record, not its bytes
(benchmarks/hop_latency.py); this says which requests they are. A counting proxy sits in front
of Tansu (the broker advertises the proxy, so every client's connection after bootstrap goes
through it) and reads each request's header: its API key and the client ID, which names the
stage (`mmpipe-decode`, ...). The whole pipeline (resnet18 with random weights; only counts are
measured) runs three windows, each counted from the same proxy:
  idle   : no jobs, `--idle` seconds; requests per second
  load   : Poisson arrivals at `--rate` jobs/s; requests per job
  flood  : `--jobs` jobs, `--outstanding` unanswered at a time (saturation); requests per job
with the broker's CPU per job beside the counts. The proxy costs CPU and latency of its own, so
this script's latencies and throughput are not the pipeline's: read counts here, times in
`mmpipe bench`.

    .venv/bin/python benchmarks/broker_requests.py [--rate 10] [--jobs 200] [--idle 20]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import struct
import tempfile
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mmpipe.harness.bench import traffic
from mmpipe.harness.bench.pipeline_run import BenchPipeline, Policy
from mmpipe.harness.bench.resources import ResourceSampler
from mmpipe.harness.bench.workload import Workload
from mmpipe.schemas.settings import load_settings
from mmpipe.streams.broker import EmbeddedBroker, free_port, free_port_block
from mmpipe.supervisor import METRICS_PORT_SPAN

# Kafka API keys (the protocol's numbering) the pipeline's clients send.
API_NAMES = {
    0: "Produce", 1: "Fetch", 2: "ListOffsets", 3: "Metadata", 8: "OffsetCommit", 9: "OffsetFetch",
    10: "FindCoordinator", 11: "JoinGroup", 12: "Heartbeat", 13: "LeaveGroup", 14: "SyncGroup",
    15: "DescribeGroups", 16: "ListGroups", 18: "ApiVersions", 19: "CreateTopics", 32: "DescribeConfigs",
}
Counts = dict[tuple[str, str], list[int]]  # (client, api) -> [requests, request bytes]


# The proxy (a child process) --------------------------------------------------------------------
def request_header(frame: bytes) -> tuple[str, str]:
    """(client ID, API name) of one request frame (without its size prefix). Every request
    header version starts api_key int16, api_version int16, correlation_id int32, client_id
    as an int16-length nullable string (flexible versions keep it non-compact)."""
    api_key, = struct.unpack_from(">h", frame, 0)
    length, = struct.unpack_from(">h", frame, 8)
    client = frame[10:10 + length].decode(errors="replace") if length >= 0 else "-"
    return client, API_NAMES.get(api_key, f"api{api_key}")


async def forward_requests(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counts: Counts) -> None:
    while True:
        head = await reader.readexactly(4)
        frame = await reader.readexactly(struct.unpack(">i", head)[0])
        entry = counts.setdefault(request_header(frame), [0, 0])
        entry[0] += 1
        entry[1] += 4 + len(frame)
        writer.write(head + frame)
        await writer.drain()


async def forward_bytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(1 << 16):
        writer.write(chunk)
        await writer.drain()


async def proxy(listen_port: int, broker_port: int, control: Connection) -> None:
    counts: Counts = {}

    async def connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", broker_port)
        pumps = [asyncio.ensure_future(forward_requests(client_reader, broker_writer, counts)),
                 asyncio.ensure_future(forward_bytes(broker_reader, client_writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        for writer in (client_writer, broker_writer):
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", listen_port)
    control.send("listening")
    async with server:
        while True:  # answer snapshot requests from the parent
            await asyncio.sleep(0.05)
            if control.poll():
                control.recv()
                control.send({key: list(value) for key, value in counts.items()})


def run_proxy(listen_port: int, broker_port: int, control: Connection) -> None:
    asyncio.run(proxy(listen_port, broker_port, control))


# The run ---------------------------------------------------------------------------------------
class CountingProxy:
    def __init__(self, listen_port: int, broker_port: int) -> None:
        self._control, child = multiprocessing.Pipe()
        self.process = multiprocessing.Process(target=run_proxy, args=(listen_port, broker_port, child), daemon=True)
        self.process.start()
        assert self._control.recv() == "listening"

    def snapshot(self) -> Counts:
        self._control.send("snapshot")
        return self._control.recv()


def difference(after: Counts, before: Counts) -> Counts:
    return {key: [a - b for a, b in zip(value, before.get(key, [0, 0]))] for key, value in after.items()
            if value[0] - before.get(key, [0, 0])[0] > 0}


def short_client(client: str) -> str:
    return client.removeprefix("mmpipe-") if client.startswith("mmpipe-") else "bench"


Window = tuple[Counts, float]  # requests by (client, api) in one window, and its divisor


def per_unit(window: Window) -> collections.Counter:
    counts, divisor = window
    out: collections.Counter = collections.Counter()
    for (client, api), (requests, _) in counts.items():
        out[(short_client(client), api)] += requests / divisor
    return out


def print_tables(console: Console, windows: dict[str, Window], cpu: dict[str, dict[str, float]]) -> None:
    """A row per (client, API), a column per window: requests per second idle, per job under
    load; then each client's total, then each process's CPU per second idle and per job."""
    rates = {name: per_unit(window) for name, window in windows.items()}
    keys = sorted({key for rate in rates.values() for key in rate})
    table = Table(title="Kafka requests by client and API (one run, through the counting proxy): per s idle, per job else")
    table.add_column("client")
    table.add_column("API")
    for name in windows:
        table.add_column(name, justify="right")
    for key in keys:
        table.add_row(*key, *(f"{rates[name][key]:.2f}" for name in windows))
    for client in sorted({k[0] for k in keys}):
        table.add_row(client, "all", *(f"{sum(v for k, v in rates[name].items() if k[0] == client):.2f}" for name in windows),
                      style="dim")
    table.add_row("all", "all", *(f"{sum(rates[name].values()):.2f}" for name in windows), style="bold")
    console.print(table)
    cpu_table = Table(title="CPU of each process: ms per second idle, ms per job else")
    cpu_table.add_column("process")
    for name in windows:
        cpu_table.add_column(name, justify="right")
    for process in sorted({p for c in cpu.values() for p in c}):
        cpu_table.add_row(process, *(f"{cpu[name].get(process, 0.0):.1f}" for name in windows))
    console.print(cpu_table)


def measure(bench: BenchPipeline, proxy: CountingProxy, sampler: ResourceSampler, work: Workload, label: str,
            args: argparse.Namespace, console: Console, windows: dict[str, Window], cpu: dict[str, dict[str, float]]) -> None:
    """The three windows on the running pipeline, recorded under `label`."""
    bench.run(traffic.flood(2 * args.max_batch), work, f"{label}-warm", timeout_s=120, outstanding=args.max_batch)
    time.sleep(3)  # the warm-up's stragglers (commits, status flushes) before the idle window
    before = proxy.snapshot()
    sampler.begin()
    time.sleep(args.idle)
    resources = sampler.end()
    windows[f"{label} idle"] = (difference(proxy.snapshot(), before), args.idle)
    cpu[f"{label} idle"] = {name: 1000 * cores for name, cores in resources["cpu_cores"].items()}
    for name, schedule, outstanding in (
        ("load", traffic.poisson(args.rate, args.seconds, args.seed), 0),
        ("flood", traffic.flood(args.jobs, "image", args.seed), args.outstanding),
    ):
        before = proxy.snapshot()
        data = bench.run(schedule, work, f"{label}-{name}", timeout_s=300, outstanding=outstanding)
        time.sleep(1)  # commits and status flushes of the window's last jobs
        windows[f"{label} {name}"] = (difference(proxy.snapshot(), before), data.published)
        wall = data.resources["wall_s"]
        cpu[f"{label} {name}"] = {p: 1000 * cores * wall / data.published for p, cores in data.resources["cpu_cores"].items()}
        ok = sum(1 for r in data.results if r.status == "ok")
        e2e = sorted(r.completed_at - r.created_at for r in data.results)
        p50 = 1000 * e2e[len(e2e) // 2] if e2e else float("nan")
        console.print(f"{label} {name}: {ok}/{data.published} ok in {wall:.1f} s "
                      f"({data.published / wall:.1f} jobs/s, e2e p50 {p50:.0f} ms through the proxy)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    parser.add_argument("--rate", type=float, default=5.0, help="jobs/s of the Poisson window")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the Poisson window")
    parser.add_argument("--jobs", type=int, default=200, help="jobs of the flood window")
    parser.add_argument("--outstanding", type=int, default=32, help="unanswered jobs at a time in the flood")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    console = Console(width=200)
    workdir = Path(tempfile.mkdtemp(prefix="broker-requests-"))
    proxy_port, broker_port = free_port(), free_port()
    proxy = CountingProxy(proxy_port, broker_port)
    broker = EmbeddedBroker(port=broker_port, advertised_port=proxy_port, log_path=workdir / "broker.log")
    broker.start()
    settings = load_settings().model_copy(update=dict(
        bootstrap=f"127.0.0.1:{proxy_port}", topic_prefix=f"req{uuid.uuid4().hex[:8]}",
        store_url=f"sqlite:///{workdir / 'results.db'}", input_roots=[workdir / "media"],
        allow_random_weights=True, device="cpu", torch_threads=1, models=["resnet18"],
        metrics_host="127.0.0.1", log_level="warn", client_id="mmpipe", fetch_wakeups=True))
    sampler = ResourceSampler().start()
    for name, pid in (("broker", broker.process.pid), ("bench", os.getpid()), ("proxy", proxy.process.pid)):
        sampler.watch(name, pid)
    bench = BenchPipeline(settings, workdir / "run", "resnet18", {}, sampler, free_port_block(METRICS_PORT_SPAN))
    bench.pipeline.embedded_broker = False
    work = Workload.prepare(workdir / "media", {"image"})
    windows: dict[str, Window] = {}
    cpu: dict[str, dict[str, float]] = {}
    try:
        policy = Policy("dynamic", args.max_batch, 40.0)
        bench.start(policy)
        measure(bench, proxy, sampler, work, "wake-ups", args, console, windows, cpu)
        # The same pipeline polling: every stage restarted on fresh topics (the broker's cost
        # per request grows with what a partition holds: benchmarks/broker_log_growth.py).
        bench.pipeline.settings = bench.settings.model_copy(update={"fetch_wakeups": False})
        bench.fresh_topics(policy)
        measure(bench, proxy, sampler, work, "polling", args, console, windows, cpu)
    finally:
        bench.stop()
        broker.stop()
        sampler.stop()
        proxy.process.terminate()
    print_tables(console, windows, cpu)


if __name__ == "__main__":
    main()
