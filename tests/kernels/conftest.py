"""The kernel tests test each kernel's own dtype path: bfloat16 stays bfloat16 here even where this
CPU only emulates its products (`qkv.native.machine.KEEP_VARIABLE`), so that the bf16 kernels'
fallbacks run on every machine (slowly where emulated); the float32 widening that `qkv.attention`
applies on such machines is tested in `test_machine.py` and by the suite outside this folder."""

from __future__ import annotations

import pytest

from qkv.native.machine import KEEP_VARIABLE


@pytest.fixture(autouse=True)
def _keep_low_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_VARIABLE, "1")
