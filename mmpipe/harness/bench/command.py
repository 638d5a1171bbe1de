"""The `bench` command, shared by `mmpipe bench` and benchmarks/run_bench.py.

Kept free of heavy imports: mmpipe.cli (which every stage process imports) registers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def bench(
    quick: bool = typer.Option(False, "--quick", help="a shorter run: off/static/dynamic at 70% load, and the efficiency scenario with 'no bypass' beside 'adaptive'"),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N (model alone and inference stage alike)"),
    seed: int = typer.Option(42, help="seed of every arrival schedule and of the simulation"),
    rate: Optional[float] = typer.Option(None, help="jobs/s of the 70%-load runs (default: 0.7 x measured saturation)"),
    out: Path = typer.Option(Path("bench-out"), "--out", help="directory for bench.json, bench.png and the run's logs"),
    scenario: str = typer.Option(
        "all", help="poisson | bursty | degraded | mixed | priority | efficiency | speech | all (comma-separated list allowed). "
                    "all includes speech (Whisper decoder policies in the bench process, no pipeline; 1-3 min on "
                    "2 cores, 48 clips); --quick runs poisson,efficiency unless scenarios are named"),
    modality: str = typer.Option("image", help="traffic of poisson/bursty/degraded/priority: image | audio | text"),
    torch_threads: int = typer.Option(0, help="torch threads per stage process and for the model alone (0: half the cores); "
                                                 "speech: 0 = every core up to 8"),
    decode_replicas: int = typer.Option(0, help="decode stage processes (0: auto, 1 on small machines)"),
    preprocess_replicas: int = typer.Option(0, help="preprocess stage processes (0: auto)"),
    model_cpus: str = typer.Option("auto", help="cores for the inference model thread alone, the rest for everything else: "
                                                "auto (CPU device: the last torch-threads cores) | none | e.g. 1 or 2,3"),
    efficiency_rounds: int = typer.Option(2, help="efficiency: rounds of the settings variants in ABBA order, each "
                                                  "on fresh topics; the figures are the mean of the rounds"),
    efficiency_variants: str = typer.Option("", help="efficiency: a comma-separated subset of the variants to run beside "
                                                     "'adaptive' (consumer thread, no wake-ups, whole frames, no bypass, fused, "
                                                     "polling); empty: all (--quick: no bypass)"),
    priority_seconds: Optional[float] = typer.Option(None, help="priority: seconds of Poisson arrivals per run (default 30; "
                                                              "--quick 15); longer runs give the high jobs' p99 more jobs"),
    speech_clips: Optional[int] = typer.Option(None, help="speech: espeak-ng clips of 1-25 s (default 48; --quick 6)"),
    speech_rate: Optional[float] = typer.Option(None, help="speech: Poisson arrivals per second (default: --speech-load "
                                                           "x the clips/s served one at a time, measured first)"),
    speech_load: Optional[float] = typer.Option(None, help="speech: offered load as a multiple of the one-at-a-time "
                                                           "capacity (default 2.5)"),
    speech_seed: Optional[int] = typer.Option(None, help="speech: seed of the clips and their arrivals (default 7)"),
    speech_rows: Optional[int] = typer.Option(None, help="speech: KV-cache slots; the budget is rows x one sequence's "
                                                         "reservation (default 8)"),
    speech_mix: Optional[str] = typer.Option(None, help="speech: clip lengths, uniform (1-7 sentences alike, the default) | "
                                                        "short-heavy (4 in 5 one sentence, the rest as long as fits)"),
) -> None:
    """Benchmark batching policies on the real pipeline (embedded broker, one process per stage), and the
    speech-to-text decoder scheduling policies (off / request-level / continuous) on the same arrivals."""
    from mmpipe.harness.bench.config import MODALITIES, SCENARIOS, SPEECH_MIXES, BenchConfig
    from mmpipe.harness.bench.runner import run_bench

    scenarios = SCENARIOS if scenario == "all" else tuple(s.strip() for s in scenario.split(",") if s.strip())
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise typer.BadParameter(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)} or all")
    if modality not in MODALITIES:
        raise typer.BadParameter(f"modality must be one of {', '.join(MODALITIES)}")
    if speech_mix is not None and speech_mix not in SPEECH_MIXES:
        raise typer.BadParameter(f"--speech-mix must be one of {', '.join(SPEECH_MIXES)}")
    options = dict(
        out_dir=out, device=device, seed=seed, rate=rate, modality=modality, torch_threads=torch_threads,
        decode_replicas=decode_replicas, preprocess_replicas=preprocess_replicas, model_cpus=model_cpus,
        efficiency_rounds=efficiency_rounds,
    )
    named_variants = tuple(v.strip() for v in efficiency_variants.split(",") if v.strip())
    unless_preset = dict(efficiency_variants=named_variants or None, priority_s=priority_seconds, speech_clips=speech_clips,
                         speech_rate=speech_rate, speech_load=speech_load, speech_seed=speech_seed, speech_rows=speech_rows,
                         speech_mix=speech_mix)
    options.update({k: v for k, v in unless_preset.items() if v is not None})  # else the preset's
    if quick:
        # --quick runs the poisson scenario unless scenarios were named explicitly.
        config = BenchConfig.quick_preset(**options, **({} if scenario == "all" else {"scenarios": scenarios}))
    else:
        config = BenchConfig(**options, scenarios=scenarios)
    run_bench(config)
