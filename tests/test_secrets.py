"""Secrets: SecretStr in the settings (masked in repr, str and JSON dumps), store URL passwords
redacted for screens and logs, settings files for child processes written 0600 with the real
values, the API's docs off by a setting, and `mmpipe api` refusing to serve off loopback
without a token."""

from __future__ import annotations

import json
import logging
import os
import stat

from typer.testing import CliRunner

from mmpipe.cli import app as cli
from mmpipe.schemas.settings import Settings, load_settings, redact_url, secret, write_settings

PASSWORD = "s3cret-pw"
TOKEN = "t0ken-value"


def _settings(**overrides: object) -> Settings:
    return Settings(api_token=TOKEN, security={"security_protocol": "SASL_SSL", "sasl_password": PASSWORD},
                    store_url=f"postgresql://mmpipe:{PASSWORD}@db.example:5432/results", **overrides)


def test_secrets_never_show_in_repr_str_logs_or_dumps(caplog):
    settings = _settings()
    logging.getLogger("test").warning("settings: %s %r", settings, settings)
    for text in (repr(settings), str(settings), settings.model_dump_json(), caplog.text):
        assert PASSWORD not in text and TOKEN not in text
    assert secret(settings.api_token) == TOKEN and secret(settings.security.sasl_password) == PASSWORD


def test_store_url_is_a_secret_whose_uses_see_the_real_value(tmp_path):
    from mmpipe.stages.sink.store import open_store

    settings = _settings()
    assert PASSWORD not in f"{settings.store_url} {settings.store_url!r}"
    assert secret(settings.store_url) == f"postgresql://mmpipe:{PASSWORD}@db.example:5432/results"
    assert json.loads(settings.model_dump_json())["store_url"] == "postgresql://mmpipe:***@db.example:5432/results"
    local = Settings(store_url=f"sqlite:///{tmp_path / 'r.db'}")
    store = open_store(local.store_url)  # a SecretStr opens as the URL it holds
    try:
        store.init_schema()
        assert store.counts()["results"] == 0
    finally:
        store.close()
    try:
        open_store(f"mysql://mmpipe:{PASSWORD}@db/r")
    except ValueError as exc:
        assert "unsupported store URL" in str(exc) and PASSWORD not in str(exc)
    else:
        raise AssertionError("an unsupported store URL was accepted")


def test_store_url_password_is_redacted():
    assert redact_url(f"postgresql://mmpipe:{PASSWORD}@db:5432/r") == "postgresql://mmpipe:***@db:5432/r"
    assert redact_url("sqlite:////var/results.db") == "sqlite:////var/results.db"


def test_settings_file_is_0600_and_carries_the_real_secrets(tmp_path, monkeypatch):
    path = tmp_path / "stage.settings.json"
    path.write_text("{}")
    path.chmod(0o644)  # a file left from before with wider permissions
    write_settings(_settings(), path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    monkeypatch.setenv("MMPIPE_SETTINGS_FILE", str(path))
    loaded = load_settings()
    assert secret(loaded.api_token) == TOKEN and secret(loaded.security.sasl_password) == PASSWORD
    assert PASSWORD in json.loads(path.read_text())["store_url"]


def test_api_docs_can_be_turned_off(tmp_path):
    from fastapi.testclient import TestClient

    from mmpipe.api import create_app

    local = {"store_url": f"sqlite:///{tmp_path / 'r.db'}"}
    on = TestClient(create_app(Settings(**local)))  # no lifespan: these pages need no broker
    off = TestClient(create_app(Settings(api_docs=False, **local)))
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert on.get(path).status_code == 200, path
        assert off.get(path).status_code == 404, path


def test_api_serves_its_process_metrics_for_prometheus(tmp_path):
    """compose's Prometheus scrapes api:8080/metrics: the page is there, in Prometheus' format."""
    from fastapi.testclient import TestClient

    from mmpipe.api import create_app

    app = create_app(Settings(store_url=f"sqlite:///{tmp_path / 'r.db'}"))
    page = TestClient(app).get("/metrics")  # no lifespan: the page needs neither broker nor store
    assert page.status_code == 200 and "process_cpu_seconds_total" in page.text


def test_api_refuses_to_serve_off_loopback_without_a_token(monkeypatch):
    monkeypatch.delenv("MMPIPE_API_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["api", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2 and "--insecure" in result.output
