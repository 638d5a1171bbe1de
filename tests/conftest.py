"""Shared fixtures: a real embedded broker for the session, real stage processes, real media.

Pipelines get a unique topic prefix (so their topics and consumer groups never mix) and their
own SQLite store, so many pipelines share one broker.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmpipe.schemas.settings import BatchingSettings, Settings
from mmpipe.supervisor import Pipeline
from mmpipe.streams.broker import EmbeddedBroker
from tests.pg import fresh_postgres_url, own_postgres_server, postgres_server, postgres_url  # noqa: F401 - real PostgreSQL

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    with EmbeddedBroker(port=0, log_path=log) as embedded:
        yield embedded


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("media")


def make_settings(bootstrap: str, workdir: Path, media_dir: Path, **overrides: object) -> Settings:
    """Test defaults: small partitions count, short batching waits, random resnet weights."""
    base = dict(
        bootstrap=bootstrap,
        topic_prefix=f"t{uuid.uuid4().hex[:8]}",
        partitions=2,
        store_url=f"sqlite:///{workdir / 'results.db'}",
        input_roots=[media_dir],
        allow_random_weights=True,
        default_batching=BatchingSettings(max_batch_size=8, max_wait_ms=5),
        torch_threads=1,
        decode_workers=1,
        inference_workers=1,
        max_payload_bytes=4 * 1024 * 1024,
        log_level="info",
    )
    base.update(overrides)
    return Settings(**base)


@pytest.fixture(scope="session")
def shared_pipeline(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[Pipeline]:
    """One full pipeline (one process per stage) for the tests that only publish and read."""
    workdir = tmp_path_factory.mktemp("pipeline")
    settings = make_settings(broker.bootstrap, workdir, media_dir)
    pipeline = Pipeline(settings, workdir=workdir, embedded_broker=False)
    pipeline.start()
    try:
        yield pipeline
    finally:
        pipeline.stop()
