"""Named fault points, for fault runs and tests: a crash exactly where it hurts most, not a
kill timed by luck. `settings.fault_points` lists them:

    "sink.after_commit"             kill the process there once (a marker file under the state
                                    directory remembers it fired, so the restarted stage runs on)
    "decode.handle:JOB_ID"          kill it there every time that job comes by (a poison job)

Points in the code: sink.after_commit (a job's result is committed to the store, not yet
published), sink.between_parts (a part of a multi-part job is stored, the job is not complete),
inference.batch (inside a model batch, on the executor thread), decode.handle (an event is
about to be decoded).
"""

from __future__ import annotations

import logging
import os
import signal

from mmpipe.schemas.settings import Settings

log = logging.getLogger(__name__)
POINTS = ("sink.after_commit", "sink.between_parts", "inference.batch", "decode.handle")


def fired(settings: Settings) -> list[str]:
    """The once-only points that have fired under this state directory."""
    return sorted(p.name.removesuffix(".fired") for p in settings.state_path("faults").glob("*.fired"))


def crash_point(settings: Settings, point: str, job_id: str) -> None:
    """SIGKILL this process if `point` (for this job, or once) is armed in the settings."""
    if not settings.fault_points:
        return
    if f"{point}:{job_id}" in settings.fault_points:
        _die(point, job_id)
    if point in settings.fault_points:
        marker = settings.state_path("faults", f"{point}.fired")
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(job_id)
            _die(point, job_id)


def _die(point: str, job_id: str) -> None:
    log.error("fault point %s fired on %s: SIGKILL", point, job_id)
    os.kill(os.getpid(), signal.SIGKILL)
