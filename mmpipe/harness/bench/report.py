"""The benchmark's three outputs: tables on the terminal, bench.json, bench.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mmpipe.harness.bench import efficiency
from mmpipe.harness.bench.stats import SPANS
from mmpipe.harness.bench.targets import curve_throughput

STATUS_STYLE = {"PASS": "[green]PASS[/]", "MISS": "[red]MISS[/]", "N/A": "[yellow]N/A[/]"}
MAIN_COLOURS = {"off": "tab:red", "static": "tab:orange", "dynamic": "tab:blue"}


def write_all(result: dict[str, Any], out_dir: Path, console: Console) -> dict[str, Path]:
    """bench.json always; bench.png when the pipeline ran (the speech scenario alone has no plot)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json"}
    paths["json"].write_text(json.dumps(result, indent=2, default=str))
    if "model_alone" in result:
        paths["png"] = out_dir / "bench.png"
        plot(result, paths["png"])
    print_report(result, console)
    console.print("wrote " + " and ".join(str(p) for p in paths.values()))
    return paths


# Terminal ------------------------------------------------------------------------------------------
def print_report(result: dict[str, Any], console: Console) -> None:
    console.print(header(result))
    if "model_alone" in result:
        console.print(model_table(result))
        console.print(runs_table(result))
        lost = sum(run["stats"]["missing"] for run in result["runs"])
        if lost:
            console.print(f"[red]{lost} published job(s) never got a result[/] although every stage had committed past "
                          "them: lost on the way; the runs' ok/pub columns say where")
        console.print(breakdown_table(result))
        for run in (r for r in result["runs"] if "priority" in r):
            console.print(priority_table(run))
        if result.get("efficiency"):
            console.print(efficiency_table(result["efficiency"]))
    if result.get("speech"):
        console.print(speech_table(result["speech"]))
    console.print(targets_table(result))


def header(result: dict[str, Any]) -> str:
    m = result["meta"]
    pk = m["packages"]
    gpu = f", GPU {m['gpu']} (CUDA {m.get('cuda')})" if m.get("gpu") else ""
    per_stage = f" ({m['torch_threads']} threads/stage)" if "model_alone" in result else ""
    text = (
        f"[bold]mmpipe bench[/] {m['git_commit']}  {m['cpu']} x{m['cpu_count']}{gpu}, {m['memory_gib']} GiB; "
        f"device {m['device']}, torch {pk['torch']}{per_stage}, torchvision {pk['torchvision']}, "
        f"av {pk['av']} (libavcodec {m['ffmpeg'].get('libavcodec')}), faust {pk['faust-streaming']}\n"
    )
    if "model_alone" in result:
        alone = result["model_alone"]
        text += (f"model {alone['model']}:{alone['version']} weights={alone['weights']} on {alone['device']}; replicas {m['replicas']}; "
                 f"load from other processes up to {_contention(result):.2f} cores during runs; ")
    if result.get("speech"):
        sp = result["speech"]
        text += f"speech {sp['model']} weights={sp['weights']}, {sp['threads']} torch threads; "
    return text + f"took {m['duration_s']:.0f}s"


def _contention(result: dict[str, Any]) -> float:
    """Most CPU that processes other than ours used during a run (a shared machine)."""
    return max((run["resources"]["other_busy_cores"] for run in result["runs"]), default=0.0)


def model_table(result: dict[str, Any]) -> Table:
    alone = result["model_alone"]
    table = Table(title=f"model alone: {alone['model']} (best batch {alone['best_batch']}, gain {alone['batching_gain']:.2f}x)")
    for col in ("batch", "ms/batch", "items/s", "timed"):
        table.add_column(col, justify="right")
    for p in alone["points"]:
        table.add_row(str(p["batch_size"]), f"{p['batch_ms']:.1f}", f"{p['items_per_s']:.1f}", str(p["iterations"]))
    return table


def runs_table(result: dict[str, Any]) -> Table:
    table = Table(title="pipeline runs (ms; throughput in jobs/s; thr of a flood = saturation; infer = batch wait + execute; "
                        "sim = simulated batcher with t(b) alone, sim* = with t(b) as executed in this run)")
    cols = ("scenario", "policy", "load", "rate", "ok/pub", "thr", "p50", "p95", "p99", "infer p99",
            "sim p50", "sim p99", "sim thr", "sim* p99", "batch", "lag peak", "cpu inf/all/other", "rss max")
    for col in cols:
        table.add_column(col, justify="left" if col in ("scenario", "policy") else "right", overflow="fold")
    for run in result["runs"]:
        s, sim, res = run["stats"], run.get("sim"), run["resources"]
        e2e = s["e2e_ms"]
        scenario = run["scenario"] + (f" x{run['topology']['replicas']}" if run["topology"]["replicas"] > 1 else "")
        if any(run["topology"]["delays_ms"]):
            scenario += " slowed"
        if run["topology"].get("routing"):
            scenario += " routed"
        cores = res["cpu_cores"]
        inference = sum(v for k, v in cores.items() if k.startswith("inference"))
        table.add_row(
            scenario, run["label"], _pct(run["load"]), _num(run["offered_rate"], 2), f"{s['ok']}/{s['published']}",
            f"{s['throughput']:.2f}", f"{e2e['p50']:.0f}", f"{e2e['p95']:.0f}", f"{e2e['p99']:.0f}",
            f"{s['inference_ms']['p99']:.0f}",
            _num(sim and sim["p50_ms"], 0), _num(sim and sim["p99_ms"], 0), _num(sim and sim["throughput"], 2),
            _num(sim and sim["in_pipeline"]["p99_ms"], 0),
            f"{s['mean_batch']}", str(max(run["lag_peak"].values(), default=0)),
            f"{inference:.2f}/{sum(cores.values()):.2f}/{res['other_busy_cores']:.2f}",
            f"{max(res['peak_rss_mib'].values(), default=0):.0f}",
        )
    return table


def breakdown_table(result: dict[str, Any]) -> Table:
    table = Table(title="stage breakdown: mean ms per job (q = waiting in the stage's input topic)")
    table.add_column("scenario")
    table.add_column("policy")
    table.add_column("load", justify="right")
    short = {"queue_decode_ms": "q dec", "decode_ms": "decode", "queue_preprocess_ms": "q prep", "preprocess_ms": "prep",
             "queue_inference_ms": "q inf", "batch_wait_ms": "batch wait", "execute_ms": "execute",
             "queue_sink_ms": "q sink", "sink_ms": "sink"}
    for span in SPANS:
        table.add_column(short[span], justify="right")
    table.add_column("batches (size:count)", overflow="fold")
    for run in result["runs"]:
        b = run["stats"]["breakdown_ms"]
        counts = " ".join(f"{k}:{v:g}" for k, v in run["stats"]["batch_count"].items())
        table.add_row(run["scenario"], run["label"], _pct(run["load"]), *[f"{b[span]:.0f}" for span in SPANS], counts)
    return table


def priority_table(run: dict[str, Any]) -> Table:
    """The priority scenario per level: latency percentiles, the batcher wait, and the
    starvation check at the batcher (overtakes against the window (p - q) x aging_s)."""
    fig = run["priority"]
    starve = fig["starvation"]
    ratio = fig["high_over_low_p99"]
    table = Table(title=f"priority levels ({run['label']}, {_pct(run['load'])} load, {_num(run['offered_rate'], 2)} jobs/s, "
                        f"aging_s {fig['aging_s']:g}; ms): high p99 / low p99 = {_num(ratio, 3)}; at the batcher "
                        f"{starve['beyond_bound']} job(s) overtaken beyond the starvation bound")
    cols = ("priority", "ok/jobs", "p50", "p95", "p99", "max", "batch wait p99", "batch wait max", "overtaken by (jobs, largest lead / window)")
    for col in cols:
        table.add_column(col, justify="left" if col.startswith("overtaken") else "right", overflow="fold")
    for level, v in fig["levels"].items():
        e2e, wait = v["e2e_ms"], v["batch_wait_ms"]
        over = " ".join(f"p{pair.split('<-')[1]}: {o['jobs_overtaken']}, {o['max_lead_s']:.2f}/{o['window_s']:g} s"
                        for pair, o in starve["pairs"].items() if pair.split("<-")[0] == level)
        table.add_row(level, f"{v['ok']}/{v['jobs']}", f"{e2e['p50']:.0f}", f"{e2e['p95']:.0f}", f"{e2e['p99']:.0f}",
                      f"{e2e['max']:.0f}", f"{wait['p99']:.0f}", f"{wait['max']:.0f}", over or "-")
    return table


def efficiency_table(eff: dict[str, Any]) -> Table:
    """Every efficiency figure per settings variant, and the ratio of the first to the others."""
    names = list(eff)
    rounds = _rounds(list(eff.values()))
    table = Table(title="efficiency: idle CPU, CPU and bytes per job at saturation, per settings variant (one run, each "
                        f"variant's mean of {rounds} round(s) in ABBA order on fresh topics; ms/s: 10 = 1% of a core)")
    table.add_column("figure", justify="left")
    for name in names:
        table.add_column(name, justify="right")
    for other in names[1:]:
        table.add_column(f"{names[0]}/{other}", justify="right")
    for label, values in efficiency_rows(eff):
        ratios = [_ratio(values[0], v) for v in values[1:]]
        table.add_row(label, *(_num(v, 2 if label.startswith(("other", "model alone")) else 1) for v in values), *ratios)
    return table


def _rounds(variants: list[dict[str, Any]]) -> int:
    """How many rounds the efficiency variants ran (results before ABBA rounds had one)."""
    return max((len(v.get("rounds", [])) for v in variants), default=0) or 1


def efficiency_rows(eff: dict[str, Any]) -> list[tuple[str, list[float | None]]]:
    variants = list(eff.values())

    def row(label: str, get: Any) -> tuple[str, list[float | None]]:
        values = []
        for v in variants:
            try:
                values.append(get(v))
            except (KeyError, TypeError, IndexError):
                values.append(None)
        return label, values

    procs = sorted({p for v in variants for p in v["idle_ms_per_s"]} | {p for v in variants for p in v["saturation"]["cpu"]["per_process_ms"]})
    topics = sorted({t for v in variants for t in v["bytes_per_job"]})
    rows = [row(f"other users' cores during {w}", lambda v, w=w: v["other_busy_cores"][w]) for w in ("idle", "light_load", "saturation")]
    rows += [row(f"idle CPU ms/s {p}", lambda v, p=p: v["idle_ms_per_s"][p]) for p in procs]
    rows += [
        row("p50 e2e ms at 30% load", lambda v: v["light_load"]["p50_ms"]),
        row("first job after idle, e2e ms", lambda v: v["light_load"]["first_job_ms"]),
    ]
    rows += [row(f"saturation CPU ms/job {p}", lambda v, p=p: v["saturation"]["cpu"]["per_process_ms"][p]) for p in procs]
    rows += [
        row("CPU ms/job all processes", lambda v: v["saturation"]["cpu"]["total_ms"]),
        row("CPU ms/job model alone (same batch)", lambda v: v["saturation"]["cpu"]["model_ms"]),
        row("CPU ms/job outside the model", lambda v: v["saturation"]["cpu"]["outside_model_ms"]),
        row("CPU ms/job model alone, at the round's probe", lambda v: v["saturation"]["cpu"]["model_ms_at_probe"]),
        row("CPU ms/job outside the model, at the probe", lambda v: v["saturation"]["cpu"]["outside_model_at_probe_ms"]),
        row("saturation jobs/s", lambda v: v["saturation"]["throughput"]),
        row("mean batch", lambda v: v["saturation"]["mean_batch"]),
        row("throughput / model alone (same batch)", lambda v: v["saturation"]["ratio_to_model_alone"]),
        row("execute inflation (in pipeline / alone)", lambda v: v["saturation"]["execute_inflation"]),
    ]
    rounds = _rounds(variants)
    if rounds > 2:  # one slow round (the host, not the pipeline) moves a mean; a median less
        rows.append(row("CPU ms/job outside the model, at the probe, median of rounds",
                        lambda v: efficiency.median_outside_model_ms(v["rounds"])))
    if rounds > 1:  # the spread between a variant's rounds, beside the ratios of their means
        for label, get in (("CPU ms/job outside the model, at the probe", lambda r: efficiency.outside_model_ms(r["saturation"]["cpu"])),
                           ("saturation jobs/s", lambda r: r["saturation"]["throughput"]),
                           ("p50 e2e ms at 30% load", lambda r: r["light_load"]["p50_ms"]),
                           ("model alone just before / at start", lambda r: r["model_probe"]["vs_start"])):
            rows += [row(f"{label}, round {i + 1}", lambda v, i=i, get=get: get(v["rounds"][i])) for i in range(rounds)]
    rows.append(row("records in the fullest partition (broker cost grows with it)", lambda v: v["largest_partition_records"]))
    rows += [row(f"bytes/job {t}", lambda v, t=t: v["bytes_per_job"][t]["bytes"]) for t in topics]
    rows += [row(f"records/job {t}", lambda v, t=t: v["bytes_per_job"][t]["records"]) for t in topics]
    return rows


def _offered(speech: dict[str, Any]) -> str:
    """What the rate was derived from, when it was not given."""
    if speech.get("one_at_a_time_clips_per_s") is None:
        return ""
    return f" ({speech['load']:g}x the {speech['one_at_a_time_clips_per_s']:g} clips/s served one at a time)"


def speech_table(speech: dict[str, Any]) -> Table:
    """One row per decoder scheduling policy, same clips and arrivals, and the peer's row."""
    table = Table(title=f"speech to text, decoder scheduling policies: {speech['clips']} espeak-ng clips, {speech['mix']} lengths "
                        f"({speech['audio_s']} s of audio), Poisson {speech['rate_per_s']:g}/s{_offered(speech)}, seed {speech['seed']}, "
                        f"{speech['runs'][0]['rows']} KV slots, on {speech['device']} (latency and TTFT from each clip's arrival)")
    cols = ("policy", "decoder tok/s", "rows/step", "live rows", "encoder s", "audio s/s", "latency p50/p99 s", "TTFT p50/p99 s",
            "KV peak/budget MB", "WER", "truncated", "cpu own/other")
    for col in cols:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in speech["runs"]:
        table.add_row(r["policy"], f"{r['decoder_tokens_per_s']:.1f}", f"{r['mean_step_rows']:.1f}",
                      f"{r['live_row_steps'] / max(r['steps'], 1):.1f}", f"{r['encoder_s']:.1f}",
                      f"{r['audio_s_per_s']:.1f}", f"{r['latency_p50_s']:.1f} / {r['latency_p99_s']:.1f}",
                      f"{r['ttft_p50_s']:.1f} / {r['ttft_p99_s']:.1f}",
                      f"{r['kv_peak_bytes'] / 1e6:.0f} / {r['kv_budget_bytes'] / 1e6:.0f}", f"{r['wer']:.3f}", str(r["truncated"]),
                      f"{r['resources']['cpu_cores']['bench']:.2f}/{r['resources']['other_busy_cores']:.2f}")
    peer = speech["peer"]
    if "audio_s_per_s" in peer:
        same = f"same tokens {speech['clips_where_peer_tokens_equal_continuous']}/{speech['clips']}"
        table.add_row(f"peer: {peer['peer']}", "", "", "", "", f"{peer['audio_s_per_s']:.1f}", "", "", "", same, "", "")
    else:
        table.add_row(f"peer: {peer['peer']} not run: {peer.get('error')}", *[""] * (len(cols) - 1))
    return table


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def targets_table(result: dict[str, Any]) -> Table:
    table = Table(title="targets (ratios measured in this run)")
    for col in ("target", "measured", "threshold", "status", "detail"):
        table.add_column(col, overflow="fold", justify="right" if col in ("measured", "threshold") else "left")
    for t in result["targets"]:
        detail = t["detail"]
        if "holds_back" in t:
            detail += f"\n[bold]holds back:[/] {t['holds_back']['summary']}"
        measured = "-" if t["measured"] is None else f"{t['measured']:.3g}{t['unit']}"
        table.add_row(t["name"], measured, f"{t['threshold']:g}{t['unit']}", STATUS_STYLE[t["status"]], detail)
    return table


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# Plot --------------------------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_model) = plt.subplots(1, 2, figsize=(17, 6.5), gridspec_kw={"width_ratios": [2, 1], "wspace": 0.6})
    _latency_throughput(ax, result)
    _model_curve(ax_model, result)
    m = result["meta"]
    fig.suptitle(f"mmpipe bench {m['git_commit']}: {result['model_alone']['model']}:{result['model_alone']['version']} "
                 f"({result['model_alone']['weights']} weights), torch {m['packages']['torch']}, {m['torch_threads']} threads/stage, "
                 f"on {m['device']}, {m['cpu_count']} CPUs{', ' + m['gpu'] if m.get('gpu') else ''}\n"
                 f"{m['cpu']}; other processes used up to {_contention(result):.2f} cores during the runs", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _latency_throughput(ax: Any, result: dict[str, Any]) -> None:
    policies = result["policies"]
    main = {policies[role]["label"]: role for role in ("off", "static", "headline")}
    for label, role in main.items():
        colour = MAIN_COLOURS[policies[role]["mode"]]
        runs = sorted((r for r in result["runs"] if r["scenario"] == "poisson" and r["label"] == label), key=lambda r: r["load"])
        if runs:
            x = [r["stats"]["throughput"] for r in runs]
            ax.plot(x, [r["stats"]["e2e_ms"]["p99"] for r in runs], "o-", color=colour, label=f"{label} p99")
            ax.plot(x, [r["stats"]["e2e_ms"]["p50"] for r in runs], "s--", color=colour, alpha=0.6, label=f"{label} p50")
        sim = result["simulation_curves"].get(label)
        if sim:
            # Only the stable part: past saturation the simulated queue just grows with the run.
            points = [p for p in sim["points"] if p["throughput"] >= 0.97 * p["rate"]]
            ax.plot([p["throughput"] for p in points], [p["p99_ms"] for p in points], ":", color=colour, alpha=0.7,
                    label=f"{label} p99, simulated (batcher only)")
        if label in result["saturation"]:
            ax.axvline(result["saturation"][label], color=colour, linestyle="-.", alpha=0.5, linewidth=1)
    sweep = [r for r in result["runs"] if r["scenario"] == "poisson" and r["label"] not in main]
    for r in sweep:
        ax.plot(r["stats"]["throughput"], r["stats"]["e2e_ms"]["p99"], "x", color="tab:purple")
        ax.annotate(r["label"].replace("dynamic ", ""), (r["stats"]["throughput"], r["stats"]["e2e_ms"]["p99"]), fontsize=7)
    if sweep:
        ax.plot([], [], "x", color="tab:purple", label="dynamic sweep p99 (70% load)")
    ax.set_yscale("log")
    alone = result["model_alone"]
    bottom = ax.get_ylim()[0]
    for batch, style in ((1, ":"), (alone["best_batch"], "--")):
        thr = curve_throughput(result, batch)
        ax.axvline(thr, color="grey", linestyle=style, linewidth=1)
        ax.annotate(f"model alone b={batch}", (thr, bottom), rotation=90, fontsize=7, color="grey", va="bottom")
    ax.set_xlabel("throughput (jobs/s)   [dash-dot: pipeline saturation per policy]")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.set_title("latency vs throughput, Poisson arrivals")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _model_curve(ax: Any, result: dict[str, Any]) -> None:
    points = result["model_alone"]["points"]
    sizes = [p["batch_size"] for p in points]
    ax.plot(sizes, [p["items_per_s"] for p in points], "o-", color="tab:green", label="items/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("model-alone throughput (items/s)", color="tab:green")
    twin = ax.twinx()
    twin.plot(sizes, [p["batch_ms"] for p in points], "s--", color="tab:gray", label="ms/batch")
    twin.set_ylabel("ms per batch t(b)", color="tab:gray")
    ax.set_ylim(bottom=0)  # a flat curve (a CPU) should look flat
    twin.set_ylim(bottom=0)
    ax.set_title(f"model alone (best b={result['model_alone']['best_batch']})")
    ax.grid(True, alpha=0.3)
