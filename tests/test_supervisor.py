"""The supervisor's parts that need no pipeline: the restart backoff, the one-line reason read
from a real crashed process's log, and children that die with their parent (real processes,
the parent SIGKILLed). `up` itself is tested end to end in test_operators.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mmpipe.supervisor import RestartPolicy, StartFailed, StartFailure, last_reason


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(base_s=1.0, cap_s=30.0)
    assert [policy.delay_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def crashed_log(tmp_path: Path, code: str) -> Path:
    """The log of a real Python process that died of `code`, written as the supervisor writes one."""
    log = tmp_path / "stage.log"
    with open(log, "wb") as out:
        subprocess.run([sys.executable, "-c", textwrap.dedent(code)], stdout=out, stderr=subprocess.STDOUT, check=False)
    return log


def test_the_reason_is_the_exception_that_ended_the_traceback(tmp_path: Path) -> None:
    log = crashed_log(tmp_path, """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("stage").warning("loading models")
        class WeightsUnavailable(RuntimeError):
            pass
        def load():
            try:
                {}["weights"]
            except KeyError as exc:
                raise WeightsUnavailable("no weights for resnet18: put resnet18-f37072fd.pth in var/weights") from exc
        load()
    """)
    assert log.read_text().count("Traceback") == 2  # chained: the KeyError, then the one that ended it
    assert last_reason(log) == "WeightsUnavailable: no weights for resnet18: put resnet18-f37072fd.pth in var/weights"


def test_without_a_traceback_the_last_error_line_is_the_reason(tmp_path: Path) -> None:
    log = crashed_log(tmp_path, """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("stage").error("broker 127.0.0.1:9092 unreachable")
        logging.getLogger("stage").info("shutting down")
        sys.exit(3)
    """)
    assert last_reason(log).endswith("stage ERROR broker 127.0.0.1:9092 unreachable")
    assert last_reason(tmp_path / "missing.log") == "(no log)"


def test_start_failed_names_every_process_on_its_own_line() -> None:
    failed = StartFailed([
        StartFailure("inference-0", "exited with code 1: WeightsUnavailable: no weights", Path("/r/inference-0.log")),
        StartFailure("broker", "broker exited with code 1: Address already in use", None),
    ])
    assert str(failed).splitlines()[1:] == [
        "inference-0: exited with code 1: WeightsUnavailable: no weights  (log: /r/inference-0.log)",
        "broker: broker exited with code 1: Address already in use",
    ]


PARENT = """
import subprocess, sys, time
from mmpipe.streams.children import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_dies_when_its_parent_is_sigkilled() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # Reparented to init (or a subreaper) and killed, it may linger a moment as a zombie.
    return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
