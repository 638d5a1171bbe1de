"""System tools the tests drive outside Python (PostgreSQL's server, tmux).

Where a tool is expected, a test that needs it fails without it instead of skipping: a CI
machine missing one must not pass by skipping what it was meant to check."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def tool_expected(require_env: str, package_installed: bool) -> bool:
    """Expected in CI (CI=true, or `require_env`=1) and where the tool's Debian package is
    installed (./dev installs it), so a broken install fails too."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get(require_env) == "1" or package_installed


def missing_tool(tool: str, reason: str, expected: bool) -> NoReturn:
    """A failure where the tool is expected, else a skip."""
    if expected:
        pytest.fail(f"{tool} is expected here but {reason}")
    pytest.skip(reason)
