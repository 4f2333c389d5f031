"""This machine's matrix-multiply rate per dtype: the limit a benchmark reports its GFLOP/s
against, measured in the same run as the paths it compares.

A bfloat16 product on a CPU with AMX runs several times faster than a float32 one, so each
dtype is compared with its own rate (`qkv.kernels.machine` says when a dtype has no native
instructions on this CPU). FLOPs of one n x n product: 2 n^3.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from qkv.bench._timing import fastest

__all__ = ["machine_matmul_gflops", "matmul_gflops"]

# Side and rounds of the product `machine_matmul_gflops` measures for `qkv.explain`: large
# enough for the BLAS's steady state on a few cores, well under a second in float32.
_EXPLAIN_SIDE = 1024
_EXPLAIN_REPEATS = 5


def matmul_gflops(
    dtype: torch.dtype = torch.float32,
    *,
    side: int = 2048,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """GFLOP/s of one square ``dtype`` matrix multiply of ``side``, now: 2 side^3 FLOPs over the
    fastest of ``repeats`` products (one warm-up; `fastest`)."""
    if side < 1:
        raise ValueError(f"side must be >= 1, got {side}")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(side, side, generator=gen).to(dtype)
    b = torch.randn(side, side, generator=gen).to(dtype)
    seconds = fastest({"matmul": lambda: a @ b}, repeats, warmup=1, clock=clock)["matmul"]
    return 2 * side**3 / seconds / 1e9


@functools.cache
def machine_matmul_gflops(dtype: torch.dtype, threads: int) -> float:
    """The rate of a 1024^2 ``dtype`` product on ``threads`` threads, measured once per process
    and cached: what `qkv.explain(..., measure=True)` reports (benchmarks measure their own)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return matmul_gflops(dtype, side=_EXPLAIN_SIDE, repeats=_EXPLAIN_REPEATS)
    finally:
        torch.set_num_threads(previous)
