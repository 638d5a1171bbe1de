"""compose/ checked without Docker: the production description must be right by construction.

Every `mmpipe` command it runs parses against the real CLI, every MMPIPE_* variable is a real
setting and the set of them makes a valid Settings, stage services can scale, the GPU is
reserved, Prometheus finds every replica, Kafka runs in KRaft mode with room for the pipeline's
largest messages, and dependencies, volumes and secrets are wired."""

from __future__ import annotations

import base64
import os
import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import click
import pytest
import typer.main
import yaml
from pydantic import BaseModel

from mmpipe.cli import app
from mmpipe.streams.topology import STAGE_NAMES
from mmpipe.schemas.settings import SETTINGS_FILE_ENV, Settings
from mmpipe.supervisor import READY_FILE_ENV

COMPOSE_DIR = Path(__file__).resolve().parent.parent / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
DOCKERFILE = "compose/Dockerfile"
# The services that run `mmpipe`: the topics job, a worker per stage, the job API.
MMPIPE_SERVICES = ("topics", *STAGE_NAMES, "api")
# Read by processes outside Settings (the supervisor's hand-offs), so not Settings fields.
NON_SETTINGS_ENV = {SETTINGS_FILE_ENV, READY_FILE_ENV}


# --- Reading the files as compose does ------------------------------------------------------------

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $$."""

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op"), match.group("arg")
        value = env.get(name)
        if op in (":-", ":?") and value == "":
            value = None
        if value is not None:
            return value
        if op in ("-", ":-"):
            return arg
        raise AssertionError(f"${{{name}}} is required ({arg or 'no default'}) but not set in {ENV_EXAMPLE.name}")

    return _VARIABLE.sub(substitute, text)


def variables_in(text: str) -> dict[str, str | None]:
    """Every ${NAME...} in the text, with its default if it has one."""
    found: dict[str, str | None] = {}
    for match in _VARIABLE.finditer(text):
        if match.group("name"):
            default = match.group("arg") if match.group("op") in ("-", ":-") else None
            found.setdefault(match.group("name"), default)
    return found


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def compose(env_example) -> dict[str, Any]:
    # PyYAML's safe loader resolves the `<<` merge keys and anchors as compose does.
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), env_example))


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(part) for part in cmd]


def is_mmpipe(service: dict[str, Any]) -> bool:
    build = service.get("build") or {}
    return isinstance(build, dict) and build.get("dockerfile") == DOCKERFILE


def mmpipe_services(services) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services.items() if is_mmpipe(svc)}


def stage_of(service: dict[str, Any]) -> str | None:
    args = command(service)
    return args[2] if args[:2] == ["mmpipe", "worker"] and len(args) > 2 else None


def stage_services(services) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in mmpipe_services(services).items() if stage_of(svc)}


# --- The CLI ---------------------------------------------------------------------------------------

CLI = typer.main.get_command(app)
CLI_COMMANDS = set(CLI.commands)


def test_compose_file_uses_only_documented_variables(env_example):
    used = variables_in(COMPOSE_FILE.read_text())
    assert used, "expected ${...} variables (secrets must not be literals)"
    undocumented = sorted(set(used) - set(env_example))
    assert not undocumented, f"document these in {ENV_EXAMPLE.name}: {undocumented}"


def test_every_mmpipe_service_runs_an_mmpipe_command(services):
    mine = mmpipe_services(services)
    assert set(mine) >= set(MMPIPE_SERVICES)
    for name, service in mine.items():
        args = command(service)
        assert args[:1] == ["mmpipe"] and len(args) > 1, f"{name}: command must be `mmpipe <command> ...`, got {args}"


@pytest.mark.parametrize("name", MMPIPE_SERVICES)
def test_service_command_parses_against_the_cli(services, name):
    args = command(services[name])[1:]
    if args[0] == "api" and "api" not in CLI_COMMANDS:
        # The `api` command lands from its own branch; this turns into a real check once merged.
        pytest.xfail("`mmpipe api` is not registered in mmpipe.cli.app at this commit")
    assert args[0] in CLI_COMMANDS, f"{name}: `mmpipe {args[0]}` is not a command (have {sorted(CLI_COMMANDS)})"
    cli_command = CLI.commands[args[0]]
    try:
        cli_command.make_context(args[0], list(args[1:]))  # parses and type-checks; runs nothing
    except click.UsageError as exc:
        pytest.fail(f"{name}: `mmpipe {' '.join(args)}` does not parse: {exc.format_message()}")


def test_every_stage_has_exactly_one_worker_service(services):
    stages = [stage_of(svc) for svc in stage_services(services).values()]
    assert sorted(stages) == sorted(STAGE_NAMES), f"worker services run {stages}; the stages are {list(STAGE_NAMES)}"
    for name, service in stage_services(services).items():
        assert stage_of(service) in STAGE_NAMES
        assert name == stage_of(service), "the service is named after its stage (Prometheus and docs rely on it)"


# --- Settings from the environment ----------------------------------------------------------------


def _field_type(annotation: Any) -> Any:
    """X from X | None (and Optional[X])."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def settings_path_error(variable: str) -> str | None:
    """Why MMPIPE_A__B... names no Settings field (None when it does), following the `__`
    nested delimiter through nested models and dict-valued fields."""
    parts = variable.removeprefix("MMPIPE_").lower().split("__")
    model: Any = Settings
    for depth, part in enumerate(parts):
        if isinstance(model, type) and issubclass(model, BaseModel):
            if part not in model.model_fields:
                return f"{variable}: {model.__name__} has no field {part!r}"
            model = _field_type(model.model_fields[part].annotation)
        elif typing.get_origin(model) is dict:
            model = typing.get_args(model)[1]  # any key; the value's type continues the path
        else:
            return f"{variable}: {'.'.join(parts[:depth])} is not a nested setting"
    return None


@pytest.mark.parametrize("name", MMPIPE_SERVICES)
def test_mmpipe_env_maps_to_settings_and_parses(services, name, monkeypatch, tmp_path):
    env = environment(services[name])
    mmpipe_vars = {k: v for k, v in env.items() if k.startswith("MMPIPE_") and k not in NON_SETTINGS_ENV}
    assert mmpipe_vars, f"{name} sets no MMPIPE_* variables"
    errors = [error for var in mmpipe_vars if (error := settings_path_error(var))]
    assert not errors, errors

    monkeypatch.chdir(tmp_path)  # no stray .env file joins in
    for var in [v for v in os.environ if v.startswith("MMPIPE_")]:
        monkeypatch.delenv(var)
    for var, value in mmpipe_vars.items():
        monkeypatch.setenv(var, value)
    settings = Settings()  # raises if any value does not validate

    assert settings.bootstrap == "kafka:9092"
    assert settings.security.security_protocol == "PLAINTEXT"
    assert settings.input_roots == [Path("/data/media")]
    if stage_of(services[name]):
        assert settings.metrics_port == 9100


def test_the_sink_and_the_api_use_the_postgres_service(services):
    pg = environment(services["postgres"])
    expected = f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
    for name in ("sink", "api"):
        assert environment(services[name])["MMPIPE_STORE_URL"] == expected, name
    for name in (stage for stage in STAGE_NAMES if stage != "sink"):
        assert "MMPIPE_STORE_URL" not in environment(services[name]), f"{name} has no business with the store"


def test_secrets_come_from_the_env_file_not_the_compose_file():
    raw = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    assert environment(raw["api"])["MMPIPE_API_TOKEN"].startswith("${MMPIPE_API_TOKEN:?")
    assert environment(raw["postgres"])["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "${POSTGRES_PASSWORD:?" in environment(raw["sink"])["MMPIPE_STORE_URL"]
    assert ".env" in (COMPOSE_DIR / ".gitignore").read_text().split()


# --- Scaling, GPU, metrics ---------------------------------------------------------------------------


def test_stage_services_can_scale(services):
    for name, service in stage_services(services).items():
        for key in ("container_name", "ports", "hostname"):
            assert key not in service, f"{name}: {key} would stop `docker compose up --scale {name}=N`"
        assert "replicas" not in (service.get("deploy") or {}), f"{name}: leave the replica count to --scale"


def test_inference_reserves_a_gpu_and_uses_it(services):
    inference = services["inference"]
    devices = inference["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert environment(inference)["MMPIPE_DEVICE"].startswith("cuda")
    for name in (stage for stage in STAGE_NAMES if stage != "inference"):
        assert "deploy" not in services[name] or "devices" not in str(services[name]["deploy"]), f"{name} needs no GPU"


@pytest.fixture(scope="module")
def prometheus(services) -> dict[str, Any]:
    mounts = [str(v) for v in services["prometheus"]["volumes"]]
    config = next((m.split(":")[0] for m in mounts if m.endswith("/etc/prometheus/prometheus.yml:ro")), None)
    assert config, f"prometheus mounts no config: {mounts}"
    return yaml.safe_load((COMPOSE_DIR / config).resolve().read_text())


def test_prometheus_finds_every_replica_of_every_stage(services, prometheus):
    jobs = prometheus["scrape_configs"]
    for name, service in stage_services(services).items():
        port = int(environment(service)["MMPIPE_METRICS_PORT"])
        assert port > 0, f"{name}: MMPIPE_METRICS_PORT=0 serves no metrics"
        # An A-record lookup of the service name returns every replica's address.
        found = [
            sd for job in jobs for sd in job.get("dns_sd_configs", [])
            if name in sd.get("names", []) and sd.get("type") == "A" and sd.get("port") == port
        ]
        assert found, f"no dns_sd_configs (type A, port {port}) for stage service {name!r}"


def test_prometheus_scrapes_the_api(services, prometheus):
    args = command(services["api"])
    port = args[args.index("--port") + 1]
    targets = [t for job in prometheus["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert f"api:{port}" in targets


# --- Kafka --------------------------------------------------------------------------------------------


def kafka_properties(service: dict[str, Any]) -> dict[str, str]:
    """The server.properties the apache/kafka image derives from KAFKA_* variables:
    strip KAFKA_, then ___ -> '-', __ -> '_', _ -> '.', lower case."""
    props = {}
    for key, value in environment(service).items():
        if key.startswith("KAFKA_"):
            name = key.removeprefix("KAFKA_").replace("___", "-").replace("__", "\0").replace("_", ".").replace("\0", "_")
            props[name.lower()] = value
    return props


def test_kafka_runs_in_kraft_mode(services):
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    props = kafka_properties(kafka)
    assert {"broker", "controller"} <= set(props["process.roles"].split(","))
    assert not any("zookeeper" in key for key in props), "KRaft: no ZooKeeper settings"
    assert not any("zookeeper" in str(svc.get("image", "")) for svc in services.values())
    node_id = props["node.id"]
    voters = dict(v.split("@") for v in props["controller.quorum.voters"].split(","))
    controller_listener = props["controller.listener.names"]
    assert node_id in voters
    listeners = dict(item.split("://") for item in props["listeners"].split(","))
    assert voters[node_id].endswith(listeners[controller_listener]), "the voter address is this node's controller listener"
    assert len(base64.urlsafe_b64decode(environment(kafka)["CLUSTER_ID"] + "==")) == 16


def test_kafka_is_where_the_stages_connect_and_takes_their_largest_messages(services):
    props = kafka_properties(services["kafka"])
    advertised = {item.split("://")[1] for item in props["advertised.listeners"].split(",")}
    for name in mmpipe_services(services):
        assert environment(services[name])["MMPIPE_BOOTSTRAP"] in advertised, name
    largest = Settings().max_message_bytes
    assert int(props["message.max.bytes"]) >= largest
    assert int(props["replica.fetch.max.bytes"]) >= largest
    assert props.get("auto.create.topics.enable") == "false"  # `mmpipe topics` owns topic configs


# --- Wiring -------------------------------------------------------------------------------------------


def test_depends_on_names_existing_services_with_valid_conditions(services):
    conditions = {"service_started", "service_healthy", "service_completed_successfully"}
    for name, service in services.items():
        deps = service.get("depends_on") or {}
        if isinstance(deps, list):
            deps = {dep: {"condition": "service_started"} for dep in deps}
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep!r}"
            assert dep != name, f"{name} depends on itself"
            condition = spec.get("condition", "service_started")
            assert condition in conditions, f"{name} -> {dep}: {condition}"
            if condition == "service_healthy":
                check = services[dep].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), f"{name} waits for {dep} to be healthy; it has no healthcheck"


def test_stages_start_after_the_topics_exist(services):
    for name in [*stage_services(services), "api"]:
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully", name
    assert services["topics"]["restart"] == "no", "a one-shot service must not be restarted"


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for mount in service.get("volumes", []):
            source = str(mount).split(":")[0]
            if not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"


def test_mmpipe_services_build_from_the_dockerfile(services):
    root = COMPOSE_DIR.parent
    dockerfile = (root / DOCKERFILE).read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert "torch==2.9.1 torchvision==0.24.1" in dockerfile and "torchaudio==2.9.*" in dockerfile
    for name, service in mmpipe_services(services).items():
        assert (COMPOSE_DIR / service["build"]["context"]).resolve() == root, f"{name}: context must be the repo root"
