"""Shared test settings: deterministic seeds and hypothesis profiles sized for 2-core CI."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("QKV_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# The CLI's two consoles, at fixed widths whatever COLUMNS or the terminal say: stdout's tables at
# 200 columns, so that a test reads every cell whole; stderr's messages at 40, so that a message
# that was hard-wrapped would split the words and paths that the tests look for.
CLI_TABLE_WIDTH = 200
CLI_MESSAGE_WIDTH = 40


@pytest.fixture(autouse=True)
def _cli_console_widths() -> None:
    from qkv.cli._app import console, err_console

    console.width = CLI_TABLE_WIDTH
    err_console.width = CLI_MESSAGE_WIDTH
