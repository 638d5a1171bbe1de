"""The `mmpipe` command: a thin layer over streams/, stages/, models/ and the store."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from mmpipe.capacity import LATENCY_BUDGET_S
from mmpipe.schemas.settings import Settings, load_settings, redact_url
from mmpipe.streams.topology import STAGE_NAMES

if TYPE_CHECKING:
    from mmpipe.supervisor import Pipeline

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()



def _settings(bootstrap: str | None = None, **overrides: object) -> Settings:
    settings = load_settings()
    updates = {k: v for k, v in overrides.items() if v is not None}
    if bootstrap:
        updates["bootstrap"] = bootstrap
    return settings.model_copy(update=updates) if updates else settings


def _process_settings(role: str, bootstrap: str | None) -> Settings:
    """A long-running process's settings: its Kafka client ID names its role."""
    settings = _settings(bootstrap)
    return settings.model_copy(update={"client_id": f"{settings.client_id}-{role}"})


BootstrapOpt = Annotated[Optional[str], typer.Option(help="Kafka bootstrap servers (default: settings)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON (one document, or one line per item) for scripts")]


def _print_json(value: object) -> None:
    """Compact JSON on stdout, never wrapped or coloured (rich would do both)."""
    import orjson

    from mmpipe.report import to_jsonable

    typer.echo(orjson.dumps(to_jsonable(value)).decode())


def logging_level(name: str) -> str:
    """The logging module's name for a configured level ("warn" and "warning" both work)."""
    upper = name.upper()
    return "WARNING" if upper == "WARN" else upper


@app.command()
def broker(port: int = 9092, host: str = "127.0.0.1") -> None:
    """Run the embedded Kafka-protocol broker (Tansu) in the foreground."""
    from mmpipe.streams.broker import EmbeddedBroker

    with EmbeddedBroker(host, port) as embedded:
        console.print(f"embedded broker on [bold]{embedded.bootstrap}[/] (memory storage); Ctrl-C stops it")
        _wait_for_signal()


@app.command()
def topics(bootstrap: BootstrapOpt = None, as_json: JsonOpt = False) -> None:
    """Create the pipeline's topics (idempotent)."""
    from mmpipe.streams.kafka import ensure_topics
    from mmpipe.streams.topics import TopicNames

    settings = _settings(bootstrap)
    asyncio.run(ensure_topics(settings))
    for name, spec in TopicNames(settings.topic_prefix).all():
        if as_json:
            _print_json({"topic": name, "partitions": settings.partitions, "config": spec.kafka_config(),
                         "description": spec.description})
        else:
            console.print(f"{name:24} {settings.partitions} partitions  {spec.kafka_config() or ''}  {spec.description}")


@app.command()
def worker(stage: Annotated[str, typer.Argument(help=" | ".join(STAGE_NAMES))], bootstrap: BootstrapOpt = None) -> None:
    """Run one stage as its own process (one member of the stage's consumer group)."""
    from mmpipe.streams.metrics import StageMetrics
    from mmpipe.streams.delivery import StageRuntime
    from mmpipe.streams.topology import UnknownStage, stage_spec
    from mmpipe.supervisor import READY_FILE_ENV

    settings = _process_settings(stage, bootstrap)
    try:
        spec = stage_spec(stage, settings)
    except UnknownStage as exc:
        raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(level=logging_level(settings.log_level), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stage_obj = spec.load_class()(settings, StageMetrics(stage))
    ready = os.environ.get(READY_FILE_ENV)
    StageRuntime(stage_obj, Path(ready) if ready else None).run()


@app.command()
def up(
    bootstrap: BootstrapOpt = None,
    metrics_base_port: int = typer.Option(9100, help="stage i replica j serves metrics on base+10*i+j; `up` itself on base+40"),
    replicas: Annotated[Optional[list[str]], typer.Option(
        "--replicas", help="STAGE=N processes for a stage, repeatable (default: the topology's default, 1)",
    )] = None,
    as_json: JsonOpt = False,
) -> None:
    """Start everything: the embedded broker (unless --bootstrap) and every stage's processes,
    and keep them running: a stage process that exits is started again (backoff 1 s doubling
    to 30 s). Ctrl-C or SIGTERM stops everything; so does `up` dying (children get SIGKILL)."""
    from mmpipe.supervisor import Pipeline, StartFailed, supervisor_metrics_port

    settings = _settings(bootstrap)
    counts = _replica_counts(replicas or [])
    if "allow_random_weights" not in settings.model_fields_set:
        # As the demo does: a fresh machine has no ImageNet weights, and `up` should still come up.
        settings = settings.model_copy(update={"allow_random_weights": True})
        _warn_random_weights(settings)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops as Ctrl-C does
    pipeline = Pipeline(settings, embedded_broker=bootstrap is None, replicas=counts, metrics_base_port=metrics_base_port)
    try:
        with console.status("starting broker and stages (models load, groups join)..."):
            pipeline.start()
    except StartFailed as failed:
        if as_json:
            _print_json({"event": "start_failed", "failures": failed.failures})
        err = Console(stderr=True)
        err.print(f"[red]mmpipe up: {len(failed.failures)} process(es) failed to start; stopped everything else[/]",
                  soft_wrap=True)
        for failure in failed.failures:
            err.print(failure.line(), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    try:
        if metrics_base_port:
            pipeline.metrics.serve(supervisor_metrics_port(metrics_base_port))
        _print_processes(pipeline, metrics_base_port, as_json)
        emit = _print_json if as_json else (lambda event: console.print(event.line(), markup=False, soft_wrap=True))
        pipeline.supervise(until=lambda: False, on_event=emit)
    except KeyboardInterrupt:
        pass
    finally:
        pipeline.stop()


def _warn_random_weights(settings: Settings) -> None:
    from mmpipe.models.image_classifier import ImageClassifierSpec
    from mmpipe.models.registry import specs_by_name

    for spec in specs_by_name(settings.models):
        if isinstance(spec, ImageClassifierSpec) and spec.weights_on_disk(settings.weights_dir) is None:
            Console(stderr=True).print(
                f"[bold yellow]WEIGHTS: {spec.arch} has no ImageNet weights here[/] (no {spec.weights_file} in "
                f"{settings.weights_dir} or torch's cache): unless it can download them it runs with RANDOM "
                "weights, so its labels mean nothing (timings are real) and its results say weights=random. "
                "Set MMPIPE_ALLOW_RANDOM_WEIGHTS=0 to refuse to start instead.",
                soft_wrap=True,
            )


def _print_processes(pipeline: Pipeline, metrics_base_port: int, as_json: bool) -> None:
    from mmpipe.report import fitted
    from mmpipe.streams.topology import metrics_port
    from mmpipe.supervisor import supervisor_metrics_port

    rows = []
    for proc in pipeline.processes:
        port = metrics_port(metrics_base_port, proc.stage, proc.index) if metrics_base_port else None
        rows.append({"process": proc.name, "pid": proc.process.pid,
                     "metrics": f"http://127.0.0.1:{port}/metrics" if port else None, "log": str(proc.log_path)})
    up_metrics = f"http://127.0.0.1:{supervisor_metrics_port(metrics_base_port)}/metrics" if metrics_base_port else None
    if as_json:
        _print_json({"event": "up", "bootstrap": pipeline.settings.bootstrap, "metrics": up_metrics, "processes": rows})
        return
    table = Table(title=f"pipeline up on {pipeline.settings.bootstrap}")
    for col in ("process", "pid", "metrics", "log"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["process"], str(row["pid"]), row["metrics"] or "-", row["log"])
    console.print(fitted(console, table))
    console.print(f"publish with: MMPIPE_BOOTSTRAP={pipeline.settings.bootstrap} mmpipe produce FILE...", soft_wrap=True)
    console.print("watch with: mmpipe top   Ctrl-C stops" + (f"   (up's own metrics: {up_metrics})" if up_metrics else ""),
                  soft_wrap=True)


def _replica_counts(pairs: list[str]) -> dict[str, int]:
    from mmpipe.streams.topology import UnknownStage, stage_spec

    counts = {}
    for pair in pairs:
        stage, _, count = pair.partition("=")
        try:
            counts[stage_spec(stage).name] = int(count)
        except (UnknownStage, ValueError) as exc:
            raise typer.BadParameter(f"--replicas {pair!r}: want STAGE=N ({exc})") from None
    return counts


@app.command()
def produce(
    files: Annotated[Optional[list[Path]], typer.Argument(help="media files to publish")] = None,
    demo: int = typer.Option(0, help="publish N generated demo jobs (cycling video, image, audio, text)"),
    modality: Optional[str] = typer.Option(None, help="image | audio | video | text (default: from extension)"),
    model: Optional[str] = typer.Option(None, help="NAME:VERSION (default: the modality's model)"),
    inline: bool = typer.Option(False, help="embed the bytes instead of sending a file URI"),
    deadline_s: Optional[float] = typer.Option(None, help="seconds the job may take"),
    job_id: Optional[str] = typer.Option(None, help="job id (one file only); same id twice = one job"),
    bootstrap: BootstrapOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish media events to the `events` topic; prints each job id."""
    from mmpipe.client import Publisher, event_for_file, parse_model
    from mmpipe.demo import demo_events

    settings = _settings(bootstrap)
    ref = parse_model(model)
    events = [
        event_for_file(path, inline=inline, modality=modality, model=ref, deadline_s=deadline_s, job_id=job_id)
        for path in files or []
    ]
    if demo:
        events += demo_events(demo, settings.state_path("demo"), deadline_s=deadline_s)

    async def run() -> None:
        async with Publisher(settings) as publisher:
            await publisher.publish_many(events)

    asyncio.run(run())
    for event in events:
        if as_json:
            _print_json({"job_id": event.job_id, "modality": event.modality})
        else:
            console.print(f"{event.job_id}\t{event.modality}")


@app.command()
def results(
    job_id: Annotated[Optional[str], typer.Argument()] = None,
    follow: bool = typer.Option(False, "--follow", "-f", help="stream results from the results topic"),
    bootstrap: BootstrapOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a job's stored result (and status), or follow the results topic."""
    from mmpipe.report import print_result
    from mmpipe.stages.sink.store import open_store

    settings = _settings(bootstrap)
    if follow:
        from mmpipe.client import follow_results

        async def run() -> None:
            async for result in follow_results(settings, from_beginning=True):
                if as_json:
                    _print_json(result)
                else:
                    print_result(console, result)

        try:
            asyncio.run(run())
        except KeyboardInterrupt:
            pass
        return
    if not job_id:
        raise typer.BadParameter("give a JOB_ID or --follow")
    store = open_store(settings.store_url)
    job = store.get_job(job_id)
    result = store.get_result(job_id)
    if job is None and result is None:
        console.print(f"[red]no job {job_id!r} in {redact_url(settings.store_url)}[/]")
        raise typer.Exit(1)
    if as_json:
        _print_json({"job": job, "result": result})
        return
    if job is not None:
        console.print(f"job {job.job_id}: [bold]{job.state}[/]  " + "  ".join(f"{k}={v:.3f}" for k, v in job.state_times.items()))
    if result is not None:
        print_result(console, result)


@app.command()
def lag(
    bootstrap: BootstrapOpt = None,
    window: float = typer.Option(3.0, help="seconds between the two offset samples that give arrival rates (0: lag table only)"),
    metrics: Annotated[Optional[list[str]], typer.Option(
        "--metrics", help="a stage's metrics URL, repeatable; a host name with several addresses counts as every replica "
        "(default: the ports `up` gives stages on 127.0.0.1)",
    )] = None,
    metrics_base_port: int = typer.Option(9100, help="`up`'s metrics base port, probed when no --metrics (0: don't)"),
    target_utilisation: float = typer.Option(0.7, min=0.05, max=1.0, help="busy fraction per replica the hint aims for"),
    keda: bool = typer.Option(False, "--keda", help="also the KEDA Kafka scaler's lagThreshold and replica bounds "
                                                    "these measurements give (as `mmpipe keda`)"),
    as_json: JsonOpt = False,
) -> None:
    """Consumer lag per stage group and partition (like kafka-consumer-groups --describe), and per
    stage the arrival rate, service time and the replicas needed to keep up."""
    from mmpipe.report import (
        capacity_json, capacity_report, capacity_table, fitted, live_scaling_bounds, partition_json,
        partition_lag_table, scaling_json, scaling_table, stage_lag_rows,
    )

    settings = _settings(bootstrap)
    if window <= 0:
        rows = asyncio.run(stage_lag_rows(settings))
        if as_json:
            _print_json({"bootstrap": settings.bootstrap, "partitions": [partition_json(row) for row in rows]})
        else:
            console.print(fitted(console, partition_lag_table(rows, settings.bootstrap)))
        return
    report = asyncio.run(capacity_report(settings, window, metrics, metrics_base_port, target_utilisation))
    source = f"measured on {settings.bootstrap} over {report.window_s:.1f} s"
    bounds = live_scaling_bounds(report, settings, LATENCY_BUDGET_S) if keda else None
    if as_json:
        document = capacity_json(report)
        if bounds is not None:
            document["keda"] = scaling_json(bounds, LATENCY_BUDGET_S, source)
        _print_json(document)
        return
    console.print(fitted(console, capacity_table(report)))
    console.print(fitted(console, partition_lag_table(report.partitions, settings.bootstrap)))
    if bounds is not None:
        console.print(fitted(console, scaling_table(bounds, LATENCY_BUDGET_S, source)))


@app.command()
def top(
    bootstrap: BootstrapOpt = None,
    window: float = typer.Option(10.0, help="seconds of history that rates and percentiles cover"),
    interval: float = typer.Option(2.0, help="seconds between refreshes"),
    metrics: Annotated[Optional[list[str]], typer.Option(
        "--metrics", help="a stage's metrics URL, repeatable (default: the ports `up` gives stages on 127.0.0.1)",
    )] = None,
    metrics_base_port: int = typer.Option(9100, help="`up`'s metrics base port, probed when no --metrics (0: don't)"),
    target_utilisation: float = typer.Option(0.7, min=0.05, max=1.0, help="busy fraction per replica the hint aims for"),
    once: bool = typer.Option(False, "--once", help="print one frame (over --interval) and exit"),
    as_json: JsonOpt = False,
) -> None:
    """Live view of the running pipeline: per stage its members, in/s, done/s, lag, queue wait,
    batch sizes, restarts, dead letters and the replicas needed; end-to-end p50/p99 above."""
    from mmpipe.top import TopSources, run_top

    settings = _settings(bootstrap)
    sources = TopSources.of(metrics, metrics_base_port)
    try:
        asyncio.run(run_top(settings, console, sources, window, interval, target_utilisation,
                            once=once or as_json, on_frame=_print_json if as_json else None))
    except KeyboardInterrupt:
        pass


@app.command()
def keda(
    bench: Optional[Path] = typer.Option(None, help="take service times from a `mmpipe bench` result (JSON) instead of measuring live"),
    rate: float = typer.Option(0.0, help="with --bench: items/s each stage must keep up with (sets minReplicaCount)"),
    latency_budget_s: float = typer.Option(LATENCY_BUDGET_S, "--latency-budget-s", min=0.1, help="end-to-end p99 to defend, shared equally by the stages"),
    window: float = typer.Option(3.0, min=0.5, help="live: seconds between the two samples, as in `mmpipe lag`"),
    metrics: Annotated[Optional[list[str]], typer.Option("--metrics", help="live: a stage's metrics URL, repeatable (see `mmpipe lag`)")] = None,
    metrics_base_port: int = typer.Option(9100, help="live: `up`'s metrics base port, probed when no --metrics"),
    target_utilisation: float = typer.Option(0.7, min=0.05, max=1.0, help="busy fraction per replica minReplicaCount aims for"),
    bootstrap: BootstrapOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The KEDA Kafka scaler's numbers per stage (lagThreshold, min/max replicas, grace period)
    from the capacity model, with service times measured live (as `mmpipe lag`) or by a benchmark."""
    from mmpipe.capacity import scaling_bounds, stage_workers
    from mmpipe.report import capacity_report, fitted, live_scaling_bounds, scaling_json, scaling_table

    settings = _settings(bootstrap)
    if bench is not None:
        workers = stage_workers(settings)
        bounds = [
            scaling_bounds(stage, per_item, workers[stage], settings.partitions, latency_budget_s=latency_budget_s,
                           arrival_per_s=rate, max_inflight=settings.max_inflight, target=target_utilisation)
            for stage, per_item in _bench_service_times(bench).items()
        ]
        source = f"service times from {bench}, {settings.partitions} partitions"
    else:
        report = asyncio.run(capacity_report(settings, window, metrics, metrics_base_port, target_utilisation))
        bounds = live_scaling_bounds(report, settings, latency_budget_s)
        source = f"measured on {settings.bootstrap} over {report.window_s:.1f} s"
    if as_json:
        _print_json(scaling_json(bounds, latency_budget_s, source))
    else:
        console.print(fitted(console, scaling_table(bounds, latency_budget_s, source)))


def _bench_service_times(path: Path) -> dict[str, float]:
    import json

    from mmpipe.capacity import bench_service_times

    try:
        return bench_service_times(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise typer.BadParameter(f"--bench {path}: not a `mmpipe bench` result with a flood run ({exc!r})") from None


@app.command()
def demo(
    jobs: int = typer.Option(4, help="demo jobs to publish (cycling video, image, audio, text)"),
    timeout_s: float = typer.Option(300.0, help="give up waiting for results after this long"),
    as_json: JsonOpt = False,
) -> None:
    """End to end on the embedded broker: start everything, publish generated media, print results."""
    from mmpipe.demo import print_demo, print_missing, run_demo

    settings = _settings(allow_random_weights=True)
    # With --json stdout carries only the results (a line per job); the progress goes to stderr.
    progress = Console(stderr=True) if as_json else console
    run = run_demo(settings, jobs, timeout_s, progress)
    if as_json:
        for result in run.in_order():
            _print_json(result)
    else:
        print_demo(run, settings, console)
    print_missing(run, progress)
    raise typer.Exit(0 if run.ok() else 1)


@app.command()
def api(
    host: str = typer.Option("127.0.0.1", help="address to listen on (loopback by default)"),
    port: int = typer.Option(8080, help="TCP port"),
    bootstrap: BootstrapOpt = None,
    insecure: bool = typer.Option(False, "--insecure", help="serve off loopback without MMPIPE_API_TOKEN (anyone may submit)"),
) -> None:
    """Serve the HTTP job API (POST /v1/jobs, GET /v1/jobs/ID, POST /v1/predict, /healthz, /readyz)."""
    import uvicorn

    from mmpipe.api import create_app

    settings = _process_settings("api", bootstrap)
    if not settings.api_token and host not in ("127.0.0.1", "localhost", "::1"):
        if not insecure:
            console.print(f"[red]refusing to serve {host}:{port} without MMPIPE_API_TOKEN: set one, bind loopback, "
                          "or pass --insecure[/]")
            raise typer.Exit(2)
        console.print(f"[yellow]warning: --insecure: anyone who reaches {host}:{port} can submit jobs[/]")
    level = settings.log_level.lower()
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning" if level == "warn" else level,
                limit_concurrency=settings.api_max_concurrency)


@app.command()
def chaos(
    jobs: int = typer.Option(2000, help="good jobs to publish (texts, images, short audio, 2 s videos of 3 parts, "
                                        "and 1 in 100 a 34 s spoken clip of 2 Whisper windows); the README's run: 10000"),
    bad: int = typer.Option(100, help="bad inputs interleaved (malformed, corrupt, unknown model, outside roots)"),
    rate: float = typer.Option(60.0, help="publish rate, jobs/s"),
    seed: int = typer.Option(0, help="workload seed (job ids chaos-SEED-NNNNNN, the picture and video content)"),
    out: Optional[Path] = typer.Option(None, "--report", "--out",
                                       help="where to write the JSON report, e.g. benchmarks/results/chaos-10k.json "
                                            "(default: <state_dir>/reports/chaos.json)"),
) -> None:
    """Fault run on the embedded broker: SIGKILL every stage in turn mid-run, scale inference
    out and in, crash once at each named point in MMPIPE_FAULT_POINTS, then count results in the
    store and on the results topic (lost, duplicated). Jobs are deferred, never rejected, and do
    not expire (chaos_settings). The JSON report carries the run's parameters, commit, date,
    machine and settings under "meta", its checks under "checks"."""
    from mmpipe.harness.chaos import WORKLOAD_KINDS, chaos_settings, run_chaos
    from mmpipe.harness.runinfo import run_meta, write_report
    from mmpipe.report import fitted

    workdir = _settings().state_path("chaos")
    store = workdir / "results.db"
    store.unlink(missing_ok=True)
    settings = chaos_settings(_settings(allow_random_weights=True, bootstrap="127.0.0.1:0", store_url=f"sqlite:///{store}",
                                        inject_execute_delay_ms=5.0))
    out = out or settings.state_path("reports", "chaos.json")
    meta = run_meta("chaos", {"jobs": jobs, "bad": bad, "rate": rate, "seed": seed,
                              "fault_points": list(settings.fault_points), "workload_kinds": WORKLOAD_KINDS,
                              "plan": "SIGKILL decode, preprocess, inference, sink at 16/32/48/64 % of results stored; "
                                      "+inference-1 at 82 %, -inference-1 (SIGTERM) at 90 %; named points fire once each"},
                    settings)
    with console.status(f"fault run: {jobs} jobs + {bad} bad inputs at {rate}/s, killing every stage in turn..."):
        report = run_chaos(settings, workdir, jobs, bad, rate, seed=seed)
    checks = write_report(out, meta, report)
    table = Table(title="fault run")
    for col in ("jobs", "bad inputs", "kills survived", "rebalances", "results stored", "lost", "duplicated",
                "topic records", "duration s"):
        table.add_column(col, justify="right")
    table.add_row(str(report.jobs), str(report.bad_inputs), str(len(report.kills)), str(len(report.rebalances)),
                  str(report.stored_results), str(report.lost), str(report.duplicated), str(report.topic_records),
                  str(report.duration_s))
    console.print(fitted(console, table))
    console.print(f"statuses: {report.statuses}; by kind: {report.statuses_by_kind}; parts: {report.parts}; "
                  f"bad-input reasons: {report.bad_input_reasons}; fault points fired: {report.fault_points_fired}")
    console.print(f"checks: {checks}; report: {out}")
    raise typer.Exit(0 if report.lost == 0 and report.duplicated == 0 else 1)


@app.command()
def overload(
    seconds: float = typer.Option(60.0, help="how long to send 10x the sustainable rate"),
    service_ms: float = typer.Option(100.0, help="model time per item (injected): sustainable rate = 1000/service_ms"),
    factor: float = typer.Option(10.0, help="arrival rate as a multiple of the sustainable rate"),
    deadline_s: float = typer.Option(5.0, help="each job's deadline"),
    out: Optional[Path] = typer.Option(None, "--report", "--out",
                                       help="where to write the JSON report, e.g. benchmarks/results/overload-60s.json "
                                            "(default: <state_dir>/reports/overload.json)"),
) -> None:
    """Overload run on the embedded broker: peak RSS per stage, p99 of admitted jobs against
    their deadline, how much admission control rejected, time back to zero lag. The JSON report
    carries the run's parameters, commit, date, machine and settings under "meta", its checks
    under "checks"."""
    from mmpipe.harness.overload import OVERLOAD_OVERRIDES, overload_settings, run_overload
    from mmpipe.harness.runinfo import run_meta, write_report
    from mmpipe.supervisor import Pipeline

    workdir = _settings().state_path("overload")
    store = workdir / "results.db"
    store.unlink(missing_ok=True)
    base = _settings(bootstrap="127.0.0.1:0", store_url=f"sqlite:///{store}", torch_threads=1)
    settings = overload_settings(base, service_ms)
    out = out or settings.state_path("reports", "overload.json")
    meta = run_meta("overload", {"seconds": seconds, "service_ms": service_ms, "factor": factor, "deadline_s": deadline_s,
                                 "workload": "text jobs (all-minilm-l6-v2), no batching",
                                 "replica_overrides": {f"{stage}-{index}": values
                                                       for (stage, index), values in OVERLOAD_OVERRIDES.items()}},
                    settings)
    with console.status(f"{factor:.0f}x the sustainable rate for {seconds:.0f}s..."):
        with Pipeline(settings, workdir=workdir, replica_overrides=OVERLOAD_OVERRIDES) as pipeline:
            report = run_overload(pipeline, 1000 / service_ms, factor, seconds, deadline_s)
    checks = write_report(out, meta, report)
    console.print_json(report.to_json().decode())
    console.print(f"checks: {checks}; report: {out}")
    raise typer.Exit(0 if all(checks.values()) else 1)


# `mmpipe bench`: the benchmark harness (mmpipe/harness/bench/), also benchmarks/run_bench.py.
from mmpipe.harness.bench.command import bench  # noqa: E402

app.command(name="bench")(bench)


def _wait_for_signal() -> None:
    stop = {"flag": False}

    def handler(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop["flag"]:
        time.sleep(0.2)


if __name__ == "__main__":
    app()
