"""`mmpipe up` as an operator runs it: a real `up` process (embedded broker, one process per
stage), a stage SIGKILLed under it and coming back, `mmpipe top` driven in a tmux pseudo-terminal
and read off the screen, `up` itself SIGKILLed leaving no process behind, and a start that fails
(no ImageNet weights, random weights refused) saying why in one line per process.

Heavy: run under the shared lock (see HELPERS.md).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmpipe.client import make_event
from mmpipe.schemas.settings import Settings
from mmpipe.streams.broker import free_port, free_port_block
from mmpipe.streams.topology import STAGE_NAMES
from mmpipe.supervisor import METRICS_PORT_SPAN, supervisor_metrics_port
from tests.helpers import publish, wait_for_results
from tests.system_tools import missing_tool, tool_expected

MMPIPE = [sys.executable, "-m", "mmpipe.cli"]
pytestmark = pytest.mark.slow


def processes_mentioning(marker: str) -> dict[int, str]:
    """Every live process whose environment holds `marker` (the test's own state dir)."""
    found = {}
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:  # a zombie has exited; its parent only has to reap it
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return found


def wait_gone(marker: str, timeout_s: float = 10.0) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    left = processes_mentioning(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_mentioning(marker)
    return left


class UpProcess:
    """`mmpipe up --json` in a subprocess; its stdout read as JSON lines on a thread."""

    def __init__(self, state_dir: Path, env: dict[str, str], base_port: int) -> None:
        self.state_dir = state_dir
        self.base_port = base_port
        self.env = env
        self.process = subprocess.Popen(
            [*MMPIPE, "up", "--json", "--metrics-base-port", str(base_port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, cwd=state_dir,
        )
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.events.put(json.loads(line))

    def next_event(self, timeout_s: float, **match: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                event = self.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {match} from up within {timeout_s}s; stderr: {self.stderr_now()}") from None
            if all(event.get(k) == v for k, v in match.items()):
                return event

    def stderr_now(self) -> str:
        return "" if self.process.poll() is None else self.process.stderr.read()

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{supervisor_metrics_port(self.base_port)}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()


def up_env(state_dir: Path, bootstrap: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMPIPE_")}
    env.update(
        MMPIPE_STATE_DIR=str(state_dir), MMPIPE_BOOTSTRAP=bootstrap, MMPIPE_PARTITIONS="2",
        MMPIPE_TORCH_THREADS="1", MMPIPE_DECODE_WORKERS="1", MMPIPE_INFERENCE_WORKERS="1",
        TORCH_HOME=str(state_dir / "torch"),  # no cached ImageNet weights either
        HF_HUB_OFFLINE="1",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    state_dir = tmp_path_factory.mktemp(f"up-{uuid.uuid4().hex[:6]}")
    env = up_env(state_dir, f"127.0.0.1:{free_port()}")  # random weights: up's default, as the demo's
    running = UpProcess(state_dir, env, free_port_block(METRICS_PORT_SPAN))
    try:
        running.next_event(240, event="up")
        yield running
    finally:
        if running.process.poll() is None:
            running.process.kill()
        running.process.wait(30)
        wait_gone(str(state_dir))


def settings_of(up: UpProcess) -> Settings:
    return Settings(bootstrap=up.env["MMPIPE_BOOTSTRAP"], state_dir=up.state_dir, partitions=2)


def test_a_killed_stage_is_restarted_and_counted(up: UpProcess) -> None:
    inference = next(pid for pid, cmd in processes_mentioning(str(up.state_dir)).items() if "worker inference" in cmd)
    os.kill(inference, signal.SIGKILL)

    exited = up.next_event(30, kind="exited", process="inference-0")
    assert exited["pid"] == inference and "killed by SIGKILL" in exited["detail"]
    restarted = up.next_event(30, kind="restarted", process="inference-0")
    assert restarted["pid"] != inference and restarted["restarts"] == 1
    up.next_event(180, kind="ready", process="inference-0")
    assert 'mm_supervisor_restarts_total{replica="0",stage="inference"} 1.0' in up.metrics()

    # The restarted stage does the work: a job goes through end to end.
    settings = settings_of(up)
    job = make_event("text", text="a stage came back", job_id=f"op-{uuid.uuid4().hex[:8]}")
    publish(settings, [job])
    assert wait_for_results(settings, [job.job_id], timeout_s=120)[job.job_id].status == "ok"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


TMUX_PACKAGE = Path("/var/lib/dpkg/info/tmux.list")  # dpkg's record of the installed package


def require_tmux() -> None:
    """The screen test needs tmux: without it a failure where tmux is expected, else a skip."""
    if shutil.which("tmux") is None:
        expected = tool_expected("MMPIPE_REQUIRE_TMUX", package_installed=TMUX_PACKAGE.exists())
        missing_tool("tmux", "tmux not installed (apt package `tmux`; ./dev installs it)", expected)


@pytest.fixture(scope="module")
def tmux_installed() -> None:
    # Module scope, asked for before `up`: a missing tmux is reported before a pipeline starts.
    require_tmux()


def test_tmux_missing_fails_where_expected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt package `tmux`"):
        require_tmux()
    monkeypatch.delenv("CI")
    monkeypatch.delenv("MMPIPE_REQUIRE_TMUX", raising=False)
    monkeypatch.setattr(f"{__name__}.TMUX_PACKAGE", tmp_path / "not-installed")
    with pytest.raises(pytest.skip.Exception, match="apt package `tmux`"):
        require_tmux()


def test_top_shows_the_pipeline_on_screen(tmux_installed: None, up: UpProcess) -> None:
    settings = settings_of(up)
    jobs = [make_event("text", text=f"top test {i}", job_id=f"top-{uuid.uuid4().hex[:8]}") for i in range(6)]
    publish(settings, jobs)
    wait_for_results(settings, [j.job_id for j in jobs], timeout_s=120)

    session = f"mmpipe-top-{uuid.uuid4().hex[:6]}"
    # rich takes COLUMNS/LINES over the terminal's size: drop any the test runner has set.
    command = " ".join(["env", "-u", "COLUMNS", "-u", "LINES", *MMPIPE, "top", "--interval", "1", "--window", "30", "--metrics-base-port", str(up.base_port)])
    env_args = [arg for k, v in up.env.items() if k.startswith(("MMPIPE_", "HF_")) for arg in ("-e", f"{k}={v}")]
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "40", *env_args, command)
    try:
        screen = _screen_when(session, lambda s: table_row(s, "inference") is not None)
        row = table_row(screen, "inference")
        # stage members in/s done/s lag queue batch restarts dead-letters needed
        assert row[1] == "1" and row[7] == "1", screen  # one member; restarted once by the test above
        assert all(len(line) <= 80 for line in screen.splitlines()) and "e2e p50/p99 ms" in screen
        assert table_row(screen, "sink")[5] != "-", screen  # the sink's queue wait is known: jobs went through

        tmux("resize-window", "-t", session, "-x", "60", "-y", "60")
        narrow = _screen_when(session, lambda s: "rst 1" in s)  # stacked: "column value" under each stage
        assert all(len(line) <= 60 for line in narrow.splitlines())
        assert all(stage in narrow for stage in STAGE_NAMES)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


def table_row(screen: str, stage: str) -> list[str] | None:
    """The stage's row of top's table (ten cells), if the screen shows the table form."""
    return next((cells for line in screen.splitlines() if (cells := line.split())[:1] == [stage] and len(cells) == 10),
                None)


def _screen_when(session: str, ready: callable, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = tmux("capture-pane", "-p", "-t", session)
        if ready(screen):
            return screen
        time.sleep(0.5)
    raise AssertionError(f"screen never showed what was expected:\n{screen}")


def run_cli(up: UpProcess, *args: str) -> dict:
    done = subprocess.run([*MMPIPE, *args], env=up.env, cwd=up.state_dir, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_scripts_get_json(up: UpProcess) -> None:
    settings = settings_of(up)
    job = make_event("text", text="for a script", job_id=f"json-{uuid.uuid4().hex[:8]}")
    publish(settings, [job])
    wait_for_results(settings, [job.job_id], timeout_s=120)

    shown = run_cli(up, "results", job.job_id, "--json")
    assert shown["job"]["state"] == "done" and shown["result"]["status"] == "ok"
    lag = run_cli(up, "lag", "--window", "1", "--json", "--metrics-base-port", str(up.base_port))
    assert [h["stage"] for h in lag["hints"]] == list(STAGE_NAMES)
    assert all(h["members"] == 1 for h in lag["hints"]) and lag["endpoints_answered"] == 4
    frame = run_cli(up, "top", "--json", "--interval", "1", "--metrics-base-port", str(up.base_port))
    assert frame["supervisor_reached"] and {v["stage"]: v["restarts"] for v in frame["stages"]}["inference"] == 1


def test_sigkill_of_up_leaves_no_process(up: UpProcess) -> None:
    children = processes_mentioning(str(up.state_dir))
    assert any("worker sink" in cmd for cmd in children.values()) and any("broker" in cmd for cmd in children.values())
    up.process.send_signal(signal.SIGKILL)
    up.process.wait(10)
    assert wait_gone(str(up.state_dir)) == {}


def test_a_failed_start_says_why_and_stops_everything(tmp_path: Path) -> None:
    env = up_env(tmp_path, f"127.0.0.1:{free_port()}", MMPIPE_ALLOW_RANDOM_WEIGHTS="0")
    done = subprocess.run([*MMPIPE, "up", "--metrics-base-port", str(free_port_block(METRICS_PORT_SPAN))], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr  # the summary, then one line per failing process
    assert lines[1].startswith("inference-0: exited with code 1: ")
    assert "WeightsUnavailable: no weights for resnet18" in lines[1] and "MMPIPE_ALLOW_RANDOM_WEIGHTS=1" in lines[1]
    assert lines[1].endswith(f"(log: {tmp_path / 'run' / 'inference-0.log'})")
    assert wait_gone(str(tmp_path)) == {}


def test_a_broker_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = up_env(tmp_path, f"127.0.0.1:{taken.getsockname()[1]}")
        done = subprocess.run([*MMPIPE, "up", "--json", "--metrics-base-port", "0"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    (failure,) = json.loads(done.stdout)["failures"]
    assert failure["process"] == "broker" and "Address in use" in failure["reason"], failure
    assert wait_gone(str(tmp_path)) == {}
