"""Shared test settings: deterministic seeds and hypothesis profiles sized for 2-core CI."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

# Inductor's on-disk cache keys leave out three things these tests change: whether
# ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA holds ATen or oneDNN to a lower tier (.ci/run's
# forced-AVX2 and forced-AVX-512 runs; code built under
# one setting and loaded under the other returned NaN or aborted in malloc, torch 2.15 on an
# AMX Xeon, 2026-12-05), and the fake implementations of qkv's own operators (code traced
# against an older one failed its stride assertions). So each ATen capability, oneDNN ISA
# limit and state of qkv's source gets its own cache folder, unless the caller chose one.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _source = hashlib.sha256()
    for _path in sorted((Path(__file__).parents[1] / "src" / "qkv").rglob("*.py")):
        _source.update(_path.read_bytes())
    _uid = os.getuid() if hasattr(os, "getuid") else "user"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"qkv-tests-inductor-{_uid}",
        f"{torch.backends.cpu.get_cpu_capability().lower()}-{os.environ.get('ONEDNN_MAX_CPU_ISA', 'all').lower()}"
        f"-{torch.__version__}-{_source.hexdigest()[:16]}",
    )  # fmt: skip

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


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every Plan (`qkv.attention.dispatch.Plan`) `qkv.attention` chooses from now on, eager
    or traced (traced calls at trace time)."""
    from qkv.attention import dispatch, functional

    seen: list[Any] = []
    real = dispatch.choose_path

    def spy(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        seen.append(plan)
        return plan

    monkeypatch.setattr(functional, "choose_path", spy)
    return seen
