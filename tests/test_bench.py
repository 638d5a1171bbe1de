"""The benchmark harness, not the benchmark: a tiny run completes and its numbers hang
together. What it measures is not asserted (that is the benchmark's job, on a quiet machine).
"""

from __future__ import annotations

import json

import pytest

from mmpipe.harness.bench import simulate, traffic
from mmpipe.harness.bench.config import BenchConfig
from mmpipe.harness.bench.runner import run_bench


def test_schedules_are_seeded_and_shaped():
    assert traffic.poisson(20, 5, seed=1) == traffic.poisson(20, 5, seed=1)
    assert traffic.poisson(20, 5, seed=1) != traffic.poisson(20, 5, seed=2)
    burst = traffic.bursty(on_rate=50, on_s=1, off_s=2, duration_s=9, seed=3)
    assert all(a.offset_s % 3 < 1 for a in burst)  # nothing in the off periods
    mixed = traffic.poisson(200, 5, seed=4, modality="mixed")
    assert {a.modality for a in mixed} == set(traffic.MIXED_SHARES)


def test_simulated_batcher_follows_the_policy_rules():
    t = lambda b: 10.0 + 2.0 * b  # ms per batch
    flood = [0.0] * 64
    assert simulate.simulate(flood, simulate.SimPolicy("off", 1), t).mean_batch == 1
    full = simulate.simulate(flood, simulate.SimPolicy("dynamic", 8, 0.005), t)
    assert full.mean_batch == 8 and full.throughput == pytest.approx(8 / 0.026, rel=1e-3)
    # A lone item waits max_wait (dynamic) or the static timeout, then runs alone.
    lone = simulate.simulate([0.0], simulate.SimPolicy("dynamic", 8, 0.005), t)
    assert lone.p50_ms == pytest.approx(5 + 12)
    static = simulate.simulate([0.0], simulate.SimPolicy("static", 8, static_timeout_s=0.1), t)
    assert static.p50_ms == pytest.approx(100 + 12)


def test_routing_target_compares_the_routed_pair_with_the_healthy_pair_of_the_same_run():
    from mmpipe.harness.bench import targets

    def run(delays, routing, p99, throughput=5.0):
        stats = {"e2e_ms": {"p99": p99}, "throughput": throughput, "breakdown_ms": {"execute_ms": 1.0}, "ok": 1}
        resources = {"cpu_cores": {}, "wall_s": 1.0, "machine_busy_cores": 1.0, "machine_cores": 2, "other_busy_cores": 0.0}
        return {"scenario": "degraded", "label": "dyn", "topology": {"delays_ms": delays, "routing": routing},
                "stats": stats, "resources": resources}

    result = {"policies": {"headline": {"label": "dyn"}}, "model_alone": {"points": []},
              "runs": [run([0, 0], False, 1000), run([0, 80], False, 4500), run([0, 80], True, 1400)]}
    check = targets._routing(result)
    assert check["measured"] == pytest.approx(1.4) and check["status"] == "PASS"
    assert "hash 4500 ms (4.50x)" in check["detail"]
    result["runs"][2]["stats"]["e2e_ms"]["p99"] = 2000
    assert targets._routing(result)["status"] == "MISS"
    result["runs"].pop()
    assert targets._routing(result) is None  # no routed run: no target


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tiny_benchmark_run_is_consistent(tmp_path):
    cfg = BenchConfig.quick_preset(
        out_dir=tmp_path / "bench",
        device="cpu",
        torch_threads=1,
        scenarios=("poisson", "efficiency"),
        policies=("dynamic", "off"),
        idle_s=2.0,
        idle_settle_s=1.0,
        max_batch_cap=4,
        model_seconds_per_size=0.3,
        model_rounds=1,
        decode_clip_s=1.0,
        decode_repeats=1,
        flood_seconds=1.0,
        flood_jobs_min=8,
        warmup_jobs_min=2,
        poisson_s=3.0,
        result_timeout_s=120.0,
    )
    result = run_bench(cfg)

    written = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert written["runs"] and (tmp_path / "bench" / "bench.png").stat().st_size > 10_000
    variants = list(result["efficiency"])
    assert variants[0] == "adaptive" and "polling" in variants
    assert {run["scenario"] for run in result["runs"]} == {"flood", "poisson"} | {
        f"efficiency {v}{suffix}" for v in variants for suffix in ("", " flood")}
    for variant in result["efficiency"].values():
        assert {"broker", "decode-0", "preprocess-0", "inference-0", "sink-0"} <= set(variant["idle_ms_per_s"])
        cpu = variant["saturation"]["cpu"]
        assert cpu["total_ms"] == pytest.approx(sum(cpu["per_process_ms"].values()), abs=0.5)
        assert cpu["outside_model_ms"] == pytest.approx(cpu["total_ms"] - cpu["model_ms"], abs=0.2)
        per_job = variant["bytes_per_job"]
        assert per_job["ready"]["records"] == per_job["events"]["records"] == 1  # one image part per job
        assert per_job["ready"]["bytes"] > 3 * 224 * 224  # the uint8 crop and its header
    assert {"idle CPU per stage process", "CPU per job outside the model"} <= {t["name"] for t in result["targets"]}
    assert {run["label"] for run in result["runs"]} >= {"off", result["policies"]["headline"]["label"]}
    for run in result["runs"]:
        s = run["stats"]
        assert s["results"] == s["published"] == s["ok"] > 0, run["label"]
        assert s["missing"] == 0
        e2e = s["e2e_ms"]
        assert 0 < e2e["p50"] <= e2e["p95"] <= e2e["p99"] <= e2e["max"]
        assert sum(float(n) for n in s["batch_items"].values()) == s["ok"]
        assert s["throughput"] > 0
        assert sum(s["breakdown_ms"].values()) == pytest.approx(e2e["mean"], rel=0.02, abs=2.0)  # spans tile the path
        assert run["resources"]["peak_rss_mib"] and "inference-0" in run["resources"]["cpu_cores"]
        if run["scenario"].startswith("efficiency"):
            continue  # the efficiency runs are not simulated
        sim = run["sim"]
        assert sim["items"] == s["published"] and 0 < sim["p50_ms"] <= sim["p95_ms"] <= sim["p99_ms"]
    assert result["model_alone"]["points"][0]["batch_size"] == 1
    assert 0 < result["decode"]["ratio"]
    assert all(label in result["saturation"] for label in ("off", result["policies"]["headline"]["label"]))
    names = {t["name"]: t for t in result["targets"]}
    assert all(t["status"] in ("PASS", "MISS", "N/A") for t in names.values())
    assert names["pipeline / model-alone throughput"]["measured"] > 0
    assert result["meta"]["packages"]["torch"] and result["meta"]["cpu_count"]
