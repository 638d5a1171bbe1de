"""What the pipeline costs beside the model, under several settings in one run (issue 11).

Variants: "adaptive" (this build's settings: stages fed by stages fetch on wake-ups, idle
consumers back their fetch wait off, lag read-outs pause while nothing moves, each process runs
its consumer on its one event loop), "consumer thread" (the same with faust's consumer thread),
"no wake-ups" (adaptive with every consumer polling) and "polling" (the settings before all
that: every consumer fetches with the short wait forever from faust's consumer thread, lag is
read twice a second). Each runs with the headline
batching policy, every stage process restarted with the variant's settings on fresh topics, in
ABBA order (`BenchConfig.efficiency_rounds`); the figures are the mean of its rounds. A round:

1. idle: no jobs for `idle_s`, CPU per process (the broker too) in ms per wall second; then the
   model alone at the headline batch size for a second (Runner.probe_model), against the
   curve from the start of the run: the machine's own speed at that point;
2. latency at 30% load: a seeded Poisson run (the same arrivals for every variant), p50;
3. saturation: the closed-loop flood, CPU per job of every process, the model's own CPU per
   item (model alone, same batch size) subtracted for "outside the model", and the bytes each
   topic carried per job (read back from the broker: key + value of every record the run added).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from mmpipe.schemas import JobResult
from mmpipe.schemas.settings import Settings
from mmpipe.streams.kafka import groupless_consumer
from mmpipe.streams.topics import TopicNames

IDLE_LOAD = 0.3  # the latency check: p50 at 30% of saturation must not rise > 10%
TOPIC_READ_TIMEOUT_S = 60.0
LAG_TWICE_A_SECOND_S = 0.5  # the lag interval before 2026-12-08 ("polling" and its own variant)


def variants(settings: Settings, only: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Settings overrides per variant; the first ("adaptive") is what the pipeline already runs.
    Where it runs each consumer on the stage's loop (streams/transport.py), "consumer thread"
    is the same on faust's consumer thread; where stages run on uvloop, "asyncio loop" runs
    them on asyncio's own loop; where it uses wake-ups between stages
    (streams/wakeup.py), "no wake-ups" is the same polling; where lag is read less often than
    twice a second, "lag twice a second" reads it so; where decode cuts frames to the
    model's centre crop, "whole frames" sends them whole; where decode places the parts it
    already made model-ready onto `ready` itself, "no bypass" sends every part through
    preprocess; where decode and preprocess run apart, "fused" runs them as one process (no
    `decoded` hop); "polling" is the settings before
    this work: no wake-ups, no idle back-off, lag read twice a second, no pinning, the
    consumer on its own thread. (The pinning's own share was measured with an "unpinned"
    variant: README, Efficiency.) `only`: just these variants (always with "adaptive")."""
    out: dict[str, dict[str, Any]] = {"adaptive": {}}
    if not settings.consumer_in_thread:
        out["consumer thread"] = {"consumer_in_thread": True}
    if settings.event_loop != "asyncio":
        out["asyncio loop"] = {"event_loop": "asyncio"}
    if settings.fetch_wakeups:
        out["no wake-ups"] = {"fetch_wakeups": False}
    if settings.lag_interval_s != LAG_TWICE_A_SECOND_S:
        out["lag twice a second"] = {"lag_interval_s": LAG_TWICE_A_SECOND_S}
    if settings.decode_center_crop:
        out["whole frames"] = {"decode_center_crop": False}
    if settings.preprocess_bypass and not settings.fuse_preprocess:
        out["no bypass"] = {"preprocess_bypass": False}
    if not settings.fuse_preprocess:
        out["fused"] = {"fuse_preprocess": True}
    out["polling"] = {"fetch_idle_max_wait_ms": settings.fetch_max_wait_ms, "lag_idle_interval_s": 0.0,
                      "lag_interval_s": LAG_TWICE_A_SECOND_S, "model_cpus": [],
                      "fetch_wakeups": False, "consumer_in_thread": True, "event_loop": "asyncio"}
    unknown = set(only) - set(out)
    if unknown:
        raise ValueError(f"unknown efficiency variant(s) {', '.join(sorted(unknown))}; these settings have {', '.join(out)}")
    out = {name: overrides for name, overrides in out.items() if not only or name == "adaptive" or name in only}
    # Every variant names every setting any of them changes, so each applies on its own,
    # whichever variant ran before it.
    changed = {key for overrides in out.values() for key in overrides}
    return {name: {key: getattr(settings, key) for key in changed} | overrides for name, overrides in out.items()}


def round_order(variants: dict[str, dict[str, Any]], rounds: int) -> list[tuple[str, dict[str, Any]]]:
    """ABBA: the variants in order, then reversed, and so on for `rounds` rounds, so that a
    drift over the run (the machine, the broker) weighs on every variant alike."""
    forward = list(variants.items())
    return [item for r in range(rounds) for item in (forward if r % 2 == 0 else forward[::-1])]


def mean_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's figures as the mean over its rounds (numbers averaged leaf by leaf, the
    rest taken from the first round), with each round's own figures under "rounds"."""
    merged = _mean(rounds)
    merged["rounds"] = rounds
    return merged


def _mean(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {key: _mean([v[key] for v in values if isinstance(v, dict) and key in v]) for key in first}
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if numbers and len(numbers) == len(values):
        return round(sum(numbers) / len(numbers), 3)
    return first


def model_cores(spec: str, device: str, threads: int) -> list[int]:
    """The bench's --model-cpus: "auto" gives the model thread(s) the last `threads` cores on a
    CPU device when cores are left for the rest; "none" pins nothing; else a list "3" / "2,3"."""
    if spec == "none":
        return []
    if spec != "auto":
        return [int(c) for c in spec.split(",") if c.strip()]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if device != "cpu" or len(cores) <= threads:
        return []
    return cores[-threads:]


def idle_ms_per_s(resources: dict[str, Any]) -> dict[str, float]:
    """CPU per process over an idle window, in ms per second (10 ms/s = 1% of a core)."""
    return {name: round(cores * 1000, 1) for name, cores in sorted(resources["cpu_cores"].items()) if name != "bench"}


def cpu_per_job(run: dict[str, Any], model_ms_per_item: float, probe_vs_start: float | None = None) -> dict[str, Any]:
    """CPU ms per job of every process in a saturation run, and the total outside the model
    (all processes including the broker, less the model's own CPU per item alone). The model's
    CPU per item comes from the curve at the start of the run; `probe_vs_start` (the model
    alone just before this round, against that curve) rescales it to the machine's speed at
    the time, which on a shared machine moved by up to a fifth within one run."""
    res, jobs = run["resources"], max(run["stats"]["ok"], 1)
    per = {name: round(cores * res["wall_s"] / jobs * 1000, 1) for name, cores in sorted(res["cpu_cores"].items()) if name != "bench"}
    total = sum(per.values())
    out = {"per_process_ms": per, "total_ms": round(total, 1), "model_ms": round(model_ms_per_item, 1),
           "outside_model_ms": round(total - model_ms_per_item, 1), "jobs": jobs}
    if probe_vs_start:
        at_probe = model_ms_per_item / probe_vs_start  # one torch thread: CPU per item ~ 1 / items per s
        out |= {"model_ms_at_probe": round(at_probe, 1), "outside_model_at_probe_ms": round(total - at_probe, 1)}
    return out


def outside_model_ms(cpu: dict[str, Any]) -> float:
    """The judged figure: against the model's speed at the round's probe where there is one."""
    return cpu.get("outside_model_at_probe_ms", cpu["outside_model_ms"])


def median_outside_model_ms(rounds: list[dict[str, Any]]) -> float:
    """The judged figure's median over a variant's rounds (reported beside the mean, which is judged)."""
    return round(statistics.median(outside_model_ms(r["saturation"]["cpu"]) for r in rounds), 1)


def first_job_ms(results: list[JobResult]) -> float | None:
    """End-to-end latency of a run's first job: after an idle spell it pays the backed-off waits."""
    if not results:
        return None
    return min(results, key=lambda r: r.created_at).timings.end_to_end_ms


def model_cpu_per_item(result_points: list[dict[str, Any]], batch: float) -> float:
    size = max(1, round(batch))
    point = min(result_points, key=lambda p: abs(p["batch_size"] - size))
    return float(point.get("cpu_ms_per_item", 0.0))


# Bytes per topic ---------------------------------------------------------------------------------
class TopicBytes:
    """End offsets of every pipeline topic now; later, the bytes and records added since."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topics = [name for name, _ in TopicNames(settings.topic_prefix).all()]
        self.start: dict[TopicPartition, int] = {}
        # Records in the fullest partition at the last read: the embedded broker's cost per
        # fetch grows with it (README, known limits), so the figures beside it hold at that size.
        self.largest_partition = 0

    def mark(self) -> None:
        self.start = asyncio.run(self._with_consumer(self._ends))

    def added(self) -> dict[str, dict[str, int]]:
        """{topic: {"bytes": key + value bytes, "records": n}} of the records added since mark()."""
        return asyncio.run(self._with_consumer(self._read_added))

    async def _with_consumer(self, work: Any) -> Any:
        consumer = groupless_consumer(self.settings, offset_reset="earliest")
        await consumer.start()
        try:
            return await work(consumer)
        finally:
            await consumer.stop()

    async def _partitions(self, consumer: AIOKafkaConsumer) -> list[TopicPartition]:
        await consumer.topics()
        return [TopicPartition(t, p) for t in self.topics for p in sorted(consumer.partitions_for_topic(t) or ())]

    async def _ends(self, consumer: AIOKafkaConsumer) -> dict[TopicPartition, int]:
        return dict(await consumer.end_offsets(await self._partitions(consumer)))

    async def _read_added(self, consumer: AIOKafkaConsumer) -> dict[str, dict[str, int]]:
        tps = await self._partitions(consumer)
        ends = await consumer.end_offsets(tps)
        self.largest_partition = max(ends.values(), default=0)
        todo = {tp: ends[tp] for tp in tps if ends[tp] > self.start.get(tp, 0)}
        out = {topic: {"bytes": 0, "records": 0} for topic in self.topics}
        if not todo:
            return out
        consumer.assign(list(todo))
        for tp in todo:
            consumer.seek(tp, self.start.get(tp, 0))
        deadline = time.monotonic() + TOPIC_READ_TIMEOUT_S
        while todo and time.monotonic() < deadline:
            batches = await consumer.getmany(*todo, timeout_ms=500)
            for tp, records in batches.items():
                for record in records:
                    if record.offset < todo.get(tp, 0):
                        out[tp.topic]["bytes"] += len(record.key or b"") + len(record.value or b"")
                        out[tp.topic]["records"] += 1
                if await consumer.position(tp) >= ends[tp]:
                    todo.pop(tp, None)
        return out


def per_job(added: dict[str, dict[str, int]], jobs: int, prefix: str) -> dict[str, dict[str, float]]:
    """Bytes and records per job on each topic (topic names without the run's prefix)."""
    jobs = max(jobs, 1)
    return {
        topic.removeprefix(prefix + "."): {"bytes": round(v["bytes"] / jobs), "records": round(v["records"] / jobs, 2)}
        for topic, v in added.items() if v["records"]
    }
