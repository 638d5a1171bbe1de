"""A stage process logs at its configured level, and nothing makes every library's debug call
build a record: faust's worker, to spin its terminal spinner on every log call, sets the root
logger to DEBUG (streams/delivery.py: quiet_worker turns the spinner off)."""

from __future__ import annotations

import logging

import faust
import pytest

from mmpipe.cli import logging_level
from mmpipe.streams.delivery import quiet_worker, use_event_loop


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    root.handlers = [logging.StreamHandler()]
    root.setLevel(logging.WARNING)
    yield root
    root.handlers, root.level = saved_handlers, saved_level


def test_the_stage_worker_leaves_the_root_logger_at_its_level(root_logger):
    app = faust.App("t-logging", broker="kafka://127.0.0.1:9", web_enabled=False)
    faust.Worker(app, loglevel="warn", quiet=True).on_setup_root_logger(root_logger, logging.WARNING)
    assert root_logger.level == logging.DEBUG, "faust's own worker: the reason for quiet_worker"

    root_logger.setLevel(logging.WARNING)
    quiet_worker(app, "warn").on_setup_root_logger(root_logger, logging.WARNING)
    assert root_logger.level == logging.WARNING
    assert not logging.getLogger("aiokafka.producer.producer").isEnabledFor(logging.DEBUG)


@pytest.mark.parametrize(("configured", "level"), [("warn", "WARNING"), ("warning", "WARNING"), ("info", "INFO"),
                                                   ("DEBUG", "DEBUG")])
def test_configured_log_levels_map_to_the_logging_modules_names(configured, level):
    assert logging_level(configured) == level
    assert isinstance(logging.getLevelName(level), int)  # a name the logging module knows


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_the_stage_worker_runs_on_the_configured_event_loop(kind):
    """StageRuntime.run sets the loop policy before the faust worker makes its loop."""
    import asyncio

    import uvloop

    app = faust.App(f"t-loop-{kind}", broker="kafka://127.0.0.1:9", web_enabled=False)
    try:
        use_event_loop(kind)
        loop = quiet_worker(app, "warn").loop
        assert isinstance(loop, uvloop.Loop) == (kind == "uvloop")
        loop.close()
    finally:
        asyncio.set_event_loop_policy(None)
        asyncio.set_event_loop(None)
