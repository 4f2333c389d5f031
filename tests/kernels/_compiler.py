"""A C++ compiler that always fails, for the tests of a failed build: an executable script named
by ``$CXX`` that prints one compiler-style error line (after a context line, as GCC does) and
exits 1. Its own ``--version`` fails too, so its builds go to a cache folder of their own."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

ERROR_LINE = "kernel.cpp:1:10: error: this compiler always fails"
# what a kernel's unavailable_reason says after a build with it
REASON = f"its build failed ({ERROR_LINE})"


def use_failing_compiler(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Make every build of this test run the failing compiler, into ``folder``'s cache."""
    script = folder / "failing-c++"
    script.write_text(f"#!/bin/sh\necho 'kernel.cpp: In function f:' >&2\necho '{ERROR_LINE}' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder / "cache"))


def forget_builds(monkeypatch: pytest.MonkeyPatch, module: object) -> None:
    """Empty a kernel module's build attempts for one test: the interval pair keeps one per tier
    (``_KERNEL.attempts``), the other kernels one (``_built``)."""
    if hasattr(module, "BUILDS"):
        monkeypatch.setattr(module._KERNEL, "attempts", {tier: {} for tier in module.BUILDS})  # type: ignore[attr-defined]
    else:
        monkeypatch.setattr(module, "_built", {})
