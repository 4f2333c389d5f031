"""`qkv.attention`: one signature, several paths, chosen in one place (`choose_path`).

Shape legend (DESIGN.md): B batch (any number of leading dims), H query heads, G key/value
heads, L query length, S key length, E q/k head dim, Ev value head dim.

Paths:
- ``fused``: PyTorch's scaled_dot_product_attention, the kernels people run.
- ``math``: the explicit formula, scores and weights materialized in float32 or wider.

`explain` returns the same decision with its reason, the work (FLOPs) and the extra memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from qkv._problem import AttentionProblem, describe_problem, normalize_mask
from qkv.kernels.dense import (
    accumulation_dtype,
    attention_weights_dense,
    dense_lse,
    fused_attention,
    fused_lse_available,
    math_attention,
)
from qkv.masks import Causal, Mask

__all__ = ["Explanation", "attention", "choose_path", "explain"]

Backend = Literal["auto", "fused", "math"]
BACKENDS: tuple[str, ...] = ("auto", "fused", "math")

# PyTorch's CPU flash kernel works on query blocks of 256 rows (64 for short queries) and key
# blocks of 512; one block of scores per thread is its extra memory (aten/src/ATen/native/cpu).
_CPU_FLASH_Q_BLOCK = 256
_CPU_FLASH_KV_BLOCK = 512


@dataclass(frozen=True)
class Plan:
    """What `attention` will run: the path, why, and how the mask reaches it."""

    path: Literal["fused", "math"]
    reason: str
    sdpa_causal: bool = False  # pass is_causal=True to SDPA (top-left, equal to bottom-right when L == S)
    causal_offset: int | None = None  # math path: query i sees keys j <= i + offset


@dataclass(frozen=True)
class Explanation:
    """Which path `qkv.attention` takes for given inputs, why, and what it costs.

    flops counts 2 * (E + Ev) multiply-adds per visited (query, key) pair and head, the
    DESIGN.md rule 4 * B * H * L * S * E when E == Ev. peak_extra_bytes is an estimate of
    the memory the path allocates beyond inputs and output.
    """

    path: str
    reason: str
    shape: str
    mask: str
    flops: int
    visited_fraction: float
    peak_extra_bytes: int

    def __str__(self) -> str:
        return (
            f"path: {self.path}\n"
            f"why: {self.reason}\n"
            f"problem: {self.shape}, mask: {self.mask}\n"
            f"work: {self.flops / 1e9:.3f} GFLOP forward ({self.visited_fraction:.1%} of the score matrix visited)\n"
            f"extra memory: {_format_bytes(self.peak_extra_bytes)} (estimate)"
        )


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")


def choose_path(problem: AttentionProblem, backend: str, return_weights: bool, return_lse: bool) -> Plan:
    """The one place where a path is chosen. Read top to bottom: the first rule that fires wins."""
    _check_backend(backend)
    mask = problem.mask
    causal = mask if isinstance(mask, Causal) else None
    causal_offset = None
    sdpa_causal = False
    if causal is not None:
        causal_offset = causal.offset(problem.L, problem.S)
        # SDPA's is_causal is top-left; it equals ours when the offset is zero.
        sdpa_causal = causal_offset == 0

    if backend == "math":
        return Plan("math", "backend='math' was requested", causal_offset=causal_offset)
    if return_weights and problem.dropout > 0.0:
        if backend == "fused":
            raise ValueError(
                "return_weights=True with dropout > 0 needs the weights that produced the output, "
                "which only backend='math' (or 'auto') can return"
            )
        return Plan("math", "the weights after dropout must be the ones that produced the output", causal_offset=causal_offset)
    if return_lse and problem.dropout > 0.0:
        if backend == "fused":
            raise ValueError("return_lse=True with dropout > 0 is only available with backend='math' (or 'auto')")
        return Plan("math", "the fused kernel returns no log-sum-exp under dropout", causal_offset=causal_offset)
    reason = "backend='fused' was requested" if backend == "fused" else "PyTorch's SDPA applies"
    if sdpa_causal:
        reason += "; causal runs as SDPA is_causal (L == S or top-left alignment), no mask materialized"
    elif causal is not None:
        reason += "; bottom-right causal with L != S is passed as a dense bool mask"
    return Plan("fused", reason, sdpa_causal, causal_offset)


def _dense_mask(problem: AttentionProblem, plan: Plan) -> torch.Tensor | None:
    """The mask as a tensor (N | 1, H | 1, L, S), or None when no tensor is needed."""
    mask = problem.mask
    if mask is None or isinstance(mask, Causal):
        if isinstance(mask, Causal) and plan.path == "fused" and not plan.sdpa_causal:
            return mask.to_dense(problem.L, problem.S, device=problem.q.device)
        return None
    if isinstance(mask, Mask):
        rendered = mask.to_dense(problem.L, problem.S, device=problem.q.device)  # (B | 1, H | 1, L, S)
        normalized = normalize_mask(rendered, problem.q, problem.batch_shape, problem.H, problem.L, problem.S)
        assert isinstance(normalized, torch.Tensor)
        return normalized
    return mask


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention: ``softmax(q k^T * scale + mask) v``.

    Args:
        q: (..., H, L, E) queries.
        k: (..., G, S, E) keys; H must be a multiple of G (grouped-query attention: query
            head h reads key/value head h // (H // G)).
        v: (..., G, S, Ev) values.
        mask: None; a bool tensor broadcastable to (..., H, L, S), True = may attend; a float
            tensor broadcastable to it, added to the scaled scores; or a `qkv.masks` object.
        scale: factor applied to q k^T; default 1 / sqrt(E).
        dropout: probability of dropping an attention weight (applied whenever > 0; modules
            pass 0 in eval mode).
        return_weights: also return the exact probabilities (..., H, L, S) that produced the
            output (after dropout when dropout > 0), in float32 or wider.
        return_lse: also return log sum_j exp(score_ij) (..., H, L), float32 or wider.
        backend: "auto" (default), "fused" or "math"; see `qkv.explain`.

    Returns:
        output (..., H, L, Ev) in q's dtype, or a tuple (output, weights), (output, lse) or
        (output, weights, lse). A query row that may attend to no key gets a zero output row,
        zero weights, lse = -inf and zero gradients.

    Example:
        >>> import torch, qkv
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
        >>> qkv.attention(q, k, v, qkv.masks.causal()).shape
        torch.Size([2, 4, 5, 3])
    """
    problem = describe_problem(q, k, v, mask, scale, dropout)
    plan = choose_path(problem, backend, return_weights, return_lse)
    dense_mask = _dense_mask(problem, plan)
    weights = lse = None
    if plan.path == "math":
        out, weights, lse = math_attention(
            problem.q, problem.k, problem.v, dense_mask, problem.scale,
            causal_offset=plan.causal_offset, dropout=problem.dropout,
        )
    else:
        out, lse = fused_attention(
            problem.q, problem.k, problem.v, dense_mask, problem.scale,
            is_causal=plan.sdpa_causal, dropout=problem.dropout,
            need_lse=return_lse and fused_lse_available(problem.q, problem.v),
        )
        causal_offset = plan.causal_offset if plan.sdpa_causal else None
        if return_weights:
            weights, lse = attention_weights_dense(problem.q, problem.k, dense_mask, problem.scale, causal_offset)
        elif return_lse and lse is None:
            # the kernel gives no lse here (E != Ev, or not on CPU): recompute it by row chunks
            lse = dense_lse(problem.q, problem.k, dense_mask, problem.scale, causal_offset)
    return _pack(problem, out, weights, lse, return_weights, return_lse)


def _pack(
    problem: AttentionProblem,
    out: torch.Tensor,
    weights: torch.Tensor | None,
    lse: torch.Tensor | None,
    return_weights: bool,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Restore the caller's batch dims: (N, H, L, ...) -> (..., H, L, ...)."""
    batch, H, L, S = problem.batch_shape, problem.H, problem.L, problem.S
    result = [out.reshape(*batch, H, L, problem.Ev)]  # (..., H, L, Ev)
    if return_weights:
        assert weights is not None
        result.append(weights.reshape(*batch, H, L, S))  # (..., H, L, S)
    if return_lse:
        assert lse is not None
        result.append(lse.reshape(*batch, H, L))  # (..., H, L)
    return result[0] if len(result) == 1 else tuple(result)


def _visible_pairs(problem: AttentionProblem, plan: Plan) -> int:
    """(query, key) pairs the path computes, per batch row and head."""
    L, S = problem.L, problem.S
    if plan.path == "fused" and plan.sdpa_causal:
        return sum(min(S, max(0, i + 1)) for i in range(L))
    return L * S


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> Explanation:
    """Say which path `qkv.attention` would take for these arguments, why, and its cost.

    Nothing is computed: the inputs are validated exactly as `attention` does.
    """
    problem = describe_problem(q, k, v, mask, scale, dropout)
    plan = choose_path(problem, backend, return_weights, return_lse)
    NH = problem.N * problem.H
    L, S, E, Ev = problem.L, problem.S, problem.E, problem.Ev
    pairs = _visible_pairs(problem, plan)
    flops = 2 * (E + Ev) * pairs * NH
    acc_bytes = torch.empty((), dtype=accumulation_dtype(q.dtype)).element_size()
    if plan.path == "math":
        # scores, exponentials and weights are each (N, H, L, S)
        extra = 3 * NH * L * S * acc_bytes
    else:
        threads = torch.get_num_threads() if q.device.type == "cpu" else 1
        q_block = min(L, _CPU_FLASH_Q_BLOCK)
        kv_block = min(S, _CPU_FLASH_KV_BLOCK)
        extra = threads * (q_block * kv_block + 2 * q_block * Ev) * acc_bytes + NH * L * acc_bytes
        if problem.mask is not None and not plan.sdpa_causal:
            extra += L * S * (q.element_size() if return_lse else 1)
        if return_weights:
            extra += NH * L * S * acc_bytes
    shape = (
        f"B={problem.batch_shape} H={problem.H} G={problem.G} L={L} S={S} E={E} Ev={Ev} "
        f"{str(q.dtype).removeprefix('torch.')} on {q.device}"
    )
    return Explanation(
        path=plan.path,
        reason=plan.reason,
        shape=shape,
        mask=problem.mask_kind,
        flops=flops,
        visited_fraction=pairs / (L * S),
        peak_extra_bytes=int(extra),
    )
