"""When the block engine beats SDPA with the mask rendered dense: a cost model of both.

The engine skips the tiles a structured mask leaves empty, but each call pays for its Python:
planning (kept per mask and size), merges and a loop over its calls, about 0.8 ms before any
arithmetic. SDPA with a dense bool mask does all the arithmetic and reads an L x S mask, with
about 0.6 ms of set-up. So sliding_window(32) over 256 tokens, whose tiles compute 17 % of the
score matrix, ran 1.6x slower on the engine than on SDPA (1.18 ms against 0.75 ms, B=1 H=4
E=32; 2.2x before plans and tiles were kept across calls), and the engine pays off only once
the work it skips outweighs its fixed cost.

Both costs are modelled in milliseconds from four counts: the score pairs P = N*H*L*S, the
multiply-adds W = P * max(E, Ev), the share of the score matrix the engine's tiles compute,
and the query rows N*H*L (the engine merges and rescales per row). The constants were fitted
by least squares to 50 shapes timed through `qkv.attention` with each backend forced: N 1-4,
H 4-32, E 32-128, L = S 256-1,024, sliding windows of 32 and 128 keys, float32, no gradient,
2 threads, on an Intel Xeon, once on its own tier and once with the AVX2 tier forced
(`QKV_CPU_TIER=avx2` with PyTorch's and MKL's kernels held to AVX2 too). The two sets differ
where the arithmetic does: float32 products at 346 and 218 GFLOP/s made SDPA's cost per
multiply-add 1.5x higher on AVX2 and the engine's 1.15x (its per-tile calls are less bound by
arithmetic); the fixed and per-row costs are Python's and alike. A tier without AVX-512 takes
the AVX2 set; AVX-512 and AMX machines (whose float32 products are AVX-512's) the other.

`benchmarks/engine_crossover.py` re-measures those shapes and counts where 'auto' ran the
slower backend: 1 of the 50 on the Xeon's own tier (a tie, 0.03 ms), where sending every one to
the engine lost 7.9 ms in 15 shapes, up to 1.6x; with forward and backward timed, 3 (within
11 %; 0.7 ms against 40 ms in 17 shapes). On the forced AVX2 tier with its own set, none.

It applies where the engine runs PyTorch's flash kernel per tile (float32, float64, and bf16
or fp16 where the fused interval kernel cannot run). The fused bf16 interval kernel beat SDPA
at each of 32 such shapes timed in bf16 (1.08-5.95x), so there the share threshold alone
decides. On a machine much slower or faster than these the arithmetic terms and the fixed
ones scale differently: the model decides only near the crossover, where either choice costs
little.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.native.machine import cpu_features

__all__ = ["MAX_PAIRS", "decides", "dense_ms", "engine_beats_dense", "engine_ms"]

# The model decides only up to this many (query, key) pairs per head. It was fitted on L = S of
# 256 to 1,024; beyond 512 x 512 it mispredicted wide windows, whose tiles are mostly full:
# sliding_window(256, 256) at n = 1,024 (B=1 H=8 E=128, 52 % computed) ran 17.9 ms on the
# engine against 22.3 on SDPA, sliding_window(1200, 1200) at n = 4,096 (H=1) 27.5 against
# 87.9, where the model estimated SDPA faster. Up to 512 x 512 it picked the faster of the two
# in each such case timed (shares 0.52-0.72), and beyond it, in the 50 shapes above, the
# engine was the faster every time: there the share threshold alone decides, as before.
MAX_PAIRS = 512 * 512


def decides(L: int, S: int) -> bool:
    """Whether the model's estimates decide between the engine and SDPA for L x S pairs per head."""
    return L * S <= MAX_PAIRS


@dataclass(frozen=True)
class _Costs:
    """Milliseconds per unit: SDPA with a dense mask (fixed, per million multiply-adds, per
    million score pairs) and the engine (fixed, per million computed multiply-adds, per
    thousand query rows)."""

    dense_fixed: float
    dense_per_mac: float
    dense_per_pair: float
    engine_fixed: float
    engine_per_mac: float
    engine_per_row: float


# fitted on AVX-512 float32 products (an AMX Xeon's own tier), and with the AVX2 tier forced
_WIDE = _Costs(0.66, 0.0120, 0.717, 0.78, 0.0375, 0.276)
_AVX2 = _Costs(0.49, 0.0191, 0.708, 0.52, 0.0427, 0.309)


def _costs(tier: str | None) -> _Costs:
    tier = cpu_features().tier if tier is None else tier
    return _WIDE if tier in ("avx512", "amx") else _AVX2


def dense_ms(N: int, H: int, L: int, S: int, E: int, tier: str | None = None) -> float:
    """Estimated milliseconds of SDPA with an L x S bool mask (E: the larger head size) on
    ``tier`` (default: the tier qkv uses, `qkv.native.machine.cpu_features`)."""
    c = _costs(tier)
    pairs = N * H * L * S / 1e6
    return c.dense_fixed + c.dense_per_mac * pairs * E + c.dense_per_pair * pairs


def engine_ms(N: int, H: int, L: int, S: int, E: int, computed_share: float, tier: str | None = None) -> float:
    """Estimated milliseconds of the block engine computing ``computed_share`` of the score
    matrix with PyTorch's flash kernel per tile."""
    c = _costs(tier)
    pairs = N * H * L * S / 1e6
    return c.engine_fixed + c.engine_per_mac * computed_share * pairs * E + c.engine_per_row * N * H * L / 1e3


def engine_beats_dense(N: int, H: int, L: int, S: int, E: int, computed_share: float, tier: str | None = None) -> bool:
    """Whether the engine's estimate is below SDPA's with a dense mask. Plain arithmetic on
    Python numbers and the tier, so torch.compile traces it as a constant."""
    return engine_ms(N, H, L, S, E, computed_share, tier) < dense_ms(N, H, L, S, E, tier)
