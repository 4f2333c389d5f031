"""When the block engine beats SDPA with the mask rendered dense: a cost model of both.

The engine skips the tiles a structured mask leaves empty, but each call pays for planning,
tiles, merges and a Python loop over its calls: about 1.5 ms before any arithmetic. SDPA with a
dense bool mask does all the arithmetic and reads an L x S mask, with about 0.6 ms of set-up.
So sliding_window(32) over 256 tokens, whose tiles compute 17 % of the score matrix, ran 2.2x
slower on the engine than on SDPA (1.73 ms against 0.78 ms, B=1 H=4 E=32), and the engine pays
off only once the work it skips outweighs its fixed cost.

Both costs are modelled in milliseconds from four counts: the score pairs P = N*H*L*S, the
multiply-adds W = P * max(E, Ev), the share of the score matrix the engine's tiles compute,
and the query rows N*H*L (the engine merges and rescales per row). The constants were fitted
by least squares (non-negative) to 50 shapes timed through `qkv.attention` with each backend
forced: N 1-4, H 4-32, E 32-128, L = S 256-1,024, sliding windows of 32 and 128 keys, float32,
no gradient, 2 threads, on an Intel Xeon (AMX tier). `benchmarks/engine_crossover.py`
re-measures those shapes and counts where 'auto' ran the slower backend: none of the 50 on
that machine; with forward and backward, 4 (each within 7 % of the other backend); on the
AVX2 tier (forced), 4 (within 22 %, 2 ms lost over the 50 shapes, where sending every one to
the engine lost 9 ms, up to 2.1x).

It applies where the engine runs PyTorch's flash kernel per tile (float32, float64, and bf16
or fp16 where the fused interval kernel cannot run). The fused bf16 interval kernel's fixed
cost is about a third of it, and it beat SDPA at every one of those shapes, so there the
share threshold alone decides. Times on a slower or wider machine scale the arithmetic terms
and the fixed ones differently: the model decides only near the crossover, where either
choice costs little.
"""

from __future__ import annotations

__all__ = ["dense_ms", "engine_beats_dense", "engine_ms"]

# milliseconds: fixed, per million multiply-adds, per million score pairs (SDPA + dense mask)
_DENSE_FIXED, _DENSE_PER_MAC, _DENSE_PER_PAIR = 0.64, 0.0147, 0.616
# milliseconds: fixed, per million computed multiply-adds, per thousand query rows (engine)
_ENGINE_FIXED, _ENGINE_PER_MAC, _ENGINE_PER_ROW = 1.55, 0.0392, 0.264


def dense_ms(N: int, H: int, L: int, S: int, E: int) -> float:
    """Estimated milliseconds of SDPA with an L x S bool mask (E: the larger head size)."""
    pairs = N * H * L * S / 1e6
    return _DENSE_FIXED + _DENSE_PER_MAC * pairs * E + _DENSE_PER_PAIR * pairs


def engine_ms(N: int, H: int, L: int, S: int, E: int, computed_share: float) -> float:
    """Estimated milliseconds of the block engine computing ``computed_share`` of the score
    matrix with PyTorch's flash kernel per tile."""
    pairs = N * H * L * S / 1e6
    return _ENGINE_FIXED + _ENGINE_PER_MAC * computed_share * pairs * E + _ENGINE_PER_ROW * N * H * L / 1e3


def engine_beats_dense(N: int, H: int, L: int, S: int, E: int, computed_share: float) -> bool:
    """Whether the engine's estimate is below SDPA's with a dense mask. Plain arithmetic on
    Python numbers, so torch.compile traces it as a constant."""
    return engine_ms(N, H, L, S, E, computed_share) < dense_ms(N, H, L, S, E)
