"""Wake-ups between co-located stages: a consumer fetches when records are there, not on a clock.

The embedded broker (Tansu) holds a fetch that finds nothing for its whole max wait, so a stage
consumer polls: a 20 ms wait is 50 fetches a second, each one a request the broker pays for
whether or not records came. benchmarks/broker_requests.py counted them: at 5 image jobs/s
fetches were 44 of a job's 63 requests, and 9 of 16 at saturation; the broker's CPU per job
follows its request count (benchmarks/hop_latency.py). Apache Kafka long-polls and needs none of
this; set `fetch_wakeups` false there.

How: every stage consumer binds a Unix datagram socket in a folder per stage, shared by the
pipeline's processes on this machine (`wake_folder`). A stage process, once the broker
acknowledged a record, sends a datagram naming it (topic, partition, offset) to every socket of
the stage that reads the record's topic (`WakeSender`); so do the project's producers of events
(mmpipe.client's Publisher, the job API) for the first stage. The consumer holds each fetch until a datagram
comes (the broker then holds it briefly: FetchGate.hold_ms) or the fallback runs out, unless
the broker's last answer reported records past its offsets (`FetchGate`, used by
streams/transport.py). A hop then costs a datagram and a fetch or two instead of a
poll every 20 ms.

What cannot be lost: a datagram that never arrives (the producer is on another machine, or
crashed between its ack and the datagram) delays its record by at most the fallback; a full
socket queue drops a datagram only when others are waiting to be read. A consumer that finds
records after waits no wake-up ended, and has had no wake-up for `UNANNOUNCED_HOLD_S`, has
producers that never send them (another machine, an external client): it polls exactly as
without wake-ups (the broker holds each fetch for the polling wait) until one comes. The cost
of mixing both kinds of producer on one topic: while announced records keep coming, an
unannounced one waits up to the fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mmpipe.schemas.settings import Settings
from mmpipe.streams.topology import pipeline_of

log = logging.getLogger(__name__)

UNANNOUNCED_HOLD_S = 10.0  # records, and no wake-up for this long: the consumer polls
LISTING_TTL_S = 1.0  # how long a sender trusts its listing of a stage's sockets


def wake_folder(state_dir: Path, bootstrap: str, topic_prefix: str, stage: str) -> Path:
    """The folder of `stage`'s wake-up sockets for one pipeline (state folder, broker, topic
    prefix). Under the temp folder, hashed: a socket path must stay under 108 bytes."""
    pipeline = f"{Path(state_dir).resolve()}|{bootstrap}|{topic_prefix}"
    digest = hashlib.sha256(pipeline.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"mmpipe-wake-{os.getuid()}" / digest / stage


def listening_folder(settings: Settings, stage: str) -> Path | None:
    """Where `stage`'s consumers listen for wake-ups; None where they poll: wake-ups off, or a
    stage these settings do not run. The first stage listens too: the project's own producers
    (mmpipe.client's Publisher, the job API) send them; records from producers that do not are
    noticed and polled for (FetchGate)."""
    if not settings.fetch_wakeups or stage not in {spec.name for spec in pipeline_of(settings)}:
        return None
    return wake_folder(settings.state_dir, settings.bootstrap, settings.topic_prefix, stage)


def reader_folders(settings: Settings) -> dict[str, Path]:
    """Topic name -> the wake folder of the stage that reads it, for every listening stage."""
    folders = {}
    for spec in pipeline_of(settings):
        folder = listening_folder(settings, spec.name)
        if folder is not None:
            folders.update({topic.name(settings.topic_prefix): folder for topic in spec.inputs})
    return folders


# A partition's end in the broker's last answer to this consumer (None: not known here).
KnownEnd = Callable[[str, int], "int | None"]


def wake_payload(topic: str, partition: int, offset: int) -> bytes:
    return f"{topic}\n{partition}\n{offset}".encode()


def parse_wake(payload: bytes) -> tuple[str, int, int] | None:
    """(topic, partition, offset) of the record a wake-up announces; None for one that names
    none (a sender from before wake-ups named records) or that cannot be read."""
    try:
        topic, partition, offset = payload.decode().split("\n")
        return topic, int(partition), int(offset)
    except ValueError:
        return None


@dataclass
class FetchGate:
    """Holds each fetch until a wake-up or the fallback; the clock is the caller's (transport.py
    feeds it; tests drive it). Records a fetch could not carry (a size limit), or that came
    while the last ones were handled, do not wait: the transport sees them in the broker's last
    answer (its high watermarks) and calls `fetch_at_once`. So a consumer kept busy by records
    that arrive one at a time no longer fetches once more after each, only to find nothing
    (before, the wait after records was the polling wait, and at saturation a third of every
    stage's fetches came back empty). A consumer that polls (records without wake-ups) does not
    wait here: its fetches are held by the broker again."""

    fallback_ms: int
    # What a gated fetch asks the broker to hold it for. Not 1 ms: Tansu answered a 1 ms fetch
    # empty for 12 s on end while records were there, once a burst had ended
    # (tests/test_overload.py: results 5-19 s late in the sink's topic); one that may wait the
    # polling wait finds them, and comes back at once when they are there before it.
    hold_ms: int = 20
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    polling: bool = False  # records came while no wake-up did: producers that never send them
    last_wake_at: float = float("-inf")
    next_wait_ms: int = 0  # the first fetch goes at once
    # With it, a wake-up for a record the last answer already reported (its high watermark is
    # past the record) does not send a fetch: at saturation such wake-ups, read while the fetch
    # that brought their record was on its way, each sent one more fetch that found nothing.
    known_end: KnownEnd | None = None
    _announced: dict[tuple[str, int], int] = field(default_factory=dict)  # since the last fetch went
    _unnamed: bool = False  # a wake-up that named no record, or a poke: always news
    _timed_out: bool = False

    def heard(self, now: float) -> None:
        """A wake-up came, for news or not: this consumer's producers send them."""
        self.last_wake_at = now
        self.polling = False

    def wake(self, now: float) -> None:
        """A wake-up that names no record."""
        self.heard(now)
        self.poke()

    def announce(self, topic: str, partition: int, offset: int, now: float) -> None:
        """A wake-up for the record at `offset`: news unless the last answer reported it."""
        self.heard(now)
        key = (topic, partition)
        self._announced[key] = max(offset, self._announced.get(key, offset))
        self.woken.set()

    def poke(self) -> None:
        """Fetch now (a resumed partition may have records waiting)."""
        self._unnamed = True
        self.woken.set()

    def _news(self) -> bool:
        if self._unnamed or self.known_end is None:
            return True
        for (topic, partition), offset in self._announced.items():
            end = self.known_end(topic, partition)
            if end is None or offset >= end:
                return True
        return False

    def after_fetch(self, got_records: bool, poll_ms: int, now: float) -> None:
        """Set the next fetch's wait; `poll_ms` is the polling wait (the adaptive fetch wait),
        which it never undercuts. Records found after a wait that no wake-up ended, with no
        wake-up for a while, mean producers that do not send them (another machine, an external
        client): then poll. A wake-up only late for its record (it follows the ack) does not
        count: others came before it."""
        if got_records and self._timed_out and now - self.last_wake_at > UNANNOUNCED_HOLD_S and not self.polling:
            log.info("records arrive without wake-ups: polling every fetch wait until one comes")
            self.polling = True
        self._timed_out = False
        if self.polling:
            self.next_wait_ms = 0  # the broker holds the fetch instead (fetch_max_wait_ms)
        else:
            self.next_wait_ms = max(poll_ms, self.fallback_ms)

    def fetch_at_once(self) -> None:
        """The next fetch goes without waiting for a wake-up (records are known to be there)."""
        self.next_wait_ms = 0

    def fetch_max_wait_ms(self, poll_ms: int) -> int:
        """What the next fetch asks the broker to hold it for: the polling wait while polling
        (as without wake-ups: Apache Kafka answers such a fetch as soon as records come), else
        `hold_ms` (the gate already waited; shorter holds missed records on the embedded broker)."""
        return poll_ms if self.polling else self.hold_ms

    async def wait(self) -> bool:
        """Until a wake-up or the next fetch's wait, then clear the wake-up (one for a record
        the coming fetch misses arrives after it); True when the fetch may go. Cancelled, it
        returns False instead of raising: aiokafka's fetcher, closing or reassigned, awaits
        its cancelled fetch tasks and expects them to return, as its own do."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.next_wait_ms / 1000
        try:
            while True:
                await asyncio.wait_for(self.woken.wait(), max(0.0, deadline - loop.time()))
                if self._news():
                    break
                self.woken.clear()  # each record announced came with the last answer
                self._announced.clear()
        except asyncio.TimeoutError:
            self._timed_out = self.next_wait_ms > 0  # the first fetch waits for nothing
        except asyncio.CancelledError:
            return False
        self.woken.clear()
        self._announced.clear()
        self._unnamed = False
        return True


class WakeListener:
    """This process's socket in its stage's wake folder; each datagram wakes `gate` (for the
    record it names, if any). Runs on the loop that fetches (faust's consumer thread)."""

    def __init__(self, folder: Path, gate: FetchGate) -> None:
        self.path = folder / str(os.getpid())
        self.gate = gate
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket left by an earlier process with this pid
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(self.path))
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._drain)
        self._sock = sock

    def _drain(self) -> None:
        assert self._sock is not None
        now = time.monotonic()
        with contextlib.suppress(BlockingIOError):
            while True:
                record = parse_wake(self._sock.recv(512))
                if record is None:
                    self.gate.wake(now)
                else:
                    self.gate.announce(*record, now)

    def poke(self) -> None:
        """Wake the gate from any thread (a resumed partition may have records waiting)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.gate.poke)

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class WakeSender:
    """Sends a wake-up to the stage that reads a topic, after a record to it was acknowledged.
    `reader_folders` maps topic names to the reading stage's wake folder."""

    def __init__(self, reader_folders: dict[str, Path]) -> None:
        self.reader_folders = reader_folders
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._listings: dict[Path, tuple[float, list[str]]] = {}

    def notify(self, topic: str, partition: int | None = None, offset: int | None = None) -> None:
        """`partition` and `offset`: the acknowledged record's, so its reader can tell whether its
        last fetch already brought it; without them the wake-up is always news."""
        folder = self.reader_folders.get(topic)
        if folder is None:
            return
        payload = b"" if partition is None or offset is None else wake_payload(topic, partition, offset)
        for path in self._listing(folder):
            try:
                self._sock.sendto(payload, path)
            except BlockingIOError:
                pass  # its queue is full: it has wake-ups to read already
            except ConnectionRefusedError:
                self._forget(folder, path, stale=True)
            except OSError:  # gone, or not ours to write to: never fail a send over a wake-up
                self._forget(folder, path, stale=False)

    def _listing(self, folder: Path) -> list[str]:
        now = time.monotonic()
        cached = self._listings.get(folder)
        if cached is None or now - cached[0] > LISTING_TTL_S:
            try:
                paths = [entry.path for entry in os.scandir(folder)]
            except FileNotFoundError:
                paths = []
            cached = (now, paths)
            self._listings[folder] = cached
        return cached[1]

    def _forget(self, folder: Path, path: str, stale: bool) -> None:
        """Drop a socket nobody listens on; `stale`: its process is gone (SIGKILL leaves the
        file), so remove the file too."""
        with contextlib.suppress(ValueError):
            self._listings[folder][1].remove(path)
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        self._sock.close()


def wake_sender(settings: Settings) -> WakeSender | None:
    """The sender a producer of records for the pipeline's stages uses; None with wake-ups off."""
    return WakeSender(reader_folders(settings)) if settings.fetch_wakeups else None
