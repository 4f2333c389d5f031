"""The overflow refusal of `qkv.attention`'s input check, on values the host can read.

`qkv.attention.problem` runs it eagerly before any path; the block engine's forward operator
(`qkv.backends.blocks.ops`) runs the same code when a compiled graph runs, on the values at
hand, so compiled code refuses with eager's error, message and values included, and no graph
code computes row norms for it. The rule, in `refuse_overflow`:

|scale * q_i . k_j| <= max(1, |scale|) * E * max|q| * max|k| (one cheap reduction per tensor,
which also tells whether it is finite); only when that bound is too large is the tight one,
max_i ||q_i|| * max_j ||k_j||, computed. Scores, then (capped by a softcap) plus the largest
value a bias adds and the largest value of a float mask, must stay below half the largest float
of the accumulation dtype (3.4e38 for float32, 1.8e308 for float64) or exp and the softmax
would see inf and return NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from qkv.backends.softmax import accumulation_dtype
from qkv.native import magnitude

__all__ = ["compact", "in_memory_order", "largest_magnitude", "largest_magnitudes", "memory_order", "refuse_overflow"]


def compact(x: torch.Tensor) -> torch.Tensor:
    """x without its broadcast axes (stride 0, from expand): the same values, read once."""
    for dim in range(x.ndim):
        if x.stride(dim) == 0 and x.shape[dim] > 1:
            x = x.narrow(dim, 0, 1)
    return x


def memory_order(x: torch.Tensor) -> list[int]:
    """x's dims in the order its values lie in memory: largest stride first (a stable sort:
    equal strides keep their order).

    >>> memory_order(torch.ones(2, 3, 4).transpose(0, 1))
    [1, 0, 2]
    """
    strides = x.stride()
    return sorted(range(x.ndim), key=lambda d: -strides[d])


def in_memory_order(x: torch.Tensor) -> torch.Tensor:
    """x's dims permuted into `memory_order`: the same values, for a reduction over all of
    them. Heads taken from a projection, (N, L, H, E) seen as (N, H, L, E), become one
    contiguous block again: torch.aminmax no longer copies them first (2.5x faster at N=32,
    L=128, H=12, E=32), and the compiled scan reads long rows instead of rows of E values.

    >>> in_memory_order(torch.ones(2, 3, 4).transpose(0, 1)).is_contiguous()
    True
    """
    return x.permute(memory_order(x))


def largest_magnitude(x: torch.Tensor) -> float:
    """max |x_i| (0 for an empty x; inf when an entry is infinite or NaN), one pass in x's dtype."""
    if x.numel() == 0:
        return 0.0
    with torch.no_grad():
        low, high = (float(t) for t in torch.aminmax(x))
    if not (math.isfinite(low) and math.isfinite(high)):
        return math.inf
    return max(-low, high)


def largest_magnitudes(tensors: Sequence[torch.Tensor]) -> list[float]:
    """`largest_magnitude` of each tensor, its broadcast axes read once; large float32, bfloat16
    and float16 ones by the compiled scan, all in one call (`qkv.native.magnitude`: the same
    answer as torch.aminmax, at the memory read rate). No float32 / float64 copy of
    low-precision inputs (that copy used to cost as much as the attention itself for bf16
    inputs of the block engine)."""
    compacted = [in_memory_order(compact(x)) for x in tensors]
    scanned = magnitude.largest_magnitudes(compacted)
    return [largest_magnitude(x) if m is None else m for x, m in zip(compacted, scanned, strict=True)]


def _largest_row_norm(x: torch.Tensor) -> float:
    """max_i ||x_i|| over the last axis, in float64 (finite entries assumed)."""
    with torch.no_grad():
        return float(torch.linalg.vector_norm(compact(x), dim=-1, dtype=torch.float64).amax())


def refuse_overflow(
    q: torch.Tensor,
    k: torch.Tensor,
    magnitudes: Sequence[float],
    scale: float,
    softcap: float | None,
    bias_top: float,
    mask_top: float,
) -> bool:
    """Raise ValueError when the scores can overflow (module docstring); return whether q, k or
    v is not finite (the NaN rule then applies). ``magnitudes``: max |q|, max |k|, max |v|
    (inf when not finite), from `largest_magnitudes` or bounds kept by a KV cache; q and k are
    read only when the loose bound is too large. Without finite q and k nothing is refused:
    rows that read a non-finite entry become NaN instead."""
    q_max, k_max, v_max = magnitudes
    if not (math.isfinite(q_max) and math.isfinite(k_max)):
        return True
    acc = accumulation_dtype(q.dtype)
    limit = torch.finfo(acc).max / 2

    def reach(scores: float) -> float:  # the largest logit, from a bound on the scaled scores
        capped = scores if softcap is None else min(scores, softcap)
        return max(scores, capped + bias_top + mask_top)

    factor = max(1.0, abs(scale))
    loose = factor * q.shape[-1] * q_max * k_max
    if reach(loose) > limit:
        q_norm, k_norm = _largest_row_norm(q), _largest_row_norm(k)
        bound = factor * q_norm * k_norm
        if reach(bound) > limit:
            terms = "" if softcap is None else f", softcap {softcap:.3g}"
            terms += f", largest bias value {bias_top:.3g}" if bias_top else ""
            raise ValueError(
                f"the scaled scores can reach {reach(bound):.3g} (max(1, |scale|) = {factor:.3g}, largest "
                f"|q_i| = {q_norm:.3g}, largest |k_j| = {k_norm:.3g}, largest mask value {mask_top:.3g}{terms}), "
                f"beyond half the largest {str(acc).removeprefix('torch.')} ({limit:.3g}): they would overflow "
                "to inf and the softmax would return NaN; use float64 inputs or smaller q, k, scale or biases"
            )
    return not math.isfinite(v_max)
