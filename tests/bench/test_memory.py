"""`qkv.bench` memory readers: the resident set (VmHWM) and Python's traced allocations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qkv.bench import peak_growth, peak_rss_bytes, status_bytes, traced_peak_bytes

MIB = 2**20


def test_status_fields_match_proc_self_status() -> None:
    rss = status_bytes("VmRSS")
    if not Path("/proc/self/status").exists():
        assert rss is None
        return
    assert rss is not None and rss > 10 * MIB  # this process holds PyTorch
    assert peak_rss_bytes() >= rss
    assert status_bytes("NoSuchField") is None


def test_peak_growth_sees_a_buffer_touched_and_freed_inside() -> None:
    if not Path("/proc/self/clear_refs").exists():
        with pytest.raises(OSError, match="cannot be measured here"), peak_growth():
            pass
        return
    with peak_growth(trim=True) as growth:
        buffer = torch.ones(64 * MIB // 4)  # 64 MiB, every page written
        del buffer
    assert growth.bytes >= 60 * MIB
    with peak_growth() as idle:
        pass
    assert idle.bytes < 16 * MIB


def test_traced_peak_counts_numpy_arrays() -> None:
    size = 8 * MIB
    assert size <= traced_peak_bytes(lambda: np.ones(size // 8)) < size + MIB


def test_traced_peak_leaves_a_callers_tracing_running_and_counts_only_fn() -> None:
    import tracemalloc

    size = 8 * MIB
    tracemalloc.start()
    try:
        held = np.ones(size // 8)  # allocated before: not part of fn's peak
        assert size <= traced_peak_bytes(lambda: np.ones(size // 8)) < size + MIB
        assert tracemalloc.is_tracing()
        del held
    finally:
        tracemalloc.stop()
