"""The benchmark harness, not the benchmark: a tiny run completes and its numbers hang
together. What it measures is not asserted (that is the benchmark's job, on a quiet machine).
"""

from __future__ import annotations

import json
import time

import numpy as np
import psutil
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


def test_simulated_routing_places_work_by_each_workers_reported_backlog():
    """The real Router over simulated replicas (no shared CPU): around a replica slowed by
    t(4) per batch it keeps the batcher's p99 far below hash placement, and the workers' own
    backlog counts route better than the group's committed lag, which also counts work
    finished since the last commit (what routing read before)."""
    from mmpipe.schemas.settings import SchedulingSettings

    t = lambda b: float(np.interp(b, [1, 2, 4, 8, 16], [47.1, 80.6, 152.8, 303.8, 642.5]))  # a recorded t(b), ms
    policy, slow = simulate.SimPolicy("dynamic", 4, 0.047), (0.0, 152.8)
    arrivals = [a.offset_s for a in traffic.poisson(11.6, 120, seed=42)]
    healthy = simulate.simulate(arrivals, policy, t, replicas=2, extra_ms=(0.0, 0.0), seed=1)
    hashed = simulate.simulate(arrivals, policy, t, replicas=2, extra_ms=slow, seed=1)
    scheduling = SchedulingSettings(routing=True)
    routed = simulate.simulate_routed(arrivals, policy, t, scheduling, extra_ms=slow)
    on_lag = simulate.simulate_routed(arrivals, policy, t, scheduling, extra_ms=slow, committed_lag=True)
    assert routed.items == len(arrivals) and routed.throughput > 0.95 * 11.6
    assert routed.p99_ms < 0.7 * hashed.p99_ms and routed.p99_ms < 2.0 * healthy.p99_ms
    assert routed.p99_ms < 0.8 * on_lag.p99_ms


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
        efficiency_rounds=1,  # ABBA rounds: test_efficiency_rounds_*
    )
    result = run_bench(cfg)

    written = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert written["runs"] and (tmp_path / "bench" / "bench.png").stat().st_size > 10_000
    variants = list(result["efficiency"])
    assert variants == ["adaptive", "no bypass"]  # --quick: the default against every part through preprocess
    assert {run["scenario"] for run in result["runs"]} == {"flood", "poisson"} | {
        f"efficiency {v}{suffix}" for v in variants for suffix in ("", " flood")}
    for name, variant in result["efficiency"].items():
        bypass = variant["settings"]["preprocess_bypass"]  # what tells the variants apart
        assert bypass is (name == "adaptive")
        running = {"broker", "decode-0", "preprocess-0", "inference-0", "sink-0"}
        assert set(variant["idle_ms_per_s"]) == set(variant["saturation"]["cpu"]["per_process_ms"]) == running
        assert ("decoded" in variant["bytes_per_job"]) is not bypass  # image crops skip the decoded hop
        assert variant["model_probe"]["items_per_s"] > 0 and variant["model_probe"]["vs_start"] > 0
        cpu = variant["saturation"]["cpu"]
        assert cpu["total_ms"] == pytest.approx(sum(cpu["per_process_ms"].values()), abs=0.5)
        assert cpu["outside_model_ms"] == pytest.approx(cpu["total_ms"] - cpu["model_ms"], abs=0.2)
        at_probe = cpu["total_ms"] - cpu["model_ms"] / variant["model_probe"]["vs_start"]
        assert cpu["outside_model_at_probe_ms"] == pytest.approx(at_probe, abs=0.3)
        per_job = variant["bytes_per_job"]
        assert per_job["ready"]["records"] == per_job["events"]["records"] == 1  # one image part per job
        assert per_job["ready"]["bytes"] > 3 * 224 * 224  # the uint8 crop and its header
        assert variant["largest_partition_records"] > 0  # fresh topics: what the broker's figures hold at
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


@pytest.mark.timeout(240)
def test_tiny_speech_scenario_is_consistent(tmp_path):
    """`mmpipe bench --scenario speech` on two short clips: no pipeline, the three policies on
    the same arrivals generate the same tokens, the KV reservation stays within its budget, the
    word error rate is computed, and the targets and bench.json come out."""
    cfg = BenchConfig.quick_preset(
        out_dir=tmp_path / "bench", device="cpu", torch_threads=2, scenarios=("speech",),
        speech_clips=2, speech_load=2.0, speech_rows=2, speech_max_clip_s=5.0,
    )
    result = run_bench(cfg)

    written = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert "model_alone" not in written and not (tmp_path / "bench" / "bench.png").exists()  # no pipeline ran
    speech = written["speech"]
    assert speech == json.loads(json.dumps(result["speech"]))
    assert speech["clips"] == len(speech["clip_s"]) == 2 and all(0 < s <= 5.0 for s in speech["clip_s"])
    # No rate given: twice the clips/s this machine served one at a time, measured first.
    assert speech["one_at_a_time_clips_per_s"] > 0
    assert speech["rate_per_s"] == pytest.approx(2.0 * speech["one_at_a_time_clips_per_s"], rel=0.01)
    runs = {r["policy"]: r for r in speech["runs"]}
    assert list(runs) == ["off", "request", "continuous"]
    assert speech["clips_where_policies_agree"] == 2
    assert len({r["tokens"] for r in runs.values()}) == 1 and runs["off"]["tokens"] > 0
    for r in runs.values():
        assert 0 < r["kv_peak_bytes"] <= r["kv_budget_bytes"]
        assert 0.0 <= r["wer"] <= 1.0
        assert r["decoder_tokens_per_s"] > 0 and r["audio_s_per_s"] > 0
        assert r["resources"]["cpu_cores"]["bench"] > 0 and r["resources"]["other_busy_cores"] >= 0
        assert 0 < r["ttft_p50_s"] <= r["latency_p50_s"] and r["latency_p50_s"] <= r["latency_p99_s"]
    assert runs["off"]["mean_step_rows"] == 1.0 and runs["off"]["kv_peak_bytes"] * 2 == runs["off"]["kv_budget_bytes"]
    # Only request-level batching steps padding rows; its ceiling for any scheduler follows from them.
    assert runs["off"]["row_steps"] == runs["off"]["live_row_steps"] == runs["off"]["steps"]
    assert runs["continuous"]["row_steps"] == runs["continuous"]["live_row_steps"]
    assert runs["request"]["row_steps"] >= runs["request"]["live_row_steps"] > 0
    assert speech["mix"] == "uniform"
    ceiling = speech["scheduling_ceiling"]
    assert ceiling["padding_share"] == round(1 - runs["request"]["live_row_steps"] / runs["request"]["row_steps"], 3)
    assert all(sum(c["steps"] for c in r["step_ms_by_rows"].values()) == r["steps"] for r in runs.values())
    assert ceiling["ceiling"] > 0 and ceiling["cheapest_row_ms"] > 0
    assert all(0 < r["fill_s"] < r["decoder_s"] for r in runs.values())  # one fill per clip, inside the steps
    assert ceiling["fill_s"] == min(r["fill_s"] for r in runs.values())
    assert speech["continuous_vs_request_decoder_tokens_per_s"] == pytest.approx(
        runs["continuous"]["decoder_tokens_per_s"] / runs["request"]["decoder_tokens_per_s"], abs=0.01)
    assert "error" not in speech["peer"] and speech["peer"]["audio_s_per_s"] > 0
    names = {t["name"]: t for t in result["targets"]}
    assert {n for n in names if n.startswith("speech:")} == set(names)  # only the speech targets
    assert names["speech: KV reservation / budget (peak)"]["status"] == "PASS"
    assert names["speech: word error rate (worst policy)"]["measured"] == max(r["wer"] for r in runs.values())
    assert all(t["status"] in ("PASS", "MISS") for t in names.values())


def test_speech_mixes_differ_in_how_long_the_longest_clip_runs():
    """short-heavy: about four clips in five are one sentence, the rest as many as there are
    (trimmed to the clip limit later); uniform: 1 to 7 alike. An unknown mix is refused."""
    import numpy as np

    from mmpipe.harness.bench.speech import SENTENCES, sentences_per_clip

    rng = np.random.default_rng(1)
    short_heavy = [sentences_per_clip("short-heavy", rng) for _ in range(2000)]
    uniform = [sentences_per_clip("uniform", rng) for _ in range(2000)]
    assert set(short_heavy) == {1, len(SENTENCES)} and 0.77 < short_heavy.count(1) / 2000 < 0.83
    assert set(uniform) == set(range(1, 8))
    with pytest.raises(ValueError, match="unknown speech mix"):
        sentences_per_clip("bimodal", rng)


def _job(job_id, priority, arrived, started, execute_ms=40.0):
    """A stored result whose trace puts it in the batcher from `arrived` to `started` (seconds)."""
    from mmpipe.schemas import JobResult, Timings

    before = dict(queue_decode_ms=10.0, decode_ms=5.0, queue_preprocess_ms=4.0, preprocess_ms=3.0, queue_inference_ms=3.0)
    wait = (started - arrived) * 1000
    timings = Timings(**before, batch_wait_ms=wait, execute_ms=execute_ms, sink_ms=2.0, batch_size=2,
                      end_to_end_ms=sum(before.values()) + wait + execute_ms + 2.0)
    created = 1000.0 + arrived - sum(before.values()) / 1000
    return JobResult(job_id=job_id, status="ok", modality="image", model=None, prediction=None, timings=timings,
                     created_at=created, completed_at=created + timings.end_to_end_ms / 1000, priority=priority)


def test_priority_schedule_marks_a_seeded_share_high_and_keeps_the_arrivals():
    arrivals = traffic.poisson(20, 10, seed=5)
    marked = traffic.with_priorities(arrivals, 0.1, seed=5)
    assert marked == traffic.with_priorities(arrivals, 0.1, seed=5)
    assert [a.offset_s for a in marked] == [a.offset_s for a in arrivals]
    assert sum(a.priority == 0 for a in marked) == round(0.1 * len(arrivals))
    assert {a.priority for a in marked} == {0, 2}
    assert {a.priority for a in traffic.with_priorities(arrivals, 0.1, seed=5, rest=1)} == {0, 1}
    assert {a.priority for a in arrivals} == {1}  # other scenarios keep the events' default


def test_priority_figures_and_starvation_check_from_the_traces():
    import io

    import msgspec
    from rich.console import Console

    from mmpipe.harness.bench import report, stats, targets

    jobs = [
        _job("L1", 2, 0.0, 1.5), _job("L2", 2, 0.1, 1.5),  # one batch at 1.5 ...
        _job("H1", 0, 0.5, 1.0),  # ... overtaken by H1 (0.5 s after L1: inside the 2 s window)
        _job("H2", 0, 1.2, 1.5),  # same batch as L1 and L2: not an overtake
    ]
    fig = stats.priority_stats(jobs, aging_s=1.0)
    starve = fig["starvation"]
    assert (fig["high"], fig["low"]) == (0, 2) and fig["levels"]["0"]["ok"] == fig["levels"]["2"]["ok"] == 2
    assert fig["high_over_low_p99"] == pytest.approx(fig["levels"]["0"]["e2e_ms"]["p99"] / fig["levels"]["2"]["e2e_ms"]["p99"], abs=1e-4)
    assert starve["jobs"] == 4 and starve["beyond_bound"] == 0
    assert starve["pairs"] == {"2<-0": {"window_s": 2.0, "max_lead_s": 0.5, "jobs_overtaken": 2}}
    assert starve["low"]["longest_wait"] == {"job_id": "L1", "overtaken_by": 1, "max_lead_s": 0.5}
    assert starve["low"]["max_batch_wait_ms"] == pytest.approx(1500)

    # L4 waits until 3.0 s: H3 arrived 2.4 s after it (beyond 2 x aging_s) and L1, L2 (its own
    # level, after it) ran first: overtaken beyond the bound.
    jobs += [_job("H3", 0, 2.3, 2.4), _job("L4", 2, -0.1, 3.0)]
    expired = msgspec.structs.replace(jobs[0], job_id="E1", status="expired", priority=1)
    fig = stats.priority_stats(jobs + [expired], aging_s=1.0)
    starve = fig["starvation"]
    assert starve["beyond_bound"] == 1 and starve["beyond_jobs"] == ["L4"]
    assert starve["pairs"]["2<-0"]["max_lead_s"] == pytest.approx(2.4) and starve["pairs"]["2<-2"]["window_s"] == 0
    assert fig["levels"]["1"] == {**fig["levels"]["1"], "jobs": 1, "ok": 0}  # an expired job counts, is not timed
    assert (fig["high"], fig["low"]) == (0, 2)

    run = {"scenario": "priority", "label": "dyn", "load": 0.9, "offered_rate": 8.5, "priority": fig}
    ratio, starvation = targets._priorities({"runs": [run]})
    assert ratio["measured"] == pytest.approx(fig["high_over_low_p99"], abs=1e-3)
    assert ratio["status"] == ("PASS" if fig["high_over_low_p99"] <= 1 / 3 else "MISS")
    assert starvation["measured"] == 1 and starvation["status"] == "MISS" and "L4" in starvation["detail"]
    assert "Not checked" in starvation["detail"]
    assert targets._priorities({"runs": []}) == []
    # Runs on one schedule: the worst run with the priority mechanisms is judged, the runs
    # without them reported beside it.
    run["stats"] = {"throughput": 8.4}
    baseline = {**run, "label": "dyn no-expedite no-lanes", "mechanisms": False, "priority": {**fig, "high_over_low_p99": 0.9}}
    better = {**run, "mechanisms": True, "priority": {**fig, "high_over_low_p99": 0.05}}
    no_slot = {**run, "label": "dyn no-slot", "mechanisms": True, "urgent_slot": False,
               "priority": {**fig, "high_over_low_p99": 0.95}}
    ratio, _ = targets._priorities({"runs": [baseline, {**run, "mechanisms": True, "urgent_slot": True}, no_slot, better]})
    assert ratio["measured"] == pytest.approx(fig["high_over_low_p99"], abs=1e-3)  # the no-slot run is not judged
    assert "(dyn no-expedite no-lanes): 0.900" in ratio["detail"] and "the worst of" in ratio["detail"]
    assert "without the urgent slot (dyn no-slot): 0.950" in ratio["detail"]
    # A judged run that served under 95 % of its offered rate was overloaded: no verdict.
    slow = {**better, "stats": {"throughput": 7.9}}
    ratio, _ = targets._priorities({"runs": [slow]})
    assert ratio["status"] == "N/A" and ratio["detail"].startswith("not judged: overloaded, 7.90 of 8.50 offered")
    # The high jobs alone (the floor run): the best ratio the loaded runs could reach.
    alone = stats.priority_stats([_job("A1", 0, 0.5, 0.5), _job("A2", 0, 1.2, 1.2)], aging_s=1.0)
    floor_run = {"scenario": "priority floor", "label": "dyn", "priority": alone}
    ratio, _ = targets._priorities({"runs": [run, floor_run]})
    alone_p99 = alone["levels"]["0"]["e2e_ms"]["p99"]
    assert f"p99 {alone_p99:.0f} ms" in ratio["detail"]
    assert f"below {alone_p99 / fig['levels']['2']['e2e_ms']['p99']:.3f}" in ratio["detail"]
    out = io.StringIO()
    Console(file=out, width=200).print(report.priority_table(run))
    assert "p0: 3, 2.40/2 s p2: 1, 0.20/0 s" in out.getvalue()


def _done(job_id, created_at, completed_at):
    from mmpipe.schemas import JobResult, Timings

    return JobResult(job_id=job_id, status="ok", modality="image", model=None, prediction=None, timings=Timings(),
                     created_at=created_at, completed_at=completed_at)


def test_saturation_throughput_is_the_staircase_slope_while_fed_and_not_a_clump():
    from mmpipe.harness.bench import stats

    # A steady closed loop: a batch of 4 every 0.1 s for 2 s, a job published per completion.
    steady = [_done(f"s{i}", 0.0 if i < 8 else 0.1 * (i // 4 - 2), 0.1 * (i // 4) + 0.001 * (i % 4)) for i in range(80)]
    assert stats.run_stats(steady, 80, flood=True)["throughput"] == pytest.approx(40, rel=0.1)

    # A tiny flood: the only completions before the last arrival are one batch finishing within
    # 3 ms; a line through them would claim 1000+ jobs/s. The run's count is used instead.
    tiny = [_done(f"t{i}", 0.0, 0.5 + 0.001 * i) for i in range(4)]
    tiny += [_done(f"t{i}", 0.6, 1.0 + 0.25 * (i - 4)) for i in range(4, 8)]
    figure = stats.run_stats(tiny, 8, flood=True)["throughput"]
    assert figure == pytest.approx(7 / (1.75 - 0.5), rel=1e-3)


def test_efficiency_variants_each_name_every_changed_setting_and_run_in_abba_order():
    from mmpipe.harness.bench import efficiency
    from mmpipe.schemas.settings import load_settings

    settings = load_settings().model_copy(update={"fetch_wakeups": True, "consumer_in_thread": False, "decode_center_crop": True,
                                                  "fuse_preprocess": False, "preprocess_bypass": True,
                                                  "event_loop": "uvloop", "lag_interval_s": 1.0})
    variants = efficiency.variants(settings)
    assert list(variants) == ["adaptive", "consumer thread", "asyncio loop", "no wake-ups", "lag twice a second", "whole frames",
                              "no bypass", "fused", "polling"]
    keys = set(variants["polling"])
    assert all(set(o) == keys for o in variants.values())  # each applies alone, whatever ran before
    assert variants["adaptive"] == {k: getattr(settings, k) for k in keys}  # this build's own settings
    assert variants["consumer thread"] == variants["adaptive"] | {"consumer_in_thread": True}
    assert variants["no wake-ups"]["fetch_wakeups"] is False and variants["no wake-ups"]["consumer_in_thread"] is False
    assert variants["polling"]["consumer_in_thread"] is True and variants["polling"]["event_loop"] == "asyncio"
    assert variants["asyncio loop"] == variants["adaptive"] | {"event_loop": "asyncio"}
    assert variants["lag twice a second"] == variants["adaptive"] | {"lag_interval_s": 0.5}
    assert variants["polling"]["lag_interval_s"] == 0.5
    assert variants["whole frames"] == variants["adaptive"] | {"decode_center_crop": False}
    assert variants["no bypass"] == variants["adaptive"] | {"preprocess_bypass": False}
    assert variants["fused"] == variants["adaptive"] | {"fuse_preprocess": True}
    subset = efficiency.variants(settings, only=("whole frames",))
    assert subset == {"adaptive": {"decode_center_crop": True}, "whole frames": {"decode_center_crop": False}}
    with pytest.raises(ValueError, match="unknown efficiency variant"):
        efficiency.variants(settings, only=("no such",))
    order = [name for name, _ in efficiency.round_order(subset, 2)]
    assert order == ["adaptive", "whole frames", "whole frames", "adaptive"]


def test_cpu_outside_the_model_is_judged_against_the_model_s_speed_at_the_round_s_probe():
    from mmpipe.harness.bench import efficiency

    run = {"resources": {"wall_s": 10.0, "cpu_cores": {"broker": 0.1, "inference-0": 0.9, "bench": 0.5}}, "stats": {"ok": 100}}
    curve_only = efficiency.cpu_per_job(run, 80.0)
    assert curve_only["per_process_ms"] == {"broker": 10.0, "inference-0": 90.0}  # the bench's own client is not billed
    assert (curve_only["total_ms"], curve_only["outside_model_ms"]) == (100.0, 20.0)
    assert efficiency.outside_model_ms(curve_only) == 20.0
    # The model ran 1.25x faster just before this round than in the curve at the start: it
    # needs 64 ms of CPU per item then, not 80, so 36 ms went elsewhere, not 20.
    probed = efficiency.cpu_per_job(run, 80.0, probe_vs_start=1.25)
    assert (probed["model_ms_at_probe"], probed["outside_model_at_probe_ms"]) == (64.0, 36.0)
    assert efficiency.outside_model_ms(probed) == 36.0


def test_efficiency_rounds_are_averaged_leaf_by_leaf_and_kept():
    from mmpipe.harness.bench import efficiency

    one = {"idle_s": 30.0, "settings": {"fetch_wakeups": True, "model_cpus": [1]},
           "saturation": {"throughput": 20.0, "cpu": {"per_process_ms": {"broker": 6.0, "sink-0": 4.0}}}}
    two = {"idle_s": 30.0, "settings": {"fetch_wakeups": True, "model_cpus": [1]},
           "saturation": {"throughput": 30.0, "cpu": {"per_process_ms": {"broker": 9.0, "sink-0": 5.0}}}}
    merged = efficiency.mean_of_rounds([one, two])
    assert merged["saturation"]["throughput"] == 25.0
    assert merged["saturation"]["cpu"]["per_process_ms"] == {"broker": 7.5, "sink-0": 4.5}
    assert merged["settings"] == {"fetch_wakeups": True, "model_cpus": [1]}  # not numbers: the first round's
    assert merged["rounds"] == [one, two]
    # The judged figure is the mean of rounds; its median is reported beside it.
    rounds = [{"saturation": {"cpu": {"outside_model_ms": x}}} for x in (14.0, 25.0, 15.0, 16.0)]
    assert efficiency.mean_of_rounds(rounds)["saturation"]["cpu"]["outside_model_ms"] == 17.5
    assert efficiency.median_outside_model_ms(rounds) == 15.5


def test_a_stage_s_cpu_includes_its_worker_processes_and_the_ones_it_reaped():
    """Decode decodes in worker processes: the bench bills their CPU to the stage, live or
    recycled, and never to a process watched without its children."""
    import subprocess
    import sys

    from mmpipe.harness.bench.resources import ResourceSampler

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys\n"
        f"live = subprocess.Popen([sys.executable, '-c', {burn + 'time.sleep(30)'!r}])\n"
        f"subprocess.run([sys.executable, '-c', {burn!r}])\n"  # reaped: in children_* from here on
        "sys.stdout.write('ready\\n'); sys.stdout.flush(); live.wait()\n")], stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline() == b"ready\n"
        sampler = ResourceSampler()
        sampler.watch("tree", parent.pid, with_children=True)
        sampler.watch("alone", parent.pid)
        # The live child may still be burning its 0.4 s: wait until both children's time shows.
        deadline = time.monotonic() + 10
        while sampler._cpu["tree"] - sampler._cpu["alone"] < 0.75 and time.monotonic() < deadline:
            time.sleep(0.1)
            sampler._sample()
        assert sampler._cpu["tree"] - sampler._cpu["alone"] >= 0.75  # two children of 0.4 s each
        assert sampler._cpu["alone"] < 0.4  # the parent itself only waits
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
