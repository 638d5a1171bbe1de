"""The job API against the real pipeline (embedded broker, one process per stage): httpx talks
to the ASGI app in this process, whose producer, results listener and store are real; one test
runs `mmpipe api` itself (uvicorn on a loopback port)."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from fastapi import FastAPI

from mmpipe.stages.decode import samples
from mmpipe.api import ENVELOPE_BYTES, create_app
from mmpipe.schemas.settings import SETTINGS_FILE_ENV, Settings, write_settings
from mmpipe.stages.sink.store import open_store
from mmpipe.streams.broker import free_port
from mmpipe.streams.kafka import client_kwargs
from mmpipe.streams.topics import TopicNames

pytestmark = pytest.mark.timeout(300)

TOKEN = "test-token-7f3a9c"
UPLOAD_LIMIT = 1024 * 1024
FINISHED = {"done", "failed", "expired", "rejected"}


@pytest.fixture(scope="module")
def api_settings(shared_pipeline) -> Settings:
    return shared_pipeline.settings.model_copy(update={"api_token": TOKEN, "api_max_upload_bytes": UPLOAD_LIMIT})


@pytest.fixture(scope="module")
def picture(media_dir: Path) -> Path:
    path = media_dir / "api-picture.jpg"
    path.write_bytes(samples.encode_image(samples.synthetic_picture(320, 240, seed=11), "jpeg"))
    return path


# Helpers ----------------------------------------------------------------------------------------
@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[FastAPI]:
    """The app with its lifespan (producer, results listener, store) running, as uvicorn would."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


@asynccontextmanager
async def client_for(app: FastAPI, token: str | None = TOKEN) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test", headers=headers, timeout=120) as client:
        yield client


@asynccontextmanager
async def api(settings: Settings, wait_ready: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(settings) as app, client_for(app) as client:
        if wait_ready:
            await until_ready(client)
        yield client


async def until_ready(client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get("/readyz")
        if response.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"API not ready after {timeout_s}s: {response.json()}")
        await asyncio.sleep(0.2)


async def poll_until_finished(client: httpx.AsyncClient, url: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(url)
        assert response.status_code == 200, response.text
        body = response.json()
        if body["status"] in FINISHED:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"job not finished after {timeout_s}s: {body}")
        await asyncio.sleep(0.2)


def assert_error(response: httpx.Response, status: int, code: str, *phrases: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == code, body
    for phrase in phrases:
        assert phrase in body["detail"], body
    return body


async def events_published(settings: Settings, job_id: str) -> int:
    """How many events with this key the events topic holds (read from the start to the end)."""
    topic = TopicNames(settings.topic_prefix).events
    consumer = AIOKafkaConsumer(**client_kwargs(settings), group_id=None, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        count = 0
        for tp in tps:
            while await consumer.position(tp) < ends[tp]:
                records = (await consumer.getmany(tp, timeout_ms=1000)).get(tp, [])
                count += sum(1 for record in records if record.key == job_id.encode())
        return count
    finally:
        await consumer.stop()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# Working paths ----------------------------------------------------------------------------------
async def test_async_job_is_accepted_then_polled_to_its_result(api_settings):
    async with api(api_settings) as client:
        response = await client.post("/v1/jobs", json={"modality": "text", "text": "an asynchronous sentence"})
        assert response.status_code == 202, response.text
        accepted = response.json()
        assert accepted["status"] == "accepted" and accepted["job_id"]
        assert accepted["status_url"] == f"/v1/jobs/{accepted['job_id']}" == response.headers["location"]

        job = await poll_until_finished(client, accepted["status_url"])
    assert job["status"] == "done" and job["modality"] == "text" and job["model"] == "all-minilm-l6-v2:1"
    assert {"accepted", "decoding", "finished"} <= set(job["timestamps"])
    assert job["timestamps"]["accepted"] <= job["timestamps"]["finished"]
    result = job["result"]
    assert result["status"] == "ok" and result["job_id"] == accepted["job_id"]
    assert len(result["prediction"]["embedding"]) == 384


async def test_predict_returns_the_text_embedding(api_settings):
    async with api(api_settings) as client:
        response = await client.post("/v1/predict", json={"modality": "text", "text": "a synchronous sentence", "timeout_s": 60})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "done" and body["result"]["status"] == "ok"
    embedding = body["result"]["prediction"]["embedding"]
    assert len(embedding) == 384 and sum(x * x for x in embedding) == pytest.approx(1.0, abs=1e-3)


async def test_predict_an_image_upload_inline_and_by_uri(api_settings, picture):
    data = picture.read_bytes()
    async with api(api_settings) as client:
        uploaded = await client.post(
            "/v1/predict", params={"timeout_s": 60}, files={"file": ("photo.jpg", data, "image/jpeg")}
        )  # no modality field: told by the file name
        inline = await client.post(
            "/v1/predict", json={"modality": "image", "data_b64": base64.b64encode(data).decode(), "timeout_s": 60}
        )
        by_uri = await client.post(
            "/v1/predict",
            data={"modality": "image", "model": "resnet18:imagenet1k-v1", "timeout_s": "60"},
            files={"uri": (None, str(picture))},  # a plain field: multipart whose payload is a uri
        )
    predictions = []
    for response in (uploaded, inline, by_uri):
        assert response.status_code == 200, response.text
        result = response.json()["result"]
        assert result["status"] == "ok" and result["modality"] == "image"
        assert len(result["prediction"]["labels"]) == 5
        predictions.append(result["prediction"])
    # Same bytes, same model process: the same top-5 (probabilities up to float noise).
    for other in predictions[1:]:
        assert [label["index"] for label in other["labels"]] == [label["index"] for label in predictions[0]["labels"]]
        assert [label["p"] for label in other["labels"]] == pytest.approx([label["p"] for label in predictions[0]["labels"]], abs=1e-4)


async def test_predict_that_times_out_returns_the_job_to_poll(api_settings):
    async with api(api_settings) as client:
        response = await client.post("/v1/predict", params={"timeout_s": 0.001},
                                     json={"modality": "text", "text": "too slow for a millisecond"})
        assert response.status_code == 202, response.text
        body = response.json()
        assert body["job_id"] and body["status_url"] == f"/v1/jobs/{body['job_id']}"
        assert body["detail"] == "timed out after 0.001 s waiting for the result; poll status_url"
        job = await poll_until_finished(client, body["status_url"])
    assert job["status"] == "done" and job["result"]["prediction"]["embedding"]


async def test_same_job_id_twice_is_one_job_published_once(api_settings):
    job_id = new_id("dup")
    async with api(api_settings) as client:
        first = await client.post("/v1/jobs", json={"modality": "text", "text": "the first text", "job_id": job_id})
        assert first.status_code == 202 and first.json()["job_id"] == job_id
        again = await client.post("/v1/jobs", json={"modality": "text", "text": "a different text", "job_id": job_id})
        assert again.status_code == 200, again.text
        assert again.json()["job_id"] == job_id and again.json()["status"] != "" and "status_url" in again.json()
        done = await poll_until_finished(client, first.json()["status_url"])
        # A sync request for the finished job is answered from the store, at once.
        predicted = await client.post("/v1/predict", json={"modality": "text", "text": "a third", "job_id": job_id})
        expected = await client.post("/v1/predict", json={"modality": "text", "text": "the first text", "timeout_s": 60})
    assert predicted.status_code == 200, predicted.text
    assert predicted.json()["result"] == done["result"]
    # The job is the first submission: its embedding is that of "the first text".
    assert done["result"]["prediction"]["embedding"] == pytest.approx(expected.json()["result"]["prediction"]["embedding"], abs=1e-5)
    assert await events_published(api_settings, job_id) == 1


async def test_a_job_whose_publish_failed_is_published_by_its_resubmission_after_a_restart(api_settings):
    """The broker fails the publish after the job was recorded: 503, nothing in Kafka, the job
    `accepted` with no accepted time. The API restarts; the client retries with the same job_id:
    now it is published (once) and answered, not refused as already known."""
    from mmpipe.api_runtime import BrokerUnavailable

    job_id = new_id("unpub")
    body = {"modality": "text", "text": "published on the second try", "job_id": job_id}
    async with running_app(api_settings) as app, client_for(app) as client:
        await until_ready(client)

        async def broker_fails(event):
            raise BrokerUnavailable("publish failed (injected)")

        app.state.runtime.link.publish = broker_fails
        refused = await client.post("/v1/jobs", json=body)
        assert refused.status_code == 503 and refused.json()["error"] == "broker_unavailable", refused.text
        assert refused.json()["job_id"] == job_id and refused.headers["retry-after"]
        # Without a job_id of its own the client learns the one the API gave the recorded job.
        anonymous = await client.post("/v1/jobs", json={k: v for k, v in body.items() if k != "job_id"})
        assert anonymous.status_code == 503 and anonymous.json()["job_id"] != job_id
        assert (await client.get(f"/v1/jobs/{anonymous.json()['job_id']}")).json()["published"] is False
        job = (await client.get(f"/v1/jobs/{job_id}")).json()
        assert job["status"] == "accepted" and "accepted" not in job["timestamps"] and job["published"] is False
    assert await events_published(api_settings, job_id) == 0

    async with api(api_settings) as client:  # a new process's state: nothing remembered in memory
        retried = await client.post("/v1/jobs", json=body)
        assert retried.status_code == 202, retried.text
        done = await poll_until_finished(client, retried.json()["status_url"])
        again = await client.post("/v1/jobs", json=body)
    assert done["status"] == "done" and done["result"]["prediction"]["embedding"] and done["published"] is True
    assert again.status_code == 200 and again.json()["status"] == "done"
    assert done["timestamps"]["accepted"] <= done["timestamps"]["finished"]
    assert await events_published(api_settings, job_id) == 1


# Refusals ---------------------------------------------------------------------------------------
async def test_v1_routes_need_the_bearer_token(api_settings):
    job_id = new_id("noauth")
    async with running_app(api_settings) as app:
        for token in (None, "wrong-token"):
            async with client_for(app, token) as client:
                refused = [
                    await client.post("/v1/jobs", json={"modality": "text", "text": "x", "job_id": job_id}),
                    await client.get(f"/v1/jobs/{job_id}"),
                    await client.post("/v1/predict", json={"modality": "text", "text": "x", "job_id": job_id}),
                ]
                for response in refused:
                    assert_error(response, 401, "missing_token" if token is None else "invalid_token")
                    assert response.headers["www-authenticate"].startswith("Bearer")
        async with client_for(app, None) as client:
            basic = await client.get(f"/v1/jobs/{job_id}", headers={"Authorization": "Basic dXNlcjpwYXNz"})
            assert_error(basic, 401, "missing_token")
            assert (await client.get("/healthz")).status_code == 200  # probes stay open
    assert open_store(api_settings.store_url).get_job(job_id) is None  # nothing was recorded


def _multipart_head(boundary: str, filename: str = "big.jpg") -> bytes:
    return (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"modality\"\r\n\r\nimage\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


class HugeBody:
    """A streamed upload that would be 64 MiB; records how much of it the server pulled."""

    def __init__(self, head: bytes, chunk: int = 64 * 1024, total: int = 64 * 1024 * 1024) -> None:
        self.head, self.chunk, self.total, self.sent = head, chunk, total, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        self.sent += len(self.head)
        while self.sent < self.total:
            yield b"\xff" * self.chunk
            self.sent += self.chunk


async def test_oversized_uploads_are_refused_before_being_read_whole(api_settings):
    boundary = "mmpipe-test-boundary"
    content_type = f"multipart/form-data; boundary={boundary}"
    async with api(api_settings) as client:
        # Declared too large: refused on the header, not one body byte pulled.
        declared = HugeBody(_multipart_head(boundary))
        response = await client.post("/v1/jobs", content=declared,
                                     headers={"content-type": content_type, "content-length": str(declared.total)})
        assert_error(response, 413, "request_too_large", "declares")
        assert declared.sent == 0

        # Chunked (no length): cut off once the count passes the limit.
        chunked = HugeBody(_multipart_head(boundary))
        response = await client.post("/v1/jobs", content=chunked, headers={"content-type": content_type})
        assert_error(response, 413, "request_too_large")
        assert chunked.sent <= UPLOAD_LIMIT + ENVELOPE_BYTES + 2 * chunked.chunk < chunked.total // 32

        # An honest upload one byte over the limit, as a file and as base64.
        over = b"\0" * (UPLOAD_LIMIT + 1)
        as_file = await client.post("/v1/jobs", files={"file": ("over.jpg", over)}, data={"modality": "image"})
        assert_error(as_file, 413, "payload_too_large", str(UPLOAD_LIMIT))
        as_b64 = await client.post("/v1/jobs", json={"modality": "image", "data_b64": base64.b64encode(over).decode()})
        assert_error(as_b64, 413, "payload_too_large", str(UPLOAD_LIMIT))
        text = await client.post("/v1/jobs", json={"modality": "text", "text": "x" * (UPLOAD_LIMIT + 1)})
        assert_error(text, 413, "payload_too_large")


async def test_uris_outside_the_input_roots_are_refused(api_settings, media_dir, tmp_path):
    outside = tmp_path / "secret.txt"  # tmp_path is not under the input root (media_dir)
    outside.write_text("not for you")
    file_link = media_dir / f"escape-{uuid.uuid4().hex[:8]}.txt"
    dir_link = media_dir / f"escape-dir-{uuid.uuid4().hex[:8]}"
    file_link.symlink_to(outside)
    dir_link.symlink_to(tmp_path, target_is_directory=True)
    traversal = str(media_dir) + "/" + os.path.relpath("/etc/passwd", media_dir)  # media/../../etc/passwd
    try:
        async with api(api_settings) as client:
            async def submit(uri: str) -> httpx.Response:
                return await client.post("/v1/jobs", json={"modality": "text", "uri": uri})

            assert "/../" in traversal
            assert_error(await submit(traversal), 403, "uri_outside_input_roots", "outside the allowed input roots")
            assert_error(await submit("file://" + traversal), 403, "uri_outside_input_roots")
            assert_error(await submit(str(file_link)), 403, "uri_outside_input_roots")
            assert_error(await submit(str(dir_link / "secret.txt")), 403, "uri_outside_input_roots")
            # The same answer whether or not the file exists: no probing of the host's files.
            assert_error(await submit("/etc/no-such-file-here"), 403, "uri_outside_input_roots")
            assert_error(await submit(str(media_dir / "no-such-file.txt")), 422, "file_not_found")
            assert_error(await submit("https://example.com/cat.jpg"), 403, "remote_uri_refused", "https://")
            assert_error(await submit("file://otherhost/etc/passwd"), 403, "remote_uri_refused")
    finally:
        file_link.unlink()
        dir_link.unlink()


async def test_invalid_jobs_get_clear_4xx(api_settings, picture):
    async with api(api_settings) as client:
        async def submit(body: dict) -> httpx.Response:
            return await client.post("/v1/jobs", json=body)

        assert_error(await submit({"modality": "smell", "text": "x"}), 422, "unknown_modality", "'smell'", "image, audio, video, text")
        assert_error(await submit({"text": "x"}), 422, "missing_modality")
        image = {"modality": "image", "uri": str(picture)}
        assert_error(await submit({**image, "model": "resnet18:v999"}), 422, "unknown_model", "resnet18:v999", "resnet18:imagenet1k-v1")
        assert_error(await submit({**image, "model": "resnet18"}), 422, "bad_model", "NAME:VERSION")
        assert_error(await submit({**image, "model": "all-minilm-l6-v2:1"}), 422, "wrong_modality", "text input")
        assert_error(await submit({"modality": "text"}), 422, "missing_payload", "exactly one payload")
        assert_error(await submit({"modality": "text", "text": "x", "uri": str(picture)}), 422, "ambiguous_payload", "uri and text")
        assert_error(await submit({"modality": "image", "text": "x"}), 422, "invalid_request", "modality text")
        assert_error(await submit({"modality": "image", "data_b64": "not base64!"}), 422, "bad_base64")
        assert_error(await submit({"modality": "text", "text": "x", "colour": "red"}), 422, "invalid_request", "colour")
        assert_error(await submit({"modality": "text", "text": "x", "deadline_s": -1}), 422, "invalid_request", "deadline_s")
        assert_error(await submit({"modality": "text", "text": "x", "job_id": "no spaces please"}), 422, "invalid_request", "job_id")

        headers = {"content-type": "application/json"}
        assert_error(await client.post("/v1/jobs", content=b'{"modality": ', headers=headers), 400, "malformed_json", "not valid JSON")
        assert_error(await client.post("/v1/jobs", content=b"[1, 2]", headers=headers), 422, "invalid_request", "JSON object")
        assert_error(await client.post("/v1/jobs", content=b"text", headers={"content-type": "text/plain"}), 415, "unsupported_media_type")
        assert_error(await client.post("/v1/predict", params={"timeout_s": "soon"}, json={"modality": "text", "text": "x"}),
                     422, "invalid_request", "timeout_s")
        assert_error(await client.get("/v1/jobs/no-such-job"), 404, "unknown_job", "no-such-job")
        assert_error(await client.get("/v1/jobs/a%00b"), 404, "unknown_job")  # a NUL never reaches the store


# Health and spec --------------------------------------------------------------------------------
async def test_readyz_reports_the_broker_down_and_healthz_stays_up(api_settings, tmp_path):
    closed = free_port()  # nothing listens there
    settings = api_settings.model_copy(update={"bootstrap": f"127.0.0.1:{closed}",
                                               "store_url": f"sqlite:///{tmp_path / 'api.db'}"})
    async with api(settings, wait_ready=False) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        response = await client.get("/readyz")
        assert response.status_code == 503, response.text
        checks = response.json()["checks"]
        assert not checks["broker"]["ok"] and str(closed) in checks["broker"]["detail"]
        assert not checks["results_listener"]["ok"] and checks["store"]["ok"]
        job = await client.post("/v1/jobs", json={"modality": "text", "text": "x", "job_id": "while-down"})
        assert_error(job, 503, "broker_unavailable")
        assert job.headers["retry-after"]
        assert_error(await client.post("/v1/predict", json={"modality": "text", "text": "x"}), 503, "results_listener_down")
    assert open_store(settings.store_url).get_job("while-down") is None  # refused before recording


async def test_readyz_details_only_with_the_token(api_settings):
    async with running_app(api_settings) as app, client_for(app, None) as client:
        response = await client.get("/readyz")
    assert response.json().keys() == {"status"}  # no hosts, no exception text


async def test_readyz_is_200_with_the_pipeline_broker(api_settings):
    async with api(api_settings) as client:
        response = await client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["status"] == "ready"
    assert all(check["ok"] for check in response.json()["checks"].values())


async def test_sync_waiters_are_bounded(api_settings, tmp_path):
    # Topics no stage consumes: a job published there is never answered, so the wait holds.
    settings = api_settings.model_copy(update={
        "topic_prefix": f"idle{uuid.uuid4().hex[:6]}", "store_url": f"sqlite:///{tmp_path / 'api.db'}",
        "api_max_sync_waiters": 1,
    })
    async with running_app(settings) as app, client_for(app) as client:
        await until_ready(client)
        body = {"modality": "text", "text": "nobody will answer"}
        waiting = asyncio.create_task(client.post("/v1/predict", params={"timeout_s": 3}, json=body))
        while app.state.runtime.listener.waiting < 1:
            assert not waiting.done(), waiting.result().text
            await asyncio.sleep(0.01)
        refused = await client.post("/v1/predict", json=body)
        assert_error(refused, 503, "too_many_waiters", "already waiting")
        assert refused.headers["retry-after"] == "1"
        timed_out = await waiting
        assert timed_out.status_code == 202 and timed_out.json()["status"] == "accepted"
        assert app.state.runtime.sync_waiters == 0 and app.state.runtime.listener.waiting == 0


async def test_docs_and_openapi_are_behind_the_token(api_settings):
    async with running_app(api_settings) as app, client_for(app, None) as anonymous:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert_error(await anonymous.get(path), 401, "missing_token")
    async with running_app(api_settings) as app, client_for(app) as client:
        for path in ("/docs", "/redoc"):
            page = await client.get(path)
            assert page.status_code == 200 and "/openapi.json" in page.text


async def test_openapi_lists_the_routes(api_settings):
    async with running_app(api_settings) as app, client_for(app) as client:
        spec = (await client.get("/openapi.json")).json()
    paths = spec["paths"]
    assert set(paths) == {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/predict", "/healthz", "/readyz"}
    assert set(paths["/v1/jobs"]) == {"post"} and set(paths["/v1/jobs/{job_id}"]) == {"get"}
    submit = paths["/v1/jobs"]["post"]
    assert submit["summary"] and {"202", "200", "401", "413", "422"} <= set(submit["responses"])
    assert set(submit["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    assert "timeout_s" in paths["/v1/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "202" in paths["/v1/predict"]["post"]["responses"]
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert paths["/v1/jobs/{job_id}"]["get"]["security"] == [{"HTTPBearer": []}]


# The command ------------------------------------------------------------------------------------
def test_mmpipe_api_command_serves_over_http(api_settings, tmp_path):
    port = free_port()
    settings_file = write_settings(api_settings, tmp_path / "api-settings.json")
    env = dict(os.environ, **{SETTINGS_FILE_ENV: str(settings_file)})
    log = open(tmp_path / "api.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "mmpipe.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None, (tmp_path / "api.log").read_text()
                assert time.monotonic() < deadline, "mmpipe api not ready in 120 s"
                time.sleep(0.3)
            assert client.post("/v1/jobs", json={"modality": "text", "text": "x"}).status_code == 401
            assert _status_of_huge_upload("127.0.0.1", port) == 413
            response = client.post("/v1/predict", json={"modality": "text", "text": "over a real socket", "timeout_s": 60},
                                   headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status_code == 200, response.text
            assert len(response.json()["result"]["prediction"]["embedding"]) == 384
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly
    assert process.returncode in (0, -signal.SIGTERM), (tmp_path / "api.log").read_text()
    assert "Application shutdown complete" in (tmp_path / "api.log").read_text()


def _status_of_huge_upload(host: str, port: int) -> int:
    """Over a real socket: declare 1 GiB, send 64 KiB, and read what uvicorn answers."""
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1073741824\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head + b"\0" * 65536)
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])
