"""Run a `qkv.attention.dispatch.Plan`: hand the mask and score terms to the kernel the way the Plan says.

Nothing here chooses: every branch reads a field of the Plan (its path, its mask and score
routes, the sources of weights and lse). Tensors are those of `qkv.attention.problem`: q (N, H, L, E),
k (N, G, S, E), v (N, G, S, Ev), outputs (N, H, L, Ev), weights (N, H, L, S), lse (N, H, L).
"""

from __future__ import annotations

import torch

from qkv._private import torch as private_torch
from qkv.attention.dispatch import MaskRoute, Plan, complete, key_padding, needs_grad
from qkv.attention.problem import AttentionProblem, compact, normalize_mask
from qkv.backends.blocks.engine import block_attention, block_lse, block_weights
from qkv.backends.blocks.ops import block_attention_op
from qkv.backends.blocks.scored import scored_block_attention
from qkv.backends.decode import decode_attention
from qkv.backends.dense import attention_weights_dense, dense_lse, fused_attention, math_attention
from qkv.backends.flex import flex_attention_layout
from qkv.backends.query_chunks import chunked_attention
from qkv.backends.sinks import SinkFold, key_share
from qkv.backends.softmax import accumulation_dtype
from qkv.masks import Mask
from qkv.native import short_bf16, short_wide
from qkv.scores import ScoreTerms

__all__ = ["applies_nan_rule", "checks_values_itself", "pack", "run", "run_weights"]

Result = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def run(problem: AttentionProblem, plan: Plan, out_dtype: torch.dtype | None = None) -> Result:
    """Run ``plan``: (output (N, H, L, Ev), weights (N, H, L, S) or None, lse (N, H, L) or None).
    ``out_dtype``: the dtype the caller will round the output to; the block engine's flash
    path writes it in that dtype directly (others leave the rounding to the caller)."""
    if plan.path in ("blocks", "flex"):
        return _run_tiles(problem, plan, out_dtype)
    if plan.path == "decode":
        return _run_decode(problem, plan.forward_kernel)
    q, k, v, scale = problem.q, problem.k, problem.v, problem.scale
    if plan.forward_kernel == "math_chunks":
        assert plan.chunk_rows is not None
        by_chunks = chunked_attention(
            q, k, v, problem.mask if plan.mask == "chunks" else None, scale, rows=plan.chunk_rows,
            causal_offset=plan.causal_offset, terms=problem.terms, sinks=problem.sinks,
        )  # fmt: skip
        return by_chunks[0], None, by_chunks[1]
    mask = _mask_tensor(problem, plan.mask)
    if plan.path == "math":
        return math_attention(
            q, k, v, mask, scale, causal_offset=plan.causal_offset, dropout=problem.dropout, terms=problem.terms,
            sinks=problem.sinks,
        )
    if plan.forward_kernel == "short_bf16":
        out = short_bf16.forward(q, k, v, key_padding(problem), scale)  # (N, H, L, Ev)
        if out is not None:
            return out, None, None
        # its build or self-check failed just now: SDPA below, as the plan's reason says when asked again
    if plan.forward_kernel == "short_wide":
        out = short_wide.forward(q, k, v, key_padding(problem), scale)  # (N, H, L, Ev)
        if out is None:
            # its build or self-check failed just now: SDPA on float32 copies (faster than bf16
            # SDPA wherever this kernel is chosen), rounded once; later calls plan without it
            wide = fused_attention(
                q.float(), k.float(), v.float(), None if mask is None else compact(mask), scale, is_causal=False,
                dropout=0.0, need_lse=False,
            )[0]  # (N, H, L, Ev)
            out = wide.to(q.dtype)
        return out, None, None
    if plan.scores == "dense_mask":
        mask = _join_bias(problem, mask)
    # the kernel broadcasts the mask itself: a key-padding mask reaches it as (N, 1, 1, S), so
    # its empty-row check and SDPA's bool-to-float conversion read S values per item, not L x S
    out, lse = fused_attention(
        q, k, v, None if mask is None else compact(mask), scale, is_causal=plan.mask == "is_causal",
        dropout=problem.dropout, need_lse=plan.lse == "kernel", wide_backward=plan.backward_kernel == "sdpa_wide",
    )
    weights = None
    if plan.weights == "dense":
        weights, lse = attention_weights_dense(q, k, mask, scale, plan.causal_offset)
    elif plan.lse == "dense":
        # the kernel gives no lse here (a learned mask, or not on CPU): recompute it by row chunks
        lse = dense_lse(q, k, mask, scale, plan.causal_offset)
    return out, weights, lse


def _run_decode(problem: AttentionProblem, kernel: str) -> Result:
    """The decode kernel the Plan names: (output (N, H, L, Ev), no weights, lse (N, H, L))."""
    mask = problem.mask
    assert mask is None or isinstance(mask, Mask)  # dispatch.decode_plan takes no tensor mask
    out, lse = decode_attention(
        problem.q, problem.k, problem.v, problem.scale, None if mask is None else mask.to(problem.q.device),
        problem.terms, problem.sinks, kernel=kernel,
    )
    return out, None, lse


def _mask_tensor(problem: AttentionProblem, route: MaskRoute) -> torch.Tensor | None:
    """The mask as a tensor (N | 1, H | 1, L, S) on the "dense" route, None on every other."""
    mask = problem.mask
    if route != "dense":
        return None
    if not isinstance(mask, Mask):
        return mask  # already a tensor (N | 1, H | 1, L, S)
    rendered = mask.to_dense(problem.L, problem.S, device=problem.q.device)  # (N | 1, H | 1, L, S)
    # a mask's batch axis is the flattened one (Mask.validate checks it against N), so it is
    # normalized against (N,), whatever the caller's batch dims: none (H, L, E), or several
    normalized = normalize_mask(rendered, problem.q, (problem.N,), problem.H, problem.L, problem.S)
    assert isinstance(normalized, torch.Tensor)
    return normalized


def _join_bias(problem: AttentionProblem, mask: torch.Tensor | None) -> torch.Tensor:
    """The bias rendered as SDPA's float mask (N | 1, H | 1, L, S), -inf where ``mask`` hides a pair."""
    rendered = render_bias(problem)  # (N | 1, H | 1, L, S)
    if mask is None:
        return rendered
    if mask.dtype == torch.bool:
        return rendered.masked_fill(~mask, float("-inf"))
    return rendered + mask.to(rendered.dtype)


def render_bias(problem: AttentionProblem) -> torch.Tensor:
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


def _structured(problem: AttentionProblem) -> Mask | None:
    mask = problem.mask
    assert mask is None or isinstance(mask, Mask)  # the tile paths take no tensor mask (dispatch refuses it)
    return None if mask is None else mask.to(problem.q.device)


def _try_score_terms_eagerly(terms: ScoreTerms, q: torch.Tensor) -> None:
    """Call the score terms once, outside torch.compile, on one pair as FlexAttention passes it
    (0-d tensors: the score, then b, h, q_idx, kv_idx as int32). A score_mod that raises, or
    returns no float tensor, fails here with its own exception or qkv's TypeError; inside the
    compiled FlexAttention the same mistake surfaces as torch._dynamo's "Unsupported"."""
    if terms.score_mod is None:
        return
    index = torch.zeros((), dtype=torch.int32, device=q.device)
    score = torch.zeros((), dtype=accumulation_dtype(q.dtype), device=q.device)
    with torch.no_grad():
        terms.apply(score, index, index, index, index)


def applies_nan_rule(problem: AttentionProblem, plan: Plan) -> bool:
    """Whether running ``plan`` applies the NaN rule itself (`qkv.attention.nan_rule`): the block
    engine's operators while torch.compile / torch.export trace, which find the rows with the
    values at hand, as eagerly, instead of the traced rule's passes over q, k, v and the output."""
    return plan.path == "blocks" and plan.deferred and private_torch.host_unreadable(problem.q, problem.k, problem.v)


def checks_values_itself(problem: AttentionProblem, plan: Plan) -> bool:
    """Whether running ``plan`` refuses an overflow itself, as eagerly and with eager's message
    (`qkv.backends.overflow`): the block engine's forward operator where it applies the NaN rule,
    with a scale it receives as given (a zero scale reaches its kernel as q * 0 and scale 1,
    which no longer bound the scores; the graph's check, `qkv.attention.problem`, takes it)."""
    return applies_nan_rule(problem, plan) and problem.scale != 0.0


def _run_tiles(problem: AttentionProblem, plan: Plan, out_dtype: torch.dtype | None = None) -> Result:
    """The blocks / flex paths, then the weights and lse from where the Plan says."""
    if applies_nan_rule(problem, plan):
        # traced (torch.compile, torch.export): the engine's operators plan the tiles when the
        # graph runs; dispatch sends no weights here
        traced = block_attention_op(
            problem.q, problem.k, problem.v, _structured(problem), problem.scale, problem.terms, problem.sinks,
            plan.forward_kernel, plan.backward_kernel, needs_grad(problem),
        )
        return traced[0], None, traced[1]
    plan = complete(problem, plan)  # a deferred plan's tiles are found now
    mask = _structured(problem)
    q, k, v, scale, terms, sinks = problem.q, problem.k, problem.v, problem.scale, problem.terms, problem.sinks
    lse: torch.Tensor | None  # None where compiled FlexAttention gives none (qkv.backends.flex)
    if plan.path == "blocks":
        assert plan.tiles is not None
        if plan.forward_kernel in ("bias_tiles", "score_tiles"):
            out, lse = scored_block_attention(q, k, v, mask, plan.tiles, scale, terms, sinks, plan.forward_kernel)
        else:  # no score terms, or terms that the fused bf16 interval kernels apply
            out, lse = block_attention(
                q, k, v, mask, plan.tiles, scale, sinks, plan.forward_kernel, plan.backward_kernel, out_dtype=out_dtype,
                terms=terms if plan.scores == "kernel" else None, diagonals=plan.diagonals,
            )  # fmt: skip
    else:
        assert plan.layout is not None
        if not private_torch.host_unreadable(q, k, v):  # traced, FlexAttention traces the terms itself
            _try_score_terms_eagerly(terms, q)
        out, lse = flex_attention_layout(q, k, v, mask, plan.layout, scale, need_lse=plan.lse == "kernel", terms=terms)
        if sinks is not None:
            out, lse = _flex_sinks(problem, plan, out, lse)
    weights = None
    if plan.weights == "dense":
        # weights that a loss will differentiate: the dense formula, causal by offset, other masks dense
        dense = None if plan.causal_offset is not None else _mask_tensor(problem, "dense")
        weights, _ = attention_weights_dense(q, k, dense, scale, plan.causal_offset, terms=terms, sinks=sinks)
    if plan.lse == "tiles" and sinks is None:  # with sinks, _flex_sinks has folded it already
        assert plan.tiles is not None
        lse = block_lse(q, k, mask, plan.tiles, scale, terms)
    if plan.weights == "tiles":
        assert plan.tiles is not None
        heads = torch.arange(problem.H, device=q.device)
        rows = torch.arange(problem.L, device=q.device)
        if sinks is None:
            weights = block_weights(q, k, mask, plan.tiles, scale, heads, rows, lse, terms)
        else:
            # weights over the keys sum to 1 there, their share of the row (1 - the sink's) scales them
            keys_lse = block_lse(q, k, mask, plan.tiles, scale, terms)
            weights = block_weights(q, k, mask, plan.tiles, scale, heads, rows, keys_lse, terms)
            weights = weights * key_share(keys_lse, sinks).unsqueeze(-1)
    return out, weights, lse


def _flex_sinks(problem: AttentionProblem, plan: Plan, out: torch.Tensor, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's output and lse with the sinks folded in (`qkv.backends.sinks`): its lse
    carries gradient (CUDA); on CPU, where compiled FlexAttention gives none and has no backward,
    the tiles recompute the keys' lse."""
    assert problem.sinks is not None
    if lse is None:
        assert plan.tiles is not None  # dispatch plans the tiles for a flex call with sinks on CPU
        lse = block_lse(problem.q, problem.k, _structured(problem), plan.tiles, problem.scale, problem.terms)
    return SinkFold.apply(out, lse, problem.sinks)


def run_weights(problem: AttentionProblem, plan: Plan, heads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The probabilities (N, h, r, S) of query heads ``heads`` and rows ``rows`` (1-D int64),
    by `qkv.attention.dispatch.weights_plan`, without gradient."""
    if plan.weights == "tiles":
        assert plan.tiles is not None
        return block_weights(
            problem.q, problem.k, _structured(problem), plan.tiles, problem.scale, heads, rows, terms=problem.terms,
            sinks=problem.sinks,
        )
    mask = _mask_tensor(problem, plan.mask)
    assert mask is not None
    heads_of_mask = heads if mask.shape[1] > 1 else heads[:1] * 0
    picked = mask[:, heads_of_mask][:, :, rows]  # (N | 1, h | 1, r, S)
    G, H = problem.G, problem.H
    q_sel = problem.q[:, heads][:, :, rows]  # (N, h, r, E)
    k_sel = problem.k[:, heads // (H // G)]  # (N, h, S, E)
    sinks = None if problem.sinks is None else problem.sinks[:, heads]  # (N | 1, h): one per chosen head
    with torch.no_grad():
        weights, _ = attention_weights_dense(
            q_sel, k_sel, picked, problem.scale, terms=problem.terms, heads=heads, rows=rows, sinks=sinks
        )
    return weights


def pack(
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
