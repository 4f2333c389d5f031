"""`qkv.attention`: one signature, several paths, chosen in one place (`choose_path`).

Shape legend (DESIGN.md): B batch (any number of leading dims), H query heads, G key/value
heads, L query length, S key length, E q/k head dim, Ev value head dim.

Paths:
- ``fused``: PyTorch's scaled_dot_product_attention, the kernels people run.
- ``math``: the explicit formula, scores and weights materialized in float32 or wider.
- ``blocks``: the CPU tile engine (`qkv.kernels.blocks`): only the tiles a structured mask
  leaves visible are computed, forward and backward.
- ``flex``: PyTorch's FlexAttention with a BlockMask built from the mask's layout
  (`qkv.kernels.flex`), for structured masks on CUDA.

`explain` returns the same decision with its reason, the work (FLOPs) and the extra memory;
`attention_weights` recomputes the probabilities of chosen heads and rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from qkv._nan_rule import affected_rows, finite_problem, poison
from qkv._problem import AttentionProblem, autocast_dtype, compact, describe_problem, normalize_mask
from qkv.bias import Bias
from qkv.kernels.blocks import flash_kernel_available, tile_attention, tile_lse, tile_weights
from qkv.kernels.dense import (
    attention_weights_dense,
    dense_lse,
    fused_attention,
    fused_lse_available,
    math_attention,
)
from qkv.kernels.flex import FLEX_BLOCK, flex_attention_layout, flex_available, flex_suits
from qkv.kernels.machine import emulation_note, matmul_gflops
from qkv.kernels.scored import closes_over_grad, scored_tile_attention
from qkv.kernels.scores import ScoreMod
from qkv.kernels.softmax import accumulation_dtype
from qkv.kernels.tile_plan import TileConfig, TilePlan, plan_intervals, plan_layout
from qkv.masks import FULL, POINTWISE_BUDGET, BlockLayout, Causal, Mask

__all__ = ["Explanation", "attention", "attention_weights", "choose_path", "explain"]

Backend = Literal["auto", "fused", "math", "blocks", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "fused", "math", "blocks", "flex")
Path = Literal["fused", "math", "blocks", "flex"]

# The CPU tile engine's tile sizes (see TileConfig for why).
TILES = TileConfig()
# "auto" sends a structured mask to the tile engine / FlexAttention when they compute at
# most this fraction of the score matrix: the engine's tiles run at about 60-80 % of the
# dense kernel's rate per FLOP (benchmarks/sparse.py), and SDPA with a dense mask pays for
# building and reading the L x S mask on top.
_SPARSE_MAX_VISITED = 0.6
# ... and when the problem has at least this many (query, key) pairs per head: below it the
# few microseconds of SDPA beat planning and launching tiles.
_SPARSE_MIN_PAIRS = 256 * 256

# 'auto' sends a float32 problem that needs gradients to the math path when its float mask's
# finite values span more than this: PyTorch's CPU flash backward then misses DESIGN.md's
# tolerance rule (3x the naive error plus 1e-6). Measured (L = S = 128..1024, E = 64): ALiBi-like
# ramps spanning 5e3..3e4 gave 1.2x..3.4x the allowed error, random spreads of 1e4 1.4x; spans up
# to 2e3 stayed below 0.9x, and two-valued padding masks (0 / -1e4, 0 / finfo.min) below 0.3x but
# are routed too, for simplicity. bfloat16 / float16 stayed below 0.7x everywhere.
_FLASH_GRAD_MAX_MASK_SPAN = 1e3

# PyTorch's CPU flash kernel works on query blocks of 256 rows (64 for short queries) and key
# blocks of 512; one block of scores per thread is its extra memory (aten/src/ATen/native/cpu).
_CPU_FLASH_Q_BLOCK = 256
_CPU_FLASH_KV_BLOCK = 512


@dataclass(frozen=True)
class Plan:
    """What `attention` will run: the path, why, and how the mask reaches it."""

    path: Path
    reason: str
    sdpa_causal: bool = False  # pass is_causal=True to SDPA (top-left, equal to bottom-right when L == S)
    causal_offset: int | None = None  # math path: query i sees keys j <= i + offset
    layout: BlockLayout | None = None  # blocks / flex: the mask's tiles
    tiles: TilePlan | None = None  # blocks: the kernel calls that cover the non-empty tiles
    # blocks / flex: layout and tiles are found when attention runs (a predicate too large to
    # evaluate for a decision or an explanation); layout and tiles are None until then
    deferred: bool = False


@dataclass(frozen=True)
class Explanation:
    """Which path `qkv.attention` takes for given inputs, why, and what it costs.

    flops counts 2 * (E + Ev) FLOPs per visited (query, key) pair and head (E multiply-adds
    for the score and Ev for the output, two FLOPs each), the DESIGN.md rule
    4 * B * H * L * S * E when E == Ev. peak_extra_bytes is an estimate of the memory the
    path allocates beyond inputs and output.
    """

    path: str
    reason: str
    shape: str
    mask: str
    flops: int
    visited_fraction: float
    peak_extra_bytes: int
    blocks_visited: float | None = None  # blocks / flex: fraction of tiles not skipped
    tiles: str | None = None  # blocks / flex: tile size and counts
    scores: str = ""  # the score terms beyond scale * q.k (softcap, bias, score_mod), '' for none
    score_flops: int = 0  # their operations on the visited pairs, not included in flops
    # the mask's tiles were not evaluated (Plan.deferred): flops, the visited fraction and
    # score_flops count every pair, an upper bound
    upper_bound: bool = False
    notes: tuple[str, ...] = ()  # warnings about this machine (a dtype without native products)
    # (dtype name, GFLOP/s) of this machine's matrix multiply, measured when explain(measure=True)
    matmul_rates: tuple[tuple[str, float], ...] = ()

    def __str__(self) -> str:
        lines = [
            f"path: {self.path}",
            f"why: {self.reason}",
            f"problem: {self.shape}, mask: {self.mask}",
            f"work: {self.flops / 1e9:.3f} GFLOP forward ({self.visited_fraction:.1%} of the score matrix visited)"
            if not self.upper_bound
            else f"work: at most {self.flops / 1e9:.3f} GFLOP forward (the mask's tiles are not evaluated here)",
        ]
        if self.scores:
            lines.append(f"scores: {self.scores}, {self.score_flops / 1e9:.3f} GFLOP on the visited pairs")
        if self.tiles is not None:
            lines.append(f"tiles: {self.tiles}")
        lines.append(f"extra memory: {_format_bytes(self.peak_extra_bytes)} (estimate)")
        lines += [f"note: {note}" for note in self.notes]
        if self.matmul_rates:
            rates = ", ".join(f"{name} {rate:.0f}" for name, rate in self.matmul_rates)
            name, rate = self.matmul_rates[-1]
            lines.append(
                f"machine: matmul {rates} GFLOP/s (measured, {torch.get_num_threads()} threads); "
                f"this work takes {'at most ' if self.upper_bound else ''}{self.flops / rate / 1e6:.2f} ms "
                f"at the {name} matmul rate"
            )
        return "\n".join(lines)


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

    terms = problem.terms
    scored = terms.softcap is not None or terms.score_mod is not None  # beyond an additive bias
    if backend == "math":
        return Plan("math", "backend='math' was requested", causal_offset=causal_offset)
    if backend in ("blocks", "flex"):
        return _sparse_plan(problem, backend, f"backend={backend!r} was requested")
    if scored and backend == "fused":
        raise ValueError(
            "backend='fused' (PyTorch's SDPA) takes no softcap or score_mod; use 'auto', 'math' or 'blocks'"
        )
    if backend == "auto" and terms.active and problem.dropout == 0.0:
        engine = _scored_engine(problem)
        if engine is not None:
            return engine
    if scored:
        return Plan("math", f"SDPA cannot apply {terms.describe()}; the explicit formula can", causal_offset=causal_offset)
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
    if backend == "auto" and _wide_float_mask_with_grad(problem):
        return Plan(
            "math",
            f"the float mask's values span more than {_FLASH_GRAD_MAX_MASK_SPAN:g} and gradients are needed: "
            "PyTorch's CPU flash backward is less accurate than the tolerance rule allows there",
        )
    if backend == "auto" and isinstance(mask, Mask) and not sdpa_causal and problem.dropout == 0.0:
        sparse = _sparse_if_it_wins(problem)
        if sparse is not None:
            return sparse
    reason = "backend='fused' was requested" if backend == "fused" else "PyTorch's SDPA applies"
    if terms.bias is not None:
        # the mask joins the rendered bias: SDPA gets one float tensor
        sdpa_causal = False
        masked = "" if mask is None else f" with {_mask_name(mask)} as -inf"
        reason += f"; {terms.bias.describe()} is passed as a dense float mask{masked}"
    elif sdpa_causal:
        reason += "; causal runs as SDPA is_causal (L == S or top-left alignment), no mask materialized"
    elif causal is not None and causal_offset is not None and causal_offset >= problem.S - 1:
        reason += "; the causal mask hides no key here (every query sees the whole cache), so none is passed"
    elif causal is not None:
        reason += "; bottom-right causal with L != S is passed as a dense bool mask"
    elif isinstance(mask, Mask):
        reason += f"; {mask.describe()} is passed as a dense bool mask"
    return Plan("fused", reason, sdpa_causal, causal_offset)


def _mask_name(mask: torch.Tensor | Mask) -> str:
    if isinstance(mask, Mask):
        return mask.describe()
    return f"a {str(mask.dtype).removeprefix('torch.')} tensor mask"
def _wide_float_mask_with_grad(problem: AttentionProblem) -> bool:
    """A float32 problem on CPU that needs gradients, with a float mask spanning a wide range."""
    mask = problem.mask
    if not (isinstance(mask, torch.Tensor) and mask.is_floating_point()):
        return False
    needs_grad = _needs_grad(problem) or (torch.is_grad_enabled() and mask.requires_grad)
    if problem.q.dtype != torch.float32 or problem.q.device.type != "cpu" or not needs_grad:
        return False
    with torch.no_grad():
        values = compact(mask)
        finite = values.masked_fill(torch.isinf(values), float("nan"))
        span = float(finite.nan_to_num(nan=float("-inf")).amax()) - float(finite.nan_to_num(nan=float("inf")).amin())
    return span > _FLASH_GRAD_MAX_MASK_SPAN


def _too_large_to_evaluate(problem: AttentionProblem) -> bool:
    """Whether the mask's layout would evaluate more than `POINTWISE_BUDGET` points one by one
    (a large `predicate`): then no decision and no explanation waits for it."""
    mask = problem.mask
    return isinstance(mask, Mask) and mask.evaluated_points(problem.L, problem.S) > POINTWISE_BUDGET


def _deferred_reason(problem: AttentionProblem, engine: str) -> str:
    mask = problem.mask
    assert isinstance(mask, Mask)
    points = mask.evaluated_points(problem.L, problem.S)
    return (
        f"{mask.describe()} is evaluated point by point and has {points:,} points, more than "
        f"{POINTWISE_BUDGET:,}: it is neither rendered as a dense mask nor evaluated to choose a path; "
        f"{engine} finds its tiles when attention runs (one block row at a time) and skips the empty ones"
    )


def _completed(problem: AttentionProblem, plan: Plan) -> Plan:
    """A deferred plan with its layout and tiles, found now (attention is about to run)."""
    if not plan.deferred:
        return plan
    if plan.path == "flex":
        return replace(plan, layout=_layout(problem, FLEX_BLOCK, FLEX_BLOCK), deferred=False)
    layout = _layout(problem, TILES.block_q, TILES.block_k)
    return replace(plan, layout=layout, tiles=_tile_plan(problem, TILES, layout), deferred=False)


def _layout(problem: AttentionProblem, block_q: int, block_k: int) -> BlockLayout:
    """The mask's tiles; no mask is one FULL tile grid."""
    mask = problem.mask
    if isinstance(mask, Mask):
        return mask.layout(problem.L, problem.S, block_q, block_k, device=problem.q.device)
    n_q, n_k = -(-problem.L // block_q), -(-problem.S // block_k)
    states = torch.full((1, 1, n_q, n_k), FULL, dtype=torch.uint8)
    return BlockLayout(states, problem.L, problem.S, block_q, block_k, name="no mask")


def _sparse_plan(
    problem: AttentionProblem, path: Literal["blocks", "flex"], reason: str, layout: BlockLayout | None = None
) -> Plan:
    """Plan for the tile engine (CPU) or FlexAttention; raises when they cannot take the problem.
    ``layout``: the mask's tiles when the caller already computed them at this path's tile size."""
    mask = problem.mask
    if isinstance(mask, torch.Tensor):
        raise ValueError(
            f"backend={path!r} takes a qkv.masks object or None, got a {mask.dtype} tensor mask; "
            "wrap a bool tensor with qkv.masks.dense(tensor)"
        )
    if problem.dropout > 0.0:
        raise ValueError(f"backend={path!r} has no dropout (got dropout={problem.dropout}); use 'fused' or 'math'")
    terms = problem.terms
    if terms.score_mod is not None and _needs_grad(problem) and closes_over_grad(terms.score_mod):
        raise ValueError(
            f"backend={path!r} differentiates q, k, v and the qkv.bias tensors only, and this score_mod "
            "reads tensors that require grad; use backend='math', or pass them as a qkv.bias"
        )
    device = problem.q.device
    if path == "blocks":
        if device.type != "cpu":
            raise ValueError(f"backend='blocks' is the CPU tile engine, the inputs are on {device}; use 'flex' or 'auto'")
        if not flash_kernel_available():
            raise ValueError("backend='blocks' needs PyTorch's CPU flash-attention kernel (PyTorch >= 2.3)")
        if _too_large_to_evaluate(problem):
            return Plan("blocks", f"{reason}; {_deferred_reason(problem, 'the CPU tile engine')}", deferred=True)
        layout = _layout(problem, TILES.block_q, TILES.block_k)
        return Plan("blocks", reason, layout=layout, tiles=_tile_plan(problem, TILES, layout))
    if not flex_available():
        raise ValueError("backend='flex' needs PyTorch's FlexAttention (PyTorch >= 2.5)")
    if device.type == "cpu" and _needs_grad(problem):
        raise ValueError("FlexAttention has no backward pass on CPU; use backend='blocks' (or 'auto') for gradients")
    if layout is None and _too_large_to_evaluate(problem):
        return Plan("flex", f"{reason}; {_deferred_reason(problem, 'FlexAttention')}", deferred=True)
    return Plan("flex", reason, layout=layout if layout is not None else _layout(problem, FLEX_BLOCK, FLEX_BLOCK))


def _tile_plan(problem: AttentionProblem, config: TileConfig, layout: BlockLayout) -> TilePlan:
    """The tile engine's calls: from exact per-query key intervals when the mask has them,
    from the block layout otherwise."""
    mask = problem.mask
    L, S, device = problem.L, problem.S, problem.q.device
    D, itemsize = max(problem.E, problem.Ev), problem.q.element_size()
    if mask is None:
        intervals = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1, dtype=torch.long))
    else:
        assert isinstance(mask, Mask)
        intervals = mask.row_intervals(L, S, device)
    # without a backward pass to come, calls can be larger (fewer kernel launches)
    need_grad = _needs_grad(problem)
    if intervals is not None:
        return plan_intervals(*intervals, L, S, problem.N, problem.H, D, itemsize, config, need_grad, _mask_heads(problem))
    return plan_layout(layout, problem.N, problem.H, D, itemsize, config, _mask_heads(problem), need_grad)


def _needs_grad(problem: AttentionProblem) -> bool:
    """Whether autograd will ask for a backward pass through this call."""
    inputs = (problem.q, problem.k, problem.v, *problem.terms.tensors())
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def _mask_heads(problem: AttentionProblem) -> int:
    """Heads the mask's tiles carry: 1 unless the mask varies over heads. With score terms the
    tiles carry every head, and the engine's own kernel holds scores and probabilities too."""
    terms = problem.terms
    if terms.softcap is not None or terms.score_mod is not None:
        return 3 * problem.H
    if terms.bias is not None:
        return problem.H
    mask = problem.mask
    return mask.heads if isinstance(mask, Mask) and mask.heads else 1


def _scored_engine(problem: AttentionProblem) -> Plan | None:
    """'auto' with score terms on CPU: the tile engine whenever it can take the problem and it
    is large enough. Its alternatives materialize L x S tensors: the math path its scores and
    weights, SDPA a rendered bias (float mask)."""
    terms = problem.terms
    mask = problem.mask
    if isinstance(mask, torch.Tensor) or problem.L * problem.S < _SPARSE_MIN_PAIRS:
        return None
    if terms.score_mod is not None and _needs_grad(problem) and closes_over_grad(terms.score_mod):
        return None
    device = problem.q.device
    if device.type == "cuda" and flex_available() and flex_suits(problem.q.dtype, (problem.E, problem.Ev)):
        what = "no mask" if mask is None else mask.describe()
        return _sparse_plan(problem, "flex", f"{terms.describe()} with {what}: FlexAttention applies them as its score_mod")
    if device.type != "cpu" or not flash_kernel_available():
        return None
    if _too_large_to_evaluate(problem):
        return Plan("blocks", f"{terms.describe()}: {_deferred_reason(problem, 'the CPU tile engine')}", deferred=True)
    layout = _layout(problem, TILES.block_q, TILES.block_k)
    tiles = _tile_plan(problem, TILES, layout)
    visited = tiles.computed_pairs() / (problem.N * problem.L * problem.S)
    what = "no mask" if mask is None else mask.describe()
    reason = (
        f"{terms.describe()} with {what}: the CPU tile engine computes {visited:.1%} of the score matrix "
        "with the terms applied tile by tile, never an L x S tensor"
    )
    return Plan("blocks", reason, layout=layout, tiles=tiles)


def _sparse_if_it_wins(problem: AttentionProblem) -> Plan | None:
    """'auto' for a structured mask: the tile engine (CPU) or FlexAttention (CUDA), when they pay off."""
    L, S = problem.L, problem.S
    if L * S < _SPARSE_MIN_PAIRS:
        return None
    device = problem.q.device
    if device.type == "cpu" and flash_kernel_available():
        path: Literal["blocks", "flex"] = "blocks"
        block_q, block_k = TILES.block_q, TILES.block_k
    elif device.type == "cuda" and flex_available() and flex_suits(problem.q.dtype, (problem.E, problem.Ev)):
        path, block_q, block_k = "flex", FLEX_BLOCK, FLEX_BLOCK
    else:
        return None
    if _too_large_to_evaluate(problem):
        engine = "the CPU tile engine" if path == "blocks" else "FlexAttention with qkv's BlockMask"
        return Plan(path, _deferred_reason(problem, engine), deferred=True)
    layout = _layout(problem, block_q, block_k)
    if path == "blocks":
        tiles = _tile_plan(problem, TILES, layout)
        visited = tiles.computed_pairs() / (problem.N * L * S)
    else:
        visited = layout.visited_pairs() / (L * S)
    if visited > _SPARSE_MAX_VISITED:
        return None
    assert isinstance(problem.mask, Mask)
    engine = "the CPU tile engine" if path == "blocks" else "FlexAttention with qkv's BlockMask"
    reason = (
        f"{problem.mask.describe()} leaves {layout.visited_block_fraction:.1%} of the "
        f"{layout.block_q}x{layout.block_k} tiles non-empty; {engine} computes {visited:.1%} "
        "of the score matrix and skips the rest"
    )
    if path == "blocks":
        return Plan("blocks", reason, layout=layout, tiles=tiles)
    return _sparse_plan(problem, path, reason, layout)


def _dense_mask(problem: AttentionProblem, plan: Plan) -> torch.Tensor | None:
    """The mask as a tensor (N | 1, H | 1, L, S), or None when no tensor is needed. On the
    fused path an additive bias joins it: a float tensor, -inf where the mask hides a pair."""
    mask = _plain_dense_mask(problem, plan)
    bias = problem.terms.bias
    if bias is None or plan.path != "fused":
        return mask
    rendered = _render_bias(problem)  # (N | 1, H | 1, L, S)
    if mask is None:
        return rendered
    if mask.dtype == torch.bool:
        return rendered.masked_fill(~mask, float("-inf"))
    return rendered + mask.to(rendered.dtype)


def _render_bias(problem: AttentionProblem) -> torch.Tensor:
    """The bound bias as a float tensor (N | 1, H | 1, L, S) in the accumulation dtype, differentiable."""
    terms = problem.terms
    bias = terms.bias
    assert bias is not None
    device = problem.q.device
    n = problem.N if terms.batch_varies else 1
    heads = problem.H if bias.heads is not None else 1
    b = torch.arange(n, device=device).view(n, 1, 1, 1)  # (N | 1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)  # (1, H, 1, 1)
    i = torch.arange(problem.L, device=device).view(1, 1, -1, 1)  # (1, 1, L, 1)
    j = torch.arange(problem.S, device=device).view(1, 1, 1, -1)  # (1, 1, 1, S)
    values = bias.terms(b, h, i, j, terms.q_pos(b, i)).to(accumulation_dtype(problem.q.dtype))
    return torch.broadcast_to(values, (n, heads, problem.L, problem.S))


def _plain_dense_mask(problem: AttentionProblem, plan: Plan) -> torch.Tensor | None:
    """The mask alone as a tensor (N | 1, H | 1, L, S), or None when no tensor is needed."""
    mask = problem.mask
    if mask is None or isinstance(mask, Causal):
        if isinstance(mask, Causal) and plan.path == "fused" and not plan.sdpa_causal:
            if mask.offset(problem.L, problem.S) >= problem.S - 1:
                # every query sees every key (a one-token decoding step over its cache):
                # the mask hides nothing, so none is built
                return None
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
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention: ``softmax(q k^T * scale + mask) v``, with score terms.

    Per (b, h, i, j) the score is s = scale * q_i . k_j; then softcap * tanh(s / softcap)
    when ``softcap`` is set; then + bias[b, h, i, j]; then score_mod(s, b, h, i, j); then the
    mask removes pairs and each row is softmaxed (DESIGN.md).

    Args:
        q: (..., H, L, E) queries.
        k: (..., G, S, E) keys; H must be a multiple of G (grouped-query attention: query
            head h reads key/value head h // (H // G)).
        v: (..., G, S, Ev) values.
        mask: None; a bool tensor broadcastable to (..., H, L, S), True = may attend; a float
            tensor broadcastable to it, added to the scaled scores; or a `qkv.masks` object.
        bias: a `qkv.bias` object (``alibi()``, ``relative(table)``, ``dense(t)``, or a sum of
            them), or a float tensor broadcastable to (..., H, L, S) meaning ``dense(tensor)``.
            Its tensors may require grad.
        softcap: cap the scores smoothly at +-softcap (Gemma 2 uses 50 for attention).
        score_mod: a vectorized fn(score, b, h, q_idx, kv_idx) -> score on broadcasting
            tensors (FlexAttention's contract; b is the flattened batch row, h the query head).
        scale: factor applied to q k^T, any finite real number (a NumPy scalar or a
            one-element tensor without gradient too); default 1 / sqrt(E).
        dropout: probability of dropping an attention weight (applied whenever > 0; modules
            pass 0 in eval mode).
        return_weights: also return the exact probabilities (..., H, L, S) that produced the
            output (after dropout when dropout > 0), in float32 or wider.
        return_lse: also return log sum_j exp(score_ij) (..., H, L), float32 or wider.
        backend: "auto" (default: the first rule of `choose_path` that fires), "fused"
            (SDPA), "math" (the explicit formula), "blocks" (the CPU tile engine, `qkv.masks`
            objects only) or "flex" (FlexAttention with qkv's BlockMask); see `qkv.explain`.

    Returns:
        output (..., H, L, Ev) in q's dtype, or a tuple (output, weights), (output, lse) or
        (output, weights, lse). A query row that may attend to no key gets a zero output row,
        zero weights, lse = -inf and zero gradients. lse is differentiable on every path
        (d lse_i / d s_ij = p_ij), as are the weights on the paths that return them.

    Numerics, the same on every path:
        - A float mask is added in float32 or wider (float64 for float64 inputs), whatever
          the inputs' dtype: it is never rounded to float16 / bfloat16. It holds finite
          values or -inf (hide); NaN or +inf in it is refused with a ValueError.
        - Non-finite inputs: a NaN or an infinity in q, k or v makes NaN the output, weights
          and lse of exactly the query rows that read it (a row whose query holds one, and
          every row that may see a key whose k or v holds one); every other row is exact,
          and the NaN rows pass no gradient (`qkv._nan_rule`).
        - Overflow: finite inputs whose scaled scores could leave the accumulation dtype
          (max(1, |scale|) * max_i |q_i| * max_j |k_j| plus the largest mask value above half
          of float32's largest value 3.4e38, of float64's for float64 inputs) are refused
          with a ValueError naming the bound; float64 inputs hold scores up to 1e308.
        - Under torch.compile the data-dependent checks of these three rules are skipped.

    Example:
        >>> import torch, qkv
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
        >>> qkv.attention(q, k, v, qkv.masks.causal()).shape
        torch.Size([2, 4, 5, 3])
    """
    low = autocast_dtype(q)
    if low is not None:
        q, k, v = _cast_for_autocast(low, q, k, v)
        with torch.autocast(q.device.type, enabled=False):
            return attention(
                q, k, v, mask, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale, dropout=dropout,
                return_weights=return_weights, return_lse=return_lse, backend=backend,
            )
    problem = _describe(q, k, v, mask, scale, dropout, bias, softcap, score_mod)
    plan = choose_path(problem, backend, return_weights, return_lse)
    if not problem.nonfinite:
        out, weights, lse = _run(problem, plan, return_weights, return_lse)
        return _pack(problem, out, weights, lse, return_weights, return_lse)
    # the NaN rule (qkv._nan_rule): compute on finite inputs, then NaN the rows that read a bad entry
    rows = affected_rows(problem)  # (N, H, L)
    out, weights, lse = _run(finite_problem(problem), plan, return_weights, return_lse)
    out, weights, lse = poison(out, rows, False), poison(weights, rows, False), poison(lse, rows, True)
    assert out is not None
    return _pack(problem, out, weights, lse, return_weights, return_lse)


def _run(
    problem: AttentionProblem, plan: Plan, return_weights: bool, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run ``plan``: (output (N, H, L, Ev), weights (N, H, L, S) or None, lse (N, H, L) or None)."""
    if plan.path in ("blocks", "flex"):
        return _sparse_attention(problem, plan, return_weights, return_lse)
    dense_mask = _dense_mask(problem, plan)
    weights = lse = None
    if plan.path == "math":
        return math_attention(
            problem.q, problem.k, problem.v, dense_mask, problem.scale,
            causal_offset=plan.causal_offset, dropout=problem.dropout, terms=problem.terms,
        )
    # a learned float mask gets its gradient from SDPA and a differentiable lse, not the flash kernel
    learned_mask = isinstance(dense_mask, torch.Tensor) and dense_mask.requires_grad
    out, lse = fused_attention(
        problem.q, problem.k, problem.v, dense_mask, problem.scale,
        is_causal=plan.sdpa_causal, dropout=problem.dropout,
        need_lse=return_lse and not return_weights and not learned_mask and fused_lse_available(problem.q),
    )
    causal_offset = plan.causal_offset if plan.sdpa_causal else None
    if return_weights:
        weights, lse = attention_weights_dense(problem.q, problem.k, dense_mask, problem.scale, causal_offset)
    elif return_lse and lse is None:
        # the kernel gives no lse here (a learned mask, or not on CPU): recompute it by row chunks
        lse = dense_lse(problem.q, problem.k, dense_mask, problem.scale, causal_offset)
    return out, weights, lse


def _cast_for_autocast(low: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(low) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in tensors)


def _describe(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None,
    scale: float | None,
    dropout: float,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
) -> AttentionProblem:
    """`describe_problem`, plus the checks a structured mask makes against the sizes."""
    problem = describe_problem(q, k, v, mask, scale, dropout, bias=bias, softcap=softcap, score_mod=score_mod)
    if isinstance(problem.mask, Mask):
        problem.mask.validate(problem.N, problem.H, problem.L, problem.S)
    return problem


def _structured(problem: AttentionProblem) -> Mask | None:
    mask = problem.mask
    assert mask is None or isinstance(mask, Mask)  # _sparse_plan refuses tensor masks
    return None if mask is None else mask.to(problem.q.device)


def _sparse_attention(
    problem: AttentionProblem, plan: Plan, return_weights: bool, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The blocks / flex paths: (output (N, H, L, Ev), weights (N, H, L, S) or None, lse (N, H, L) or None)."""
    mask = _structured(problem)
    q, k, v = problem.q, problem.k, problem.v
    plan = _completed(problem, plan)
    if plan.path == "blocks":
        assert plan.tiles is not None
        if problem.terms.active:
            out, lse = scored_tile_attention(q, k, v, mask, plan.tiles, problem.scale, problem.terms)
        else:
            out, lse = tile_attention(q, k, v, mask, plan.tiles, problem.scale)
        tiles = plan.tiles
    else:
        assert plan.layout is not None
        out, lse = flex_attention_layout(
            q, k, v, mask, plan.layout, problem.scale, need_lse=q.device.type != "cpu", terms=problem.terms
        )
        tiles = None
    weights = None
    if return_weights and _needs_grad(problem):
        # weights that a loss will differentiate: the dense formula (they are L x S anyway)
        causal_offset = problem.mask.offset(problem.L, problem.S) if isinstance(problem.mask, Causal) else None
        dense = _dense_mask(problem, Plan("math", "weights with gradient", causal_offset=causal_offset))
        weights, _ = attention_weights_dense(q, k, dense, problem.scale, causal_offset, terms=problem.terms)
        return_weights = False
    if return_weights or (return_lse and lse is None):
        if tiles is None:
            assert plan.layout is not None
            config = TileConfig(block_q=plan.layout.block_q, block_k=plan.layout.block_k)
            tiles = _tile_plan(problem, config, plan.layout)
        if lse is None:
            lse = tile_lse(q, k, mask, tiles, problem.scale, problem.terms)
        if return_weights:
            heads = torch.arange(problem.H, device=q.device)
            rows = torch.arange(problem.L, device=q.device)
            weights = tile_weights(q, k, mask, tiles, problem.scale, heads, rows, lse, problem.terms)
    return out, weights, lse


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


def _visible_pairs(problem: AttentionProblem, plan: Plan) -> float:
    """(query, key) pairs the path computes, per batch row and head."""
    L, S = problem.L, problem.S
    if plan.tiles is not None:
        return plan.tiles.computed_pairs() / problem.N
    if plan.layout is not None:
        return plan.layout.visited_pairs()
    if plan.path == "fused" and plan.sdpa_causal:
        return sum(min(S, max(0, i + 1)) for i in range(L))
    return L * S


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
    measure: bool = False,
) -> Explanation:
    """Say which path `qkv.attention` would take for these arguments, why, and its cost.

    Nothing is computed: the inputs are validated exactly as `attention` does. The score
    terms (bias, softcap, score_mod) are named and their work counted apart. A note says
    when a low-precision dtype has no native products on this CPU (slow emulation). With
    ``measure=True`` the machine's float32 and input-dtype matmul rates are measured (once
    per process, a fraction of a second; `qkv.kernels.machine`) and reported, with the time
    this work would take at that rate.
    """
    low = autocast_dtype(q)
    if low is not None:
        q, k, v = _cast_for_autocast(low, q, k, v)
    problem = _describe(q, k, v, mask, scale, dropout, bias, softcap, score_mod)
    plan = choose_path(problem, backend, return_weights, return_lse)
    NH = problem.N * problem.H
    L, S, E, Ev = problem.L, problem.S, problem.E, problem.Ev
    pairs = _visible_pairs(problem, plan)
    flops = int(2 * (E + Ev) * pairs * NH)
    acc_bytes = torch.empty((), dtype=accumulation_dtype(q.dtype)).element_size()
    blocks_visited = tiles = None
    if plan.deferred:
        assert isinstance(problem.mask, Mask)
        points = problem.mask.evaluated_points(L, S)
        tiles = f"not evaluated: the layout takes {points:,} evaluations of the mask, done when attention runs"
    if plan.layout is not None:
        layout = plan.layout
        blocks_visited = layout.visited_block_fraction
        tiles = (
            f"{layout.block_q}x{layout.block_k}: {layout.states.numel() - layout.count(0)} of "
            f"{layout.states.numel()} visited ({blocks_visited:.1%}), {layout.count(FULL)} of them full"
        )
    if plan.path in ("blocks", "flex"):
        extra = _sparse_extra_bytes(problem, plan, acc_bytes, return_weights)
    elif plan.path == "math":
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
        if problem.terms.bias is not None:
            extra += (problem.N if problem.terms.batch_varies else 1) * problem.H * L * S * acc_bytes  # rendered bias
    batch = "x".join(str(b) for b in problem.batch_shape) or "()"
    shape = (
        f"B={batch} H={problem.H} G={problem.G} L={L} S={S} E={E} Ev={Ev} "
        f"{str(q.dtype).removeprefix('torch.')} on {q.device}"
    )
    note = emulation_note(q.dtype, q.device)
    rates: tuple[tuple[str, float], ...] = ()
    if measure and q.device.type == "cpu":
        threads = torch.get_num_threads()
        rates = tuple(
            (str(dtype).removeprefix("torch."), matmul_gflops(dtype, threads))
            for dtype in dict.fromkeys((torch.float32, q.dtype))
        )
    return Explanation(
        path=plan.path,
        reason=plan.reason,
        shape=shape,
        mask=problem.mask_kind,
        flops=flops,
        visited_fraction=pairs / (L * S),
        peak_extra_bytes=int(extra),
        blocks_visited=blocks_visited,
        tiles=tiles,
        scores=problem.terms.describe(),
        score_flops=int(problem.terms.flops_per_pair() * pairs * NH),
        upper_bound=plan.deferred,
        notes=() if note is None else (note,),
        matmul_rates=rates,
    )


def _sparse_extra_bytes(problem: AttentionProblem, plan: Plan, acc_bytes: int, return_weights: bool) -> int:
    """Memory beyond inputs and output of the blocks / flex paths (an estimate)."""
    NH, L, S = problem.N * problem.H, problem.L, problem.S
    D = max(problem.E, problem.Ev)
    itemsize = problem.q.element_size()
    mask = problem.mask
    extra = NH * L * acc_bytes  # lse
    if plan.path == "blocks":
        extra += NH * L * D * acc_bytes if acc_bytes != itemsize else 0  # accumulator of a low-precision output
        if problem.G != problem.H or problem.Ev != problem.E:
            extra += 2 * NH * S * D * itemsize  # keys and values expanded to every head / padded to D
    if plan.tiles is not None:
        extra += plan.tiles.max_call_bytes(problem.H, D, itemsize, _mask_heads(problem))
        masked = [c for c in plan.tiles.calls if c.masked]
        if masked and isinstance(mask, Mask) and mask.shift_invariant:
            # tiles kept for reuse along the diagonals (kernels.blocks._tile), at most call_bytes
            tile = max(c.q_len * c.width for c in masked) * (itemsize + 1) * _mask_heads(problem)
            extra += min(plan.tiles.config.call_bytes, tile * len(masked))
    elif plan.deferred:
        # the calls are not known before the layout is: the engine keeps one call's
        # temporaries within call_bytes; the layout holds a byte per tile (int32 indices for Flex)
        assert isinstance(mask, Mask)
        block_q, block_k = (TILES.block_q, TILES.block_k) if plan.path == "blocks" else (FLEX_BLOCK, FLEX_BLOCK)
        n_tiles = (mask.batch or 1) * (mask.heads or 1) * -(-L // block_q) * -(-S // block_k)
        extra += TILES.call_bytes + n_tiles if plan.path == "blocks" else n_tiles * 2 * 4
    else:
        assert plan.layout is not None
        extra += plan.layout.states.numel() * 2 * 4  # BlockMask indices (int32)
    if return_weights:
        extra += NH * L * S * acc_bytes
    return int(extra)


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    heads: Sequence[int] | torch.Tensor | None = None,
    rows: Sequence[int] | slice | range | torch.Tensor | None = None,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The exact attention probabilities of chosen heads and query rows, and nothing more.

    For a structured mask the scores are recomputed tile by tile, over the non-empty tiles
    of the chosen rows only, first for their log-sum-exp and then as exp(s - lse): the
    memory is that of the answer, whatever L and H. Other masks take the dense path on the
    chosen heads and rows. The result carries no gradient (use ``qkv.attention(...,
    backend="math", return_weights=True)`` to differentiate the weights).

    Args:
        q, k, v, mask, bias, softcap, score_mod, scale: as `qkv.attention` (v is validated
            and otherwise unused).
        heads: query head indices, default every head.
        rows: query row indices (a sequence, range, slice or 1-D integer tensor), default
            every row.

    Returns:
        (..., len(heads), len(rows), S) float32 (float64 for float64 inputs). A row that may
        attend to no key is all zeros.

    Example:
        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 4, 1000, 16)
        >>> w = qkv.attention_weights(q, k, v, qkv.masks.sliding_window(8), heads=[2], rows=[0, 500])
        >>> w.shape, int((w[0, 0, 1] > 0).sum())
        (torch.Size([1, 1, 2, 1000]), 9)
    """
    low = autocast_dtype(q)
    if low is not None:
        q, k, v = _cast_for_autocast(low, q, k, v)
        with torch.autocast(q.device.type, enabled=False):
            return attention_weights(
                q, k, v, mask, heads=heads, rows=rows, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale
            )
    problem = _describe(q, k, v, mask, scale, 0.0, bias, softcap, score_mod)
    head_idx = _indices(heads, problem.H, "heads", q.device)
    row_idx = _indices(rows, problem.L, "rows", q.device)
    batch = problem.batch_shape
    structured = problem.mask is None or isinstance(problem.mask, Mask)
    if structured:
        tiles = _tile_plan(problem, TILES, _layout(problem, TILES.block_q, TILES.block_k))
        weights = tile_weights(
            problem.q, problem.k, _structured(problem), tiles, problem.scale, head_idx, row_idx, terms=problem.terms
        )
    else:
        tensor_mask = problem.mask
        assert isinstance(tensor_mask, torch.Tensor)
        heads_of_mask = head_idx if tensor_mask.shape[1] > 1 else head_idx[:1] * 0
        picked = tensor_mask[:, heads_of_mask][:, :, row_idx]  # (N | 1, h | 1, r, S)
        G, H = problem.G, problem.H
        q_sel = problem.q[:, head_idx][:, :, row_idx]  # (N, h, r, E)
        k_sel = problem.k[:, head_idx // (H // G)]  # (N, h, S, E)
        with torch.no_grad():
            weights, _ = attention_weights_dense(
                q_sel, k_sel, picked, problem.scale, terms=problem.terms, heads=head_idx, rows=row_idx
            )
    return weights.reshape(*batch, len(head_idx), len(row_idx), problem.S)  # (..., h, r, S)


def _indices(
    chosen: Sequence[int] | slice | range | torch.Tensor | None, size: int, name: str, device: torch.device
) -> torch.Tensor:
    """Chosen indices as a 1-D int64 tensor, checked against range(size)."""
    if chosen is None:
        return torch.arange(size, device=device)
    if isinstance(chosen, slice):
        chosen = range(size)[chosen]
    if isinstance(chosen, (int, str, bytes)) or not isinstance(chosen, (Sequence, range, torch.Tensor)):
        hint = f" (for the single index {chosen} pass [{chosen}])" if isinstance(chosen, int) and not isinstance(chosen, bool) else ""
        raise TypeError(
            f"{name} must be a sequence of ints, a range, a slice or a 1-D integer tensor, "
            f"got {type(chosen).__name__} {chosen!r}{hint}"
        )
    if isinstance(chosen, torch.Tensor):
        if chosen.dtype in (torch.bool,) or chosen.is_floating_point() or chosen.ndim != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor, got dtype {chosen.dtype} shape {tuple(chosen.shape)}")
        idx = chosen.to(device=device, dtype=torch.long)
    else:
        values = list(chosen)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in values):
            raise TypeError(f"{name} must be integers, got {values!r}")
        idx = torch.tensor(values, dtype=torch.long, device=device)
    if idx.numel() == 0:
        raise ValueError(f"{name} selects nothing")
    bad = idx[(idx < 0) | (idx >= size)]
    if bad.numel() > 0:
        raise ValueError(f"{name} must lie in [0, {size}), got {bad.tolist()}")
    return idx
