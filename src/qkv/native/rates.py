"""This machine's matrix-multiply rate per dtype: the limit a benchmark reports its GFLOP/s
against, measured in the same run as the paths it compares.

A bfloat16 product on a CPU with AMX runs several times faster than a float32 one, so each
dtype is compared with its own rate (`qkv.native.machine` says when a dtype has no native
instructions on this CPU). FLOPs of one n x n product: 2 n^3.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from qkv.native.timing import fastest

__all__ = ["LIMIT_SIDES", "PRODUCT_SECONDS", "affordable_side", "machine_matmul_gflops", "matmul_gflops", "matmul_words"]

# Sides `matmul_gflops` tries when asked for the machine's limit. No single size is the BLAS's
# best on every machine and thread count: here (2 cores, AMX) bf16 peaks at 1024^2 on one thread
# and at 2048^2 on two, while 4096^2 already falls out of cache.
LIMIT_SIDES = (1024, 2048)
# Within a round, a product faster than this runs again until its calls add up to it, so that a
# 1 ms bf16 product gets as many tries as a slow float32 one (`fastest`'s round_seconds).
_ROUND_SECONDS = 0.05

# The longest one product may take where a side is chosen by `affordable_side`. A dtype whose
# products this CPU emulates (bfloat16 on AVX2: about 0.3 GFLOP/s, one 2048^2 product a minute)
# is measured on a smaller product instead; a native dtype's limit sides stay: float32 on two
# AVX2 cores at 30 GFLOP/s does 2048^2 in 0.6 s.
PRODUCT_SECONDS = 1.0
# The first side `affordable_side` times: a tenth of a second where products are emulated.
_PROBE_SIDE = 256

# Side and rounds of the product `machine_matmul_gflops` measures for `qkv.explain`: large
# enough for the BLAS's steady state on a few cores, well under a second in float32; a smaller
# side where one product would take longer than _EXPLAIN_PRODUCT_SECONDS (emulated dtypes).
_EXPLAIN_SIDE = 1024
_EXPLAIN_REPEATS = 5
_EXPLAIN_PRODUCT_SECONDS = 0.2


def matmul_gflops(
    dtype: torch.dtype = torch.float32,
    *,
    side: int | None = None,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """GFLOP/s of a square ``dtype`` matrix multiply, now: 2 side^3 FLOPs over the fastest of
    ``repeats`` rotating rounds (one warm-up; `fastest`).

    ``side=None`` (the default) measures the machine's limit: the best rate over the sides of
    `LIMIT_SIDES`, timed in the same rounds. The product writes into one preallocated output:
    a fresh 8 MB output per product would be paid in page faults, which are not the multiply's
    speed, and a denominator that a busy allocator lowers would flatter what is compared with it.
    """
    sides = LIMIT_SIDES if side is None else (side,)
    if min(sides) < 1:
        raise ValueError(f"side must be >= 1, got {side}")
    gen = torch.Generator().manual_seed(0)
    products = {}
    for n in sides:
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        products[n] = lambda a=a, b=b, out=out: torch.mm(a, b, out=out)
    seconds = fastest({str(n): fn for n, fn in products.items()}, repeats, warmup=1,
                      round_seconds=_ROUND_SECONDS, clock=clock)
    return max(2 * n**3 / seconds[str(n)] / 1e9 for n in sides)


def matmul_words(side: int | None = None) -> str:
    """What `matmul_gflops` measured with this ``side``, for a benchmark's header.

    >>> matmul_words(), matmul_words(256)
    ('best of 1024^2, 2048^2', '256^2')
    """
    sides = LIMIT_SIDES if side is None else (side,)
    return ("best of " if len(sides) > 1 else "") + ", ".join(f"{n}^2" for n in sides)


def affordable_side(dtype: torch.dtype, side: int, seconds: float = PRODUCT_SECONDS) -> int:
    """``side``, or a smaller one (at least 256) whose one ``dtype`` product takes at most
    ``seconds``: from 256 the side doubles while eight times the time of the current side's
    product, timed now, fits (a guess: the rate changes with the side, up for a BLAS's native
    products, down past the cache for emulated ones). Each step times products of at most an
    eighth of ``seconds``: where products are emulated this costs a second or two, not the
    minute of one 2048^2 bf16 product."""
    chosen = min(side, _PROBE_SIDE)
    while chosen < side:
        taken = 2 * chosen**3 / (matmul_gflops(dtype, side=chosen, repeats=1) * 1e9)  # seconds
        if 8 * taken > seconds:
            break
        chosen = min(2 * chosen, side)
    return chosen


@functools.cache
def machine_matmul_gflops(dtype: torch.dtype, threads: int) -> float:
    """The rate of a 1024^2 ``dtype`` product on ``threads`` threads (smaller where one such
    product would take over 0.2 s, `affordable_side`), measured once per process and cached:
    what `qkv.explain(..., measure=True)` reports (benchmarks measure their own)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return matmul_gflops(dtype, side=affordable_side(dtype, _EXPLAIN_SIDE, _EXPLAIN_PRODUCT_SECONDS), repeats=_EXPLAIN_REPEATS)
    finally:
        torch.set_num_threads(previous)
