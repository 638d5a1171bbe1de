"""What the job API's `published` bookkeeping costs a submit: POST /v1/jobs through the real app
(embedded broker, real store) as shipped — record the job, publish its event, stamp `accepted`
(the second store transaction) — against the same app with that stamp skipped, and both with a
transaction per write (before 2026-12-06) against group commit (shipped), in rounds in one run. Prints submits per second and CPU per submit (this process, which also runs the
HTTP client; the broker; the PostgreSQL server's processes when the store is PostgreSQL) for each variant, and the ratios of the medians.

    .venv/bin/python benchmarks/api_submit_cost.py [--jobs 600] [--concurrency 8] [--rounds 3] [--store-url URL]

Without --store-url the store is a SQLite file in a temporary folder. The variants exist only
here (StoreWorker.mark_accepted and .write patched); the product always stamps and groups.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from mmpipe.api import create_app
from mmpipe.api_runtime import StoreWorker
from mmpipe.schemas.settings import Settings
from mmpipe.streams.broker import EmbeddedBroker, free_port
from mmpipe.streams.kafka import ensure_topics

SHIPPED = (StoreWorker.mark_accepted, StoreWorker.write)
# (label, stamp `accepted`, writes of concurrent submits share transactions)
VARIANTS = {"old": ("unstamped, a transaction per write", False, False),
            "stamped": ("stamped, a transaction per write", True, False),
            "shipped": ("stamped, group commit (shipped)", True, True)}


async def _skip_stamp(self: StoreWorker, job_id: str) -> None:
    return None


async def _write_alone(self: StoreWorker, fn: Any, *args: Any) -> Any:
    return await self.call(fn, *args)


@contextlib.contextmanager
def variant_of_api(stamp: bool, group: bool) -> Iterator[None]:
    StoreWorker.mark_accepted = SHIPPED[0] if stamp else _skip_stamp  # type: ignore[method-assign]
    StoreWorker.write = SHIPPED[1] if group else _write_alone  # type: ignore[method-assign]
    try:
        yield
    finally:
        StoreWorker.mark_accepted, StoreWorker.write = SHIPPED  # type: ignore[method-assign]


def store_server(store_url: str) -> list[psutil.Process]:
    """The PostgreSQL server's processes (none for SQLite, which runs in the API's process)."""
    if not store_url.startswith("postgres"):
        return []
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("postgres")]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


async def submit_all(client: httpx.AsyncClient, jobs: int, concurrency: int) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(jobs):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"modality": "text", "text": f"sentence {i}", "job_id": f"bench-{uuid.uuid4().hex}"}
            response = await client.post("/v1/jobs", json=body)
            if response.status_code != 202:
                raise RuntimeError(f"submit refused: {response.status_code} {response.text}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def variant(settings: Settings, broker: psutil.Process, name: str, jobs: int, concurrency: int) -> dict[str, float]:
    """One variant on a fresh app: a warm-up, then the timed submits."""
    _, stamp, group = VARIANTS[name]
    with variant_of_api(stamp, group):
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api.bench", timeout=60) as client:
                await submit_all(client, 50, concurrency)
                server = store_server(settings.store_url.get_secret_value())
                cpu0, server0, broker0 = time.process_time(), cpu_seconds(server), cpu_seconds([broker])
                t0 = time.perf_counter()
                await submit_all(client, jobs, concurrency)
                wall = time.perf_counter() - t0
                cpu, server_cpu = time.process_time() - cpu0, cpu_seconds(server) - server0
                broker_cpu = cpu_seconds([broker]) - broker0
    return {"rate": jobs / wall, "api_cpu_ms": 1000 * cpu / jobs, "store_server_cpu_ms": 1000 * server_cpu / jobs,
            "broker_cpu_ms": 1000 * broker_cpu / jobs}


async def run(args: argparse.Namespace, settings: Settings, broker: psutil.Process) -> list[tuple[str, dict[str, float]]]:
    await ensure_topics(settings)
    order = list(VARIANTS) * args.rounds
    return [(name, await variant(settings, broker, name, args.jobs, args.concurrency)) for name in order]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three variants, in turn")
    parser.add_argument("--store-url", default=None, help="a PostgreSQL URL; default a SQLite file")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(port=port, log_path=Path(tmp) / "broker.log") as broker:
        store_url = args.store_url or f"sqlite:///{Path(tmp) / 'jobs.db'}"
        settings = Settings(bootstrap=f"127.0.0.1:{port}", store_url=store_url, topic_prefix="apibench", state_dir=Path(tmp))
        results = asyncio.run(run(args, settings, psutil.Process(broker.process.pid)))
    store = "PostgreSQL" if args.store_url else "SQLite"
    print(f"POST /v1/jobs, text jobs, {args.jobs} per variant, {args.concurrency} in flight, store {store}, one run")
    for name, r in results:
        print(f"  {VARIANTS[name][0]:36s} {r['rate']:7.1f} submits/s  API process CPU {r['api_cpu_ms']:.2f} ms/submit"
              f"  broker CPU {r['broker_cpu_ms']:.2f} ms/submit"
              + (f"  store server CPU {r['store_server_cpu_ms']:.2f} ms/submit" if args.store_url else ""))
    keys = ["rate", "api_cpu_ms", "broker_cpu_ms"] + (["store_server_cpu_ms"] if args.store_url else [])
    median = {name: {k: statistics.median(r[k] for n, r in results if n == name) for k in keys} for name in VARIANTS}
    print(f"  medians over {args.rounds} rounds, against '{VARIANTS['old'][0]}' (submits/s, then CPU per submit: "
          + ", ".join(keys[1:]) + "):")
    for name in ("stamped", "shipped"):
        print(f"    {VARIANTS[name][0]:36s} " + "  ".join(f"{median[name][k] / median['old'][k]:.2f}x" for k in keys))

if __name__ == "__main__":
    main()
