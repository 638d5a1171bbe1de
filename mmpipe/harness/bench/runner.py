"""The benchmark, phase by phase:

1. decode: decode_video vs a bare PyAV loop on a 720p clip (before anything else runs);
2. model alone: t(b) over batch sizes, the best batch size b*, the batching gain;
3. the real pipeline, started once. Per policy (inference restarted with it, then warmed up):
   a flood (saturation: closed loop, a fixed number of jobs outstanding) and Poisson runs at
   shares of the headline policy's saturation (the latency/throughput curve; 70% is the
   latency check), bursty on/off traffic, mixed modalities, priority levels at 90% load, and
   two inference replicas with one slowed down;
4. the queueing simulation of every run, with the measured t(b) and the same arrivals;
5. targets as measured ratios, and the report (terminal table, JSON, PNG).

The speech scenario (speech.py) runs after the pipeline has stopped, in this process: the
Whisper decoder under three scheduling policies on the same seeded arrivals. Run alone
(`--scenario speech`) it skips phases 1-4.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from mmpipe.harness.bench import decode_bench, efficiency, report, simulate, stats, targets, traffic
from mmpipe.harness.bench.config import TARGET_LOAD, BenchConfig
from mmpipe.harness.bench.env import environment
from mmpipe.harness.bench.model_alone import ModelCurve, ModelProbe, batch_sizes, measure_curve
from mmpipe.harness.bench.pipeline_run import BenchPipeline, Policy, RunData, Topology
from mmpipe.harness.bench.resources import ResourceSampler
from mmpipe.harness.bench.workload import Workload, decode_clip, model_input
from mmpipe.schemas.settings import Settings, load_settings
from mmpipe.models.registry import DEFAULTS, resolve
from mmpipe.models.torch_util import resolve_device
from mmpipe.streams.broker import free_port_block
from mmpipe.supervisor import METRICS_PORT_SPAN

# How long each efficiency round times the model alone before its loaded runs (Runner.probe_model).
PROBE_S = 1.0
# Pipeline settings that shape the figures, reported with them.
REPORTED_SETTINGS = {
    "partitions", "fetch_max_wait_ms", "commit_interval_s", "inflight_high_per_partition", "max_inflight",
    "stream_buffer_maxsize", "decode_workers", "decode_threads", "inference_workers", "torch_threads",
    "video_sample_fps", "video_max_frames", "models", "device", "fetch_idle_max_wait_ms", "lag_idle_interval_s", "model_cpus",
    "graph_mode", "fetch_wakeups", "fetch_wake_fallback_ms", "consumer_in_thread", "event_loop",
}


def run_bench(cfg: BenchConfig, console: Console | None = None) -> dict[str, Any]:
    return Runner(cfg, console or wide_console()).run()


def wide_console() -> Console:
    """Rich assumes 80 columns when output is not a terminal (a log file, CI), which folds the
    wide tables into unreadable columns."""
    console = Console()
    return console if console.is_terminal else Console(width=220)


class Runner:
    def __init__(self, cfg: BenchConfig, console: Console) -> None:
        self.cfg = cfg
        self.console = console
        self.device = resolve_device(cfg.device)
        self.runs: list[dict[str, Any]] = []
        self.saturation: dict[str, float] = {}
        self.curve: ModelCurve | None = None
        self.probe: ModelProbe | None = None
        self.bench: BenchPipeline | None = None
        self.sampler = ResourceSampler(gpu=self.device.startswith("cuda"))
        self._tags = 0
        self._warm = False
        self.cache_dir = load_settings().state_path("bench-cache")
        self.efficiency_result: dict[str, Any] = {}
        if "efficiency" in cfg.scenarios:  # a misspelt --efficiency-variants fails now, not after the other scenarios
            efficiency.variants(load_settings(), cfg.efficiency_variants)

    # Top level -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.time()
        cfg = self.cfg
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled models load from site-packages
        meta = environment(self.device)
        meta["torch_threads"] = cfg.threads()
        meta["replicas"] = cfg.replicas()
        phases = self.pipeline_phases(meta) if cfg.runs_pipeline() else {}
        if "speech" in cfg.scenarios:
            phases["speech"] = self.speech_phase()
        result = {
            "meta": {**meta, "started_at": started, "duration_s": round(time.time() - started, 1)},
            "config": _jsonable(asdict(cfg)),
            **phases,
        }
        result["targets"] = targets.evaluate(result, self.settings_budget())
        report.write_all(result, cfg.out_dir, self.console)
        return result

    def pipeline_phases(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Phases 1-4: decode, model alone, the pipeline's scenarios, the simulation."""
        cfg = self.cfg
        self.say(f"device {self.device}, torch threads {cfg.threads()} per stage process, replicas {cfg.replicas()}")
        with self.console.status("preparing media (PyAV, espeak-ng)..."):
            self.work = Workload.prepare(self.cache_dir / "media", cfg.modalities_needed())
        decode = self.decode_phase()
        self.curve = self.model_phase()
        self.policies = plan_policies(self.curve, cfg)
        self.sampler.start()
        self.sampler.watch("bench", os.getpid())
        try:
            self.pipeline_phase()
            meta["pipeline_settings"] = self.bench.settings.model_dump(mode="json", include=REPORTED_SETTINGS)
        finally:
            if self.bench is not None:
                with self.console.status("stopping the pipeline..."):
                    self.bench.stop()
            self.sampler.stop()
        return {
            "decode": {**asdict(decode), "ratio": round(decode.ratio, 3)},
            "model_alone": self.curve.to_dict(),
            "policies": {
                role: {**asdict(self.policies[role]), "label": self.policies[role].label} for role in ("off", "static", "headline")
            },
            "saturation": self.saturation,
            "runs": self.runs,
            "memory": self.memory(),
            "simulation_curves": self.simulation_curves(),
            "efficiency": self.efficiency_result,
        }

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    # Phases --------------------------------------------------------------------------------------
    def decode_phase(self) -> decode_bench.DecodeResult:
        with self.console.status("decode: 720p H.264 clip, decode_video vs bare PyAV loop..."):
            clip = decode_clip(self.cache_dir, self.cfg.decode_clip_s)
            result = decode_bench.run(clip, self.cfg.decode_repeats)
        self.say(f"decode: bare {result.bare_fps:.0f} fps, decode_video {result.stage_fps:.0f} fps (ratio {result.ratio:.2f})")
        return result

    def model_phase(self) -> ModelCurve:
        spec, example = self.model_example()
        sizes = batch_sizes(self.device, min(spec.config.max_batch_size, self.cfg.max_batch_cap or 1024))
        with self.console.status(f"model alone: {spec.ref} at batch sizes {sizes}..."):
            curve = measure_curve(
                spec, example, **self.model_options(),
                sizes=sizes, seconds_per_size=self.cfg.model_seconds_per_size, rounds=self.cfg.model_rounds,
            )
        points = ", ".join(f"b{p.batch_size}: {p.items_per_s:.1f}/s" for p in curve.points)
        form = "frozen graph" if curve.graph else "eager"
        self.say(f"model alone ({curve.weights} weights, {form}): {points}; best b={curve.best_batch}, gain {curve.batching_gain:.2f}x")
        return curve

    def model_example(self) -> tuple[Any, dict[str, Any]]:
        """The modality's model spec and one preprocessed input for it."""
        spec = resolve(None, self.cfg.modality)
        return spec, model_input(spec, self.cfg.modality, self.work)

    def model_options(self) -> dict[str, Any]:
        settings = load_settings()
        return {"device": self.device, "weights_dir": str(settings.weights_dir), "torch_threads": self.cfg.threads(),
                "graph_mode": settings.graph_mode}

    def probe_model(self, batch_size: int) -> dict[str, float]:
        """The model alone at `batch_size` now, against the curve from the start of the run."""
        assert self.curve is not None
        if self.probe is None:
            self.probe = ModelProbe(*self.model_example(), **self.model_options())
        now = self.probe.items_per_s(batch_size, PROBE_S)
        return {"batch": batch_size, "items_per_s": round(now, 2), "vs_start": round(now / self.curve.throughput(batch_size), 3)}

    def pipeline_phase(self) -> None:
        cfg, p = self.cfg, self.policies
        scen = set(cfg.scenarios)
        self.start_pipeline()
        headline = p["headline"]
        main = {"dynamic": headline, "off": p["off"], "static": p["static"]}
        order = [name for name in ("dynamic", "off", "static") if name in cfg.policies or name in ("dynamic", "off")]
        for name in order:
            policy = main[name]
            needs = name != "static" or scen & {"poisson", "bursty"}
            if not needs:
                continue
            self.use(policy)
            if name != "static" or ("poisson" in scen and cfg.static_flood):
                self.flood(policy)
            if name == "dynamic":
                saturation = self.saturation[headline.label]
                self.rate = cfg.rate or TARGET_LOAD * saturation
                self.say(f"saturation {saturation:.2f} jobs/s; latency runs at {self.rate:.2f} jobs/s (load {TARGET_LOAD:.0%})")
            if "poisson" in scen and name in cfg.policies:
                for load in cfg.load_ladder:
                    self.poisson(policy, load)
            if "bursty" in scen and name in cfg.policies:
                self.bursty(policy)
            if "mixed" in scen and name == "dynamic":
                self.mixed(policy)
            if "priority" in scen and name == "dynamic":
                self.priority(policy)
        if "poisson" in scen and cfg.sweep:
            self.sweep()
        if "degraded" in scen:
            self.degraded()
        if "efficiency" in scen:
            self.efficiency()  # last: it leaves the stages on one variant's settings

    def speech_phase(self) -> dict[str, Any]:
        """Whisper tiny.en under off / request-level / continuous decoder scheduling (speech.py);
        imported here so that other scenarios never load the model."""
        from mmpipe.harness.bench import speech

        cfg = self.cfg
        with self.console.status(f"speech: {cfg.speech_clips} espeak-ng clips, Whisper tiny.en, three decoder policies..."):
            return speech.run(cfg, self.device, self.say)

    def start_pipeline(self) -> None:
        cfg = self.cfg
        workdir = (cfg.out_dir / "run").resolve()
        shutil.rmtree(workdir, ignore_errors=True)
        settings = self.pipeline_settings(workdir)
        base_port = free_port_block(METRICS_PORT_SPAN)
        self.bench = BenchPipeline(settings, workdir, self.curve.model, cfg.replicas(), self.sampler, base_port)
        with self.console.status("starting the embedded broker and the stage processes..."):
            started = time.monotonic()
            self.bench.start(self.policies["headline"])
        self.say(f"pipeline up in {time.monotonic() - started:.1f}s on {self.bench.settings.bootstrap} (logs in {workdir})")

    def pipeline_settings(self, workdir: Path) -> Settings:
        cfg = self.cfg
        models = [self.curve.model]
        if "mixed" in cfg.scenarios:
            models = sorted({ref.name for ref in DEFAULTS.values()})
        return load_settings().model_copy(update=dict(
            bootstrap="127.0.0.1:0",
            topic_prefix=f"bench{uuid.uuid4().hex[:8]}",
            partitions=cfg.partitions,
            store_url=f"sqlite:///{workdir / 'results.db'}",
            input_roots=[self.work.media_dir],
            allow_random_weights=True,
            device=self.device,
            torch_threads=cfg.threads(),
            model_cpus=efficiency.model_cores(cfg.model_cpus, self.device, cfg.threads()),
            models=models,
            metrics_host="127.0.0.1",
            log_level="warn",
        ))

    def settings_budget(self) -> int:
        return load_settings().memory_budget_bytes

    # Policies ------------------------------------------------------------------------------------
    def use(self, policy: Policy, topology: Topology = Topology()) -> None:
        assert self.bench is not None
        with self.console.status(f"restarting inference with {policy.label} ({topology.replicas} replica(s))..."):
            started = time.monotonic()
            changed = self.bench.set_policy(policy, topology)
        if changed:
            self.say(f"inference restarted with [bold]{policy.label}[/] in {time.monotonic() - started:.1f}s")
        if changed or not self._warm:
            # First jobs after a (re)start pay for lazy set-up along the path (fetch sessions,
            # allocator growth, first-batch shapes); they are not measured.
            warm = max(self.cfg.warmup_jobs_min, 2 * policy.max_batch * topology.replicas)
            self.execute(traffic.flood(warm, self.cfg.modality, self.cfg.seed), "warm-up", policy, record=False, simulate_it=False)
            self._warm = True

    def fresh_start(self, policy: Policy, topology: Topology = Topology(), overrides: dict[str, Any] | None = None) -> None:
        """Every stage restarted on fresh topics with this policy, topology and settings
        overrides, then warmed up."""
        assert self.bench is not None
        with self.console.status(f"every stage onto fresh topics with {policy.label} ({topology.replicas} replica(s))..."):
            started = time.monotonic()
            self.bench.fresh_topics(policy, topology, overrides=overrides)
        self.say(f"fresh topics, every stage restarted with [bold]{policy.label}[/] in {time.monotonic() - started:.1f}s")
        self._warm = False
        self.use(policy, topology)  # already in force: only the warm-up runs

    def flood(self, policy: Policy) -> None:
        """Saturation, closed loop (like perf_analyzer's concurrency mode): a fixed number of
        jobs outstanding, a new one sent as each completes. Every stage then runs at the
        pipeline's pace. An all-at-once flood let decode finish early and then timed the
        inference stage with the machine to itself (+50% on 2 cores); open-loop overload
        billed the pipeline for ingesting jobs it could not serve yet."""
        run = self.closed_loop(policy, "flood")
        self.saturation[policy.label] = run["stats"]["throughput"]

    def closed_loop(self, policy: Policy, kind: str, simulate_it: bool = True, modality: str | None = None) -> dict[str, Any]:
        assert self.curve is not None
        size = int(self.curve.throughput(self.curve.best_batch) * self.cfg.flood_seconds)
        size = min(max(size, self.cfg.flood_jobs_min, 4 * policy.max_batch), self.cfg.flood_jobs_max)
        return self.execute(traffic.flood(size, modality or self.cfg.modality, self.cfg.seed), kind, policy,
                            flood=True, outstanding=flood_outstanding(policy), simulate_it=simulate_it)

    def rate_at(self, load: float) -> float:
        return self.rate * load / TARGET_LOAD

    def poisson(self, policy: Policy, load: float) -> None:
        rate = self.rate_at(load)
        schedule = traffic.poisson(rate, self.cfg.poisson_s, self.cfg.seed, self.cfg.modality)
        self.execute(schedule, "poisson", policy, load=load, rate=rate)

    def bursty(self, policy: Policy) -> None:
        cfg = self.cfg
        on_rate = self.rate_at(cfg.bursty_peak_load)
        schedule = traffic.bursty(on_rate, cfg.bursty_on_s, cfg.bursty_off_s, cfg.bursty_s, cfg.seed, cfg.modality)
        self.execute(schedule, "bursty", policy, load=cfg.bursty_peak_load, rate=traffic.mean_rate(schedule))

    def mixed(self, policy: Policy) -> None:
        """Mixed modalities at mixed_load of their own saturation, measured first with a
        closed-loop flood of the same mix: a share of the image saturation overloaded the
        pipeline (video and speech jobs cost several images' work; 14.4 jobs/s offered, 5.06
        served in the full run of 2026-12-07)."""
        flood = self.closed_loop(policy, "mixed flood", simulate_it=False, modality="mixed")
        rate = self.cfg.mixed_load * flood["stats"]["throughput"]
        schedule = traffic.poisson(rate, self.cfg.mixed_s, self.cfg.seed, "mixed")
        self.execute(schedule, "mixed", policy, load=self.cfg.mixed_load, rate=rate, simulate_it=False)

    def priority(self, policy: Policy) -> None:
        """Poisson at priority_load with a seeded share of the jobs at high priority and the rest
        at priority_rest, eight times on the same schedule: without the priority mechanisms (one
        topic per hop for every level, high items batched like the rest), with them (priority
        lanes, expedite and the urgent slot, whose batch takes the shared model core first),
        with the slot's batch and the running one splitting the core evenly, with them but no
        urgent slot (high items wait for a running batch), then the four again in reverse. Each
        run starts on fresh topics (the embedded broker slows as partitions fill) and the ABBA
        order cancels what drift remains.
        Per level the latency percentiles, and the starvation check at the batcher from the
        jobs' traces (stats.priority_stats)."""
        assert self.bench is not None
        cfg = self.cfg
        rate = self.rate_at(cfg.priority_load)
        schedule = traffic.with_priorities(traffic.poisson(rate, cfg.priority_s, cfg.seed, cfg.modality),
                                           cfg.priority_high_share, cfg.seed, cfg.priority_rest)
        aging_s = self.bench.settings.scheduling.aging_s
        without = (replace(policy, expedite=False), Topology(lanes=False))
        with_them = (policy, Topology())
        even_split = (replace(policy, precedence=False), Topology())
        no_slot = (replace(policy, urgent_slot=False), Topology())
        variants = (without, with_them, even_split, no_slot)
        for variant, topology in (*variants, *reversed(variants)):
            self.fresh_start(variant, topology)
            run = self.execute(schedule, "priority", variant, load=cfg.priority_load, rate=rate, topology=topology)
            run["mechanisms"] = variant.expedite and topology.lanes
            run["urgent_slot"] = variant.expedite and variant.urgent_slot
            run["precedence"] = run["urgent_slot"] and variant.precedence
            run["priority"] = figures = stats.priority_stats(self.bench.fetch(run["tag"]), aging_s)
            levels = figures["levels"]
            self.say(f"priority levels ({run['label']}): "
                     + "; ".join(f"{p}: {v['ok']} ok, p99 {v['e2e_ms']['p99']:.0f} ms" for p, v in levels.items())
                     + f"; overtaken beyond the starvation bound at the batcher: {figures['starvation']['beyond_bound']}")
        self.priority_floor(schedule, policy, rate)

    def priority_floor(self, schedule: list[traffic.Arrival], policy: Policy, rate: float) -> None:
        """The high-priority jobs of the same schedule, at the same times, with nothing else in
        the pipeline: their p99 is the least any priority policy could give them on this
        machine (no preemption of a running batch), so floor p99 / low p99 is the best ratio
        the loaded runs could reach."""
        high = min(a.priority for a in schedule)
        alone = [a for a in schedule if a.priority == high]
        self.fresh_start(policy, Topology())
        run = self.execute(alone, "priority floor", policy, load=self.cfg.priority_load * len(alone) / len(schedule),
                           rate=rate * len(alone) / len(schedule), simulate_it=False)
        run["priority"] = stats.priority_stats(self.bench.fetch(run["tag"]), self.bench.settings.scheduling.aging_s)

    def sweep(self) -> None:
        flooded = {self.policies["headline"].max_batch}
        for policy in self.policies["sweep"]:
            if policy == self.policies["headline"]:
                continue
            self.use(policy)
            if policy.max_batch not in flooded:
                self.flood(policy)
                flooded.add(policy.max_batch)
            self.poisson(policy, TARGET_LOAD)

    def degraded(self) -> None:
        """Two inference replicas; then the second one slowed by degrade_factor x t(b*) per batch,
        work placed by hash; then the same slowed pair with lag-aware routing (same arrivals)."""
        assert self.curve is not None
        delay = round(self.cfg.degrade_factor * self.curve.batch_ms(self.curve.best_batch), 1)
        healthy, slowed = Topology((0.0, 0.0)), Topology((0.0, delay))
        rate = self.rate_at(TARGET_LOAD)
        schedule = traffic.poisson(rate, self.cfg.degraded_s, self.cfg.seed, self.cfg.modality)
        plan = [(self.policies["headline"], healthy)]
        plan += [(self.policies[name if name != "dynamic" else "headline"], slowed) for name in ("off", "dynamic") if name in self.cfg.policies]
        plan.append((self.policies["headline"], Topology((0.0, delay), routing=True)))
        for policy, topology in plan:
            self.fresh_start(policy, topology)  # no run pays for the records of the one before
            self.execute(schedule, "degraded", policy, load=TARGET_LOAD, rate=rate, topology=topology)

    def efficiency(self) -> None:
        """Idle CPU, latency at 30% load, CPU and bytes per job at saturation, for each settings
        variant (efficiency.py), every stage restarted with the variant's settings."""
        assert self.bench is not None and self.curve is not None
        headline = self.policies["headline"]
        variants = efficiency.variants(self.bench.settings, self.cfg.efficiency_variants)
        measured: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
        for variant, overrides in efficiency.round_order(variants, self.cfg.efficiency_rounds):
            self.say(f"efficiency round {len(measured[variant]) + 1}/{self.cfg.efficiency_rounds}: [bold]{variant}[/]")
            self.fresh_start(headline, overrides=overrides)  # no variant pays for the records of the one before
            measured[variant].append(self.efficiency_variant(variant, headline, overrides))
        self.efficiency_result = {variant: efficiency.mean_of_rounds(rounds) for variant, rounds in measured.items()}

    def efficiency_variant(self, variant: str, policy: Policy, overrides: dict[str, Any]) -> dict[str, Any]:
        assert self.bench is not None and self.curve is not None
        cfg = self.cfg
        with self.console.status(f"{variant}: idle for {cfg.idle_s:.0f}s..."):
            time.sleep(cfg.idle_settle_s)  # consumers back off after fetch_idle_after_s
            self.sampler.begin()
            time.sleep(cfg.idle_s)
            idle_window = self.sampler.end()
            idle = efficiency.idle_ms_per_s(idle_window)
        self.say(f"{variant}: idle CPU ms/s " + ", ".join(f"{k} {v:.1f}" for k, v in idle.items()))
        probe = self.probe_model(policy.max_batch)
        self.say(f"{variant}: model alone now, b={probe['batch']}: {probe['items_per_s']:.1f}/s, "
                 f"{probe['vs_start']:.2f}x the run's start")
        rate = self.rate_at(efficiency.IDLE_LOAD)
        schedule = traffic.poisson(rate, cfg.poisson_s, cfg.seed, cfg.modality)
        light = self.execute(schedule, f"efficiency {variant}", policy, load=efficiency.IDLE_LOAD, rate=rate, simulate_it=False)
        topic_bytes = efficiency.TopicBytes(self.bench.settings)
        topic_bytes.mark()
        flood = self.closed_loop(policy, f"efficiency {variant} flood", simulate_it=False)
        figures = flood["stats"]
        alone = self.curve.throughput(max(1, round(figures["mean_batch"])))
        return {
            # Every setting the variants differ in (efficiency.variants), and the fetch wait beside them.
            "settings": {k: getattr(self.bench.settings, k) for k in ("fetch_max_wait_ms", *overrides)},
            "idle_s": cfg.idle_s,
            "idle_ms_per_s": idle,
            "model_probe": probe,  # the machine's speed for the model just before the loaded runs
            # Other users of a shared machine, in cores: the figures beside them are only as clean as these.
            "other_busy_cores": {"idle": idle_window["other_busy_cores"], "light_load": light["resources"]["other_busy_cores"],
                                 "saturation": flood["resources"]["other_busy_cores"]},
            "light_load": {"rate": round(rate, 3), "p50_ms": light["stats"]["e2e_ms"]["p50"],
                           "first_job_ms": efficiency.first_job_ms(self.bench.fetch(light["tag"]))},
            "saturation": {
                "throughput": figures["throughput"], "mean_batch": figures["mean_batch"],
                "model_alone_throughput": round(alone, 3), "ratio_to_model_alone": round(figures["throughput"] / alone, 3),
                "execute_inflation": round(execute_inflation(figures, self.curve), 3),
                "cpu": efficiency.cpu_per_job(flood, efficiency.model_cpu_per_item(self.curve.to_dict()["points"], figures["mean_batch"]),
                                              probe["vs_start"]),
            },
            "bytes_per_job": efficiency.per_job(topic_bytes.added(), figures["published"], self.bench.settings.topic_prefix),
            "largest_partition_records": topic_bytes.largest_partition,  # read by added() just before
        }

    # One measured run ----------------------------------------------------------------------------
    def execute(
        self, schedule: list[traffic.Arrival], kind: str, policy: Policy, *, load: float | None = None,
        rate: float | None = None, flood: bool = False, topology: Topology = Topology(),
        record: bool = True, simulate_it: bool = True, outstanding: int = 0,
    ) -> dict[str, Any]:
        assert self.bench is not None and self.curve is not None
        self._tags += 1
        tag = f"r{self._tags}"
        label = policy.label + ("" if topology.lanes else " no-lanes")
        what = f"{kind} {label}" + (f" load {load:.0%}" if load is not None else "") + f": {len(schedule)} jobs"
        routing_before = self.bench.routing_counts() if topology.routing else None
        with self.console.status(f"{what}..."):
            data = self.bench.run(schedule, self.work, tag, self.cfg.result_timeout_s, outstanding)
        figures = stats.run_stats(data.results, data.published, flood)
        run = {
            "tag": tag, "scenario": kind, "policy": asdict(policy), "label": label,
            "topology": {"replicas": topology.replicas, "delays_ms": list(topology.inference_delays_ms),
                         "routing": topology.routing, "lanes": topology.lanes},
            "load": load, "offered_rate": round(rate, 3) if rate else None,
            "modality": "mixed" if kind.startswith("mixed") else self.cfg.modality,
            "stats": figures, "lag_peak": data.lag_peak, "send_lag_ms": data.send_lag_ms,
            "resources": data.resources, "inference_metrics": data.inference_metrics,
        }
        if routing_before is not None:
            run["routing"] = self.bench.routing_counts().since(routing_before)
        if simulate_it:
            run["sim"] = self.simulate(data, figures, policy, topology)
        e2e = figures["e2e_ms"]
        self.say(f"{what} -> {figures['ok']}/{figures['published']} ok, {figures['throughput']:.2f} jobs/s, "
                 f"e2e p50 {e2e['p50']:.0f} p99 {e2e['p99']:.0f} ms, mean batch {figures['mean_batch']}")
        if record:
            self.runs.append(run)
        return run

    def simulate(self, data: RunData, figures: dict[str, Any], policy: Policy, topology: Topology) -> dict[str, Any]:
        """The batcher fed the run's own arrivals, twice: with t(b) of the model alone, and with
        t(b) scaled by how much slower batches executed inside the pipeline in this run. If the
        second matches the measured inference-stage latency, the queueing model holds and the
        gap to the first is the cost of sharing the machine with the other stages."""
        assert self.curve is not None
        curve = self.curve
        inflation = execute_inflation(figures, curve)

        def run(service: Any) -> dict[str, Any]:
            if topology.routing:  # the real Router, fed the simulated workers' reports
                assert self.bench is not None
                return simulate.simulate_routed(
                    data.offsets_s, policy.sim(), service, self.bench.settings.scheduling.model_copy(update={"routing": True}),
                    extra_ms=topology.inference_delays_ms,
                ).to_dict()
            return simulate.simulate(
                data.offsets_s, policy.sim(), service, replicas=topology.replicas,
                extra_ms=topology.inference_delays_ms, seed=self.cfg.seed,
            ).to_dict()

        return {**run(curve.batch_ms), "execute_inflation": round(inflation, 3),
                "in_pipeline": run(lambda b: curve.batch_ms(b) * inflation)}

    # Summaries -------------------------------------------------------------------------------------
    def memory(self) -> dict[str, Any]:
        rss = {name: round(v / 1024**2, 1) for name, v in sorted(self.sampler.peak_rss.items())}
        gpu = {}
        for run in self.runs:
            for name, m in run.get("inference_metrics", {}).items():
                gpu[name] = max(gpu.get(name, 0), m.get("gpu_memory_bytes", 0))
        return {
            "peak_rss_mib": rss,
            "inference_gpu_peak_mib": {k: round(v / 1024**2, 1) for k, v in gpu.items()},
            "model_alone_gpu_peak_mib": round((self.curve.gpu_peak_bytes if self.curve else 0) / 1024**2, 1),
            "gpu_used_peak_mib": self.sampler.gpu_mem_peak_mib or None,
        }

    def simulation_curves(self) -> dict[str, Any]:
        """Model-only latency curves for off/static/headline over loads up to saturation."""
        assert self.curve is not None
        top = self.curve.throughput(self.curve.best_batch)
        rates = [top * f for f in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)]
        out = {}
        for name in ("off", "static", "headline"):
            policy = self.policies[name]
            out[policy.label] = {
                "saturation": round(simulate.saturation(policy.sim(), self.curve.batch_ms), 3),
                "points": simulate.load_curve(policy.sim(), self.curve.batch_ms, rates, self.cfg.seed, items=1500),
            }
        return out


def flood_outstanding(policy: Policy) -> int:
    """Jobs kept in flight by the saturation run: enough for the batcher to always hold a few
    full batches while others are in decode, preprocess and the sink."""
    return 4 * policy.max_batch + 8


def execute_inflation(figures: dict[str, Any], curve: ModelCurve) -> float:
    """Item-weighted mean of (execute time in the pipeline / t(b) alone) over the batch sizes
    the run produced; 1.0 when nothing ran."""
    weighted = total = 0.0
    for size, measured in figures["execute_ms_by_batch"].items():
        items = figures["batch_items"].get(size, 0)
        weighted += items * measured / curve.batch_ms(int(size))
        total += items
    return weighted / total if total else 1.0


def plan_policies(curve: ModelCurve, cfg: BenchConfig) -> dict[str, Any]:
    """Off, static at b*, the headline dynamic (b*, max_wait = t(1)), and the sweep of max
    batch {b*/2, b*, 2 b*} (within what the model alone was measured at) x max_wait {factors x
    t(1)}. Waits scale with t(1) so the same sweep means the same thing on a CPU (tens of ms)
    and a GPU (a few ms); sizes straddle b* because on a flat curve (a CPU) b* is near noise."""
    best = curve.best_batch
    unit = curve.batch_ms(1)

    def wait(factor: float) -> float:
        return max(round(unit * factor * 2) / 2, 0.5)  # half-millisecond steps

    headline = Policy("dynamic", best, wait(cfg.headline_wait_factor))
    largest = max(p.batch_size for p in curve.points)
    sizes = sorted({b for b in (best // 2, best, best * 2) if 2 <= b <= largest}) or [best]
    sweep = [Policy("dynamic", b, wait(f)) for b in sizes for f in cfg.sweep_wait_factors]
    return {"off": Policy("off", 1), "static": Policy("static", best), "headline": headline, "sweep": sweep}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value

