"""What a benchmark run does: scenarios, sizes of each phase, the policy sweep. Two presets
(full, quick); tests shrink the quick one further. Every scenario but `speech` runs on the
pipeline; `speech` runs the Whisper decoder policies in the bench process (speech.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from mmpipe.schemas.events import LOW_PRIORITY

SCENARIOS = ("poisson", "bursty", "degraded", "mixed", "priority", "efficiency", "speech")
SPEECH_MIXES = ("uniform", "short-heavy")  # clip lengths of the speech scenario (speech.sentences_per_clip)
MODALITIES = ("image", "audio", "text")
# The load for the latency check: a share of the pipeline's own saturation throughput.
TARGET_LOAD = 0.7


@dataclass
class BenchConfig:
    out_dir: Path = Path("bench-out")
    device: str = "cpu"
    seed: int = 42
    scenarios: tuple[str, ...] = SCENARIOS
    modality: str = "image"  # traffic of the poisson/bursty/degraded/priority scenarios
    rate: float | None = None  # jobs/s of the latency runs; None: TARGET_LOAD x saturation
    torch_threads: int = 0  # 0: auto (half the cores, 1 on a 2-core machine)
    decode_replicas: int = 0  # 0: auto
    preprocess_replicas: int = 0  # 0: auto
    partitions: int = 4
    model_cpus: str = "auto"  # cores of the inference model thread: auto | none | "1" / "2,3"
    quick: bool = False

    # Model alone
    max_batch_cap: int | None = None  # cap of the batch sizes tried (tests keep it small)
    model_seconds_per_size: float = 3.0
    model_rounds: int = 3
    # Decode benchmark
    decode_clip_s: float = 6.0
    decode_repeats: int = 5
    # Pipeline phases
    warmup_jobs_min: int = 8
    # Saturation run: closed loop (runner.flood_outstanding jobs in flight); its size is about
    # this many seconds of model-alone work.
    flood_seconds: float = 8.0
    flood_jobs_min: int = 40
    flood_jobs_max: int = 2000
    static_flood: bool = True  # static's saturation is informational (no target uses it)
    poisson_s: float = 20.0
    load_ladder: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)  # for off, static and the headline
    sweep: bool = True  # dynamic over max batch x max wait (at TARGET_LOAD only)
    # max_wait as multiples of t(1), for max batch b*/2, b*, 2b*; with the headline (b*, 1 x t(1))
    # b* gets three waits, which keeps a full run near 20 minutes on 2 cores.
    sweep_wait_factors: tuple[float, ...] = (0.25, 2.0)
    headline_wait_factor: float = 1.0
    bursty_s: float = 36.0
    bursty_on_s: float = 2.0
    bursty_off_s: float = 4.0
    bursty_peak_load: float = 1.5  # on-period rate, as a share of saturation
    mixed_s: float = 25.0
    mixed_load: float = 0.5  # of the mixed jobs' own saturation (a closed-loop flood of the mix first)
    degrade_factor: float = 1.0  # extra delay per batch on the slowed replica, in t(best batch)
    degraded_s: float = 25.0
    # Priority levels: Poisson at this share of saturation, a seeded pick of priority_high_share of
    # the jobs at priority 0 (high), the others at priority_rest (low: the low-priority jobs).
    priority_load: float = 0.9
    priority_high_share: float = 0.1
    priority_rest: int = LOW_PRIORITY
    priority_s: float = 30.0
    idle_s: float = 30.0  # efficiency: the idle window, after idle_settle_s without jobs
    idle_settle_s: float = 5.0
    # Efficiency variants in ABBA order (in order, then reversed, ...), each on fresh topics;
    # the figures are the mean of the rounds, and drift between consecutive runs cancels out.
    efficiency_rounds: int = 2
    efficiency_variants: tuple[str, ...] = ()  # () = every variant (efficiency.variants)
    policies: tuple[str, ...] = ("dynamic", "off", "static")  # which of the main three run
    result_timeout_s: float = 600.0
    # Speech scenario (speech.py); the defaults are the recorded run's.
    # 48: with 8 KV slots, 16 clips were two batches' worth, mostly fill and drain; the policies
    # differ in the steady state between them (benchmarks/results/speech-mixes-cpu-2026-12-05.txt).
    speech_clips: int = 48
    # Poisson arrivals per second; None: speech_load x the clips per second this machine serves
    # one at a time (measured first), so every machine sees the same overload, not the same rate.
    speech_rate: float | None = None
    speech_load: float = 2.5
    speech_seed: int = 7
    speech_rows: int = 8  # KV-cache slots: the budget is rows x one sequence's reservation
    speech_max_clip_s: float = 25.0
    speech_mix: str = "uniform"  # clip lengths: uniform | short-heavy (speech.sentences_per_clip)

    @classmethod
    def quick_preset(cls, **overrides: object) -> BenchConfig:
        base = cls(
            quick=True,
            scenarios=("poisson", "efficiency"),
            model_seconds_per_size=0.6,
            model_rounds=2,
            decode_clip_s=2.0,
            decode_repeats=3,
            flood_seconds=3.0,
            flood_jobs_min=24,
            static_flood=False,
            warmup_jobs_min=4,
            poisson_s=8.0,
            load_ladder=(TARGET_LOAD,),
            sweep=False,
            bursty_s=12.0,
            bursty_on_s=1.5,
            bursty_off_s=3.0,
            mixed_s=10.0,
            degraded_s=10.0,
            priority_s=15.0,
            efficiency_variants=("no bypass",),  # adaptive against the live question, not the history
            result_timeout_s=180.0,
            speech_clips=6,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]

    # Derived -------------------------------------------------------------------------------
    def threads(self) -> int:
        if self.torch_threads:
            return self.torch_threads
        return max(1, min(8, (os.cpu_count() or 2) // 2))

    def replicas(self) -> dict[str, int]:
        cores = os.cpu_count() or 2
        auto = 1 if cores <= 4 else min(self.partitions, cores // 4)
        return {
            "decode": self.decode_replicas or auto,
            "preprocess": self.preprocess_replicas or auto,
            "inference": 1,
            "sink": 1,
        }

    def runs_pipeline(self) -> bool:
        """Every scenario but speech needs the pipeline (and the decode and model-alone phases)."""
        return not self.scenarios or any(s != "speech" for s in self.scenarios)

    def modalities_needed(self) -> set[str]:
        needed = {self.modality}
        if "mixed" in self.scenarios:
            needed |= {"image", "video", "audio", "text"}
        return needed
