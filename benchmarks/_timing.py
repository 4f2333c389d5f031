"""Timing helpers shared by the benchmark scripts: interleaved repetitions, medians, matmul rate.

Machines are shared and noisy, so every comparison is a ratio between implementations timed
in the same process, interleaved (a, b, c, a, b, c, ...) so that a slow spell hits all of
them, and summarized by the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def matmul_gflops(n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The machine's matrix-multiply rate in ``dtype``: 2 n^3 FLOPs per n x n product."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    seconds = time_interleaved({"mm": lambda: a @ b}, reps=reps)["mm"]
    return 2 * n**3 / seconds / 1e9
