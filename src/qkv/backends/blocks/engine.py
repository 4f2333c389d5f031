"""The CPU block engine: attention that computes only the tiles a structured mask leaves visible.

The inputs are those of `qkv.attention.problem`: q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev).
`qkv.backends.blocks.planner` cuts the visible part of the score matrix into pieces and groups
them into kernel calls; each call runs PyTorch's CPU flash-attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) on strided views of many row groups
at once (`qkv.backends.blocks.calls`), with no mask for fully visible pieces and with the
mask's tile (an additive -inf bias) for partial ones.

Forward. Rows whose keys are split over several pieces get each piece's output
o_p and log-sum-exp lse_p, merged exactly (`qkv.backends.merge.merge_partial`,
FlashAttention's rescaling, algorithm 1):

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Backward (a custom autograd Function, FlashAttention-2's recomputation): for every call the
kernel's backward is given the *final* output and lse of its rows. With those, the
probabilities exp(s - lse) and the row term delta = rowsum(dO * O) are the global ones, so
each piece's dq, dk, dv is exactly its share and the shares simply add up. The returned lse
is differentiable too: its gradient enters as one extra head column (`qkv.backends.lse_grad`).

Memory: besides the output and lse (O(n)), one call's temporaries at a time, bounded by
`BlockConfig.call_bytes` (O(n x block)), and mask tiles kept for reuse, bounded by the same
figure; never an L x S tensor, whatever the mask.

Empty rows (no visible key): output 0, lse -inf, zero gradients, no NaN. The kernel itself
returns lse = 0 for a row with no visible key in its tile, so those rows are set to -inf
from the tile mask before any merge.

Shape legend: N batch rows, H heads, L queries, S keys, E / Ev head dims of q, k / v,
Ep = max(E, Ev) the kernel's one head size (`block_calls.kernel_inputs`).

References: Dao et al., "FlashAttention" (2022), algorithm 1 and section 3.3; Dao,
"FlashAttention-2" (2023), algorithm 2 (backward from the saved log-sum-exp).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from qkv._private import torch as private_torch
from qkv.backends.blocks import scored
from qkv.backends.blocks.calls import (
    BlockRun,
    CallResult,
    add_key_grads,
    add_query_grads,
    gradient_view,
    item_view,
    kernel_inputs,
    mask_tile,
    rounded_in_turn,
    row_view,
    run_calls,
)
from qkv.backends.blocks.diagonals import DiagonalTable, diagonal_table, fused_terms_reason
from qkv.backends.blocks.matmul_backward import call_gradients, suits
from qkv.backends.blocks.planner import BlockPlan, Call, Piece
from qkv.backends.lse_grad import with_lse_gradient
from qkv.backends.sinks import fold as sink_fold
from qkv.backends.sinks import sink_gradient
from qkv.backends.softmax import accumulation_dtype, causal_kernel_scale
from qkv.masks import Mask
from qkv.native import interval_bf16, interval_bf16_backward
from qkv.native.interval_terms import NO_TERMS, IntervalTerms
from qkv.scores import ScoreTerms

__all__ = ["block_attention", "block_lse", "block_weights", "engine_extra_bytes"]

_NEG_INF = float("-inf")


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: BlockRun, rounded: bool = False, kernel: str = "cpu_flash_tiles",
    out_dtype: torch.dtype | None = None,
) -> CallResult:
    """Output (N, H, L, Ep) and lse (N, H, L), float32 or wider, from q, k, v (N, H, *, Ep):
    the fused bf16 kernel (`qkv.native.interval_bf16`) when the plan's ``kernel`` names it
    ("interval_bf16") and it builds, else the flash kernel per call. With ``rounded`` (no
    backward will read it) the output may come in q's dtype instead, or in ``out_dtype``
    (the flash path: `calls.run_calls`). Score terms (``run.terms``) only the fused kernel
    applies: without it, the scored engine's tile kernel takes the call."""
    if run.terms is not None:
        out, shift, rest = forward_with_terms(q, k, v, run, rounded, kernel)
        return out, shift if rest is None else shift + rest
    intervals = run.plan.intervals
    if kernel == "interval_bf16":
        assert intervals is not None  # dispatch names it for plans with intervals only
        fused = interval_bf16.forward(q, k, v, *intervals, run.scale, rounded=rounded)
        if fused is not None:  # None: its build or self-check failed just now (explain says why)
            return fused
    flash = private_torch.cpu_flash_attention

    def compute(call: Call) -> CallResult:
        bias, empty_rows = mask_tile(run, call, q.dtype) if call.masked else (None, None)
        o, lse_o = flash(
            item_view(q, call, keys=False), item_view(k, call, keys=True), item_view(v, call, keys=True),
            0.0, call.causal, attn_mask=bias, scale=run.scale,
        )[:2]  # (items, H, q_len, Ep), (items, H, q_len)
        if empty_rows is not None:
            lse_o = lse_o.masked_fill(empty_rows, _NEG_INF)
        return o, lse_o

    # the flash kernel's output is in q's dtype; kept in out_dtype when asked (rounded: no backward reads it)
    return run_calls(q, run.plan, compute, rounded=True, out_dtype=out_dtype if rounded else None)


def forward_with_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: BlockRun, rounded: bool = False, kernel: str = "interval_bf16"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(output, shift, rest) of a run with score terms (``run.terms``), lse = shift + rest: from the
    fused bf16 kernel when ``kernel`` names it and it can take them, its lse whole (rest None);
    else from the scored engine, which keeps the lse in two parts (a row offset near the
    float32 limits leaves a single lse no digits for the rest: `scored._HUGE_OFFSET`)."""
    intervals = run.plan.intervals
    if kernel == "interval_bf16" and intervals is not None:  # traced plans may come without (`ops._with_intervals`)
        terms = _kernel_terms(run, q.shape[1])
        fused = None if terms is None else interval_bf16.forward(q, k, v, *intervals, run.scale, rounded=rounded, terms=terms)
        if fused is not None:  # None: its build or self-check failed just now (explain says why)
            return fused[0], fused[1], None
    out, shift, rest = scored._forward(q, k, v, _scored_run(run, q.dtype))
    return out, shift, rest


def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    run: BlockRun,
    grad_lse: torch.Tensor | None = None,
    kernel: str = "engine_per_call",
    lse_parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (N, H, *, Ep) from the final output and lse (FlashAttention-2 recomputation),
    with the gradient of lse (N, H, L) added when ``grad_lse`` is given.

    Where the plan's ``kernel`` is "interval_bf16_backward" (bf16 plans with one key interval
    per query), the fused bf16 backward kernel (`qkv.native.interval_bf16_backward`) runs when
    it builds. Otherwise ("engine_per_call"):

    bf16 calls whose pieces hold all keys of their rows take the matrix-product backward
    (`qkv.backends.blocks.matmul_backward`) on the inputs as they are; the other calls run the flash
    kernel in the accumulation dtype, low-precision inputs on exact float32 copies: PyTorch's
    bf16 flash backward converts every tile to float32 and back and runs at about 60 % of its
    float32 rate (one core, sliding window tiles 192 x 704: 48 vs 82 GFLOP/s,
    benchmarks/sparse.py); the gradients are rounded to the input dtype at the end.
    """
    intervals = run.plan.intervals
    if kernel == "interval_bf16_backward" and intervals is not None:
        terms = _kernel_terms(run, q.shape[1])
        fused = None if terms is None else interval_bf16_backward.backward(grad_out, q, k, v, out, lse, *intervals, run.scale, grad_lse, terms)
        if fused is not None:  # None: its build or self-check failed just now (explain says why)
            return fused
    if run.terms is not None:  # the scored engine's backward, from the lse in its parts where the forward kept them
        shift, rest = lse_parts if lse_parts is not None else (lse, torch.zeros_like(lse))
        grads = scored._backward(grad_out, grad_lse, q, k, v, out, shift, rest, _scored_run(run, q.dtype), (), False)
        return grads[0], grads[1], grads[2]  # type: ignore[return-value]  # dq, dk, dv are never None
    dtypes = q.dtype, k.dtype, v.dtype
    Ep = q.shape[3]
    if grad_lse is not None:
        q, k, v, out, grad_out = with_lse_gradient(q, k, v, out, grad_out, grad_lse)  # (N, H, *, Ep + 1)
    N, H, L, cols = q.shape  # cols: Ep, or Ep + 1 with the lse gradient's column
    S = k.shape[2]
    acc_dtype = accumulation_dtype(q.dtype)
    # causal squares stay on the flash kernel: its is_causal needs no q_len x q_len tile
    by_products = [suits(q.dtype, call.merge, grad_lse is not None) and not call.causal for call in run.plan.calls]
    # rows without a visible key: any finite normalizer keeps exp(-inf - lse) = 0 there
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)
    dq = torch.zeros(N, H, L, cols, dtype=acc_dtype)
    dk = torch.zeros(N, H, S, cols, dtype=acc_dtype)
    dv = torch.zeros(N, H, S, cols, dtype=acc_dtype)
    flash_backward = private_torch.cpu_flash_attention_backward
    for call, products in zip(run.plan.calls, by_products, strict=True):
        if products:
            # bf16 products on the matrix units (qkv.backends.blocks.matmul_backward), not the flash kernel
            bias, empty = mask_tile(run, call, q.dtype) if call.masked else (None, None)
            gq, gk, gv = call_gradients(
                gradient_view(grad_out, call, q.dtype), item_view(q, call, keys=False),
                item_view(k, call, keys=True), item_view(v, call, keys=True), bias, empty, run.scale,
                run.plan.config.call_bytes,
            )  # (items, H, q_len, cols), (items, H, width, cols) x 2
        else:
            # the call's own views in the kernel's dtype: low-precision inputs are copied call by
            # call (exactly), never all at once (a float32 copy of q, k, v is 3 x 4 bytes a value)
            q_, o_ = (item_view(x, call, keys=False).to(acc_dtype) for x in (q, out))  # (items, H, q_len, cols)
            k_, v_ = (item_view(x, call, keys=True).to(acc_dtype) for x in (k, v))  # (items, H, width, cols)
            bias = mask_tile(run, call, acc_dtype)[0] if call.masked else None
            gq, gk, gv = flash_backward(
                gradient_view(grad_out, call, acc_dtype), q_, k_, v_, o_, row_view(lse, call), 0.0, call.causal,
                attn_mask=bias, scale=run.scale,
            )  # (items, H, q_len, cols), (items, H, width, cols) x 2
            del q_, k_, v_, o_
        add_query_grads(dq, call, gq)
        add_key_grads(dk, call, gk)
        add_key_grads(dv, call, gv)
    accumulators = [dq, dk, dv]
    del dq, dk, dv
    return rounded_in_turn(accumulators, Ep, dtypes)  # type: ignore[return-value]



def _kernel_terms(run: BlockRun, H: int) -> IntervalTerms | None:
    """``run.terms`` as the fused interval kernels take them, or None when they cannot (a bias
    with no table: `diagonals.diagonal_table`). The table is built once per run (dispatch builds
    it for eager plans; a traced plan's is built here, when the graph runs)."""
    terms = run.terms
    if terms is None:
        return NO_TERMS
    if fused_terms_reason(terms, False) is not None:  # a bias by batch row, a score_mod: not theirs
        return None
    softcap = terms.softcap or 0.0
    if terms.bias is None:
        return IntervalTerms(softcap)
    if run.diagonals is None:
        assert run.plan.intervals is not None  # the kernels run on plans with intervals only
        run.diagonals = diagonal_table(terms, H, run.plan.intervals)
        if run.diagonals is None:
            return None
    table = run.diagonals
    return IntervalTerms(softcap, table.table, table.positions, table.offset)


def _scored_run(run: BlockRun, dtype: torch.dtype) -> scored._ScoredRun:
    """The scored engine's run of a plain run with score terms: its tile kernel applies them."""
    assert run.terms is not None
    return scored._ScoredRun(run, run.terms, scored._tile_bias(run.terms.bias, accumulation_dtype(dtype)))


class _BlockAttention(torch.autograd.Function):
    """Forward and backward of the block engine; both the output and lse are differentiable,
    and so are the attention sinks (N | 1, H) when given (`qkv.backends.sinks`)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: BlockRun, kernels: tuple[str, str], sinks: torch.Tensor | None = None):  # type: ignore[override]
        # with score terms the lse may come in two parts (the scored engine standing in for the
        # fused kernel), which its backward reads: shift (N, H, L), and rest, or None
        shift, rest = None, None
        if run.terms is not None:
            out_acc, shift, rest = forward_with_terms(q, k, v, run, kernel=kernels[0])
            lse = shift if rest is None else shift + rest
        else:
            out_acc, lse = _forward(q, k, v, run, kernel=kernels[0])
        p_sink = None
        if sinks is not None:
            # the backward reads the sink-inclusive output and lse: its formulas hold unchanged
            if shift is not None and rest is not None:
                out_acc, rest, p_sink = sink_fold(out_acc, rest, sinks, shift)
                lse = shift + rest
            else:
                out_acc, lse, p_sink = sink_fold(out_acc, lse, sinks)
        out = out_acc.to(q.dtype)
        # the backward's row term rowsum(dO * O) reads the unrounded output
        parts = () if rest is None else (shift, rest)
        ctx.save_for_backward(q, k, v, out_acc, lse, *parts, *(() if sinks is None else (p_sink, sinks)))
        ctx.run, ctx.backward_kernel, ctx.parts = run, kernels[1], len(parts)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None):  # type: ignore[override]
        q, k, v, out, lse, *saved = ctx.saved_tensors
        parts, sink_state = saved[: ctx.parts], saved[ctx.parts :]
        d_sinks = None
        if sink_state and ctx.needs_input_grad[5]:
            d_sinks = sink_gradient(grad_out, out, grad_lse, *sink_state)
        if not any(ctx.needs_input_grad[:3]):
            return None, None, None, None, None, d_sinks
        if grad_out is None:
            grad_out = torch.zeros((), dtype=out.dtype).expand(out.shape)  # only lse is used: no full-size zeros
        with torch.autocast(q.device.type, enabled=False):  # float32 accumulators stay float32
            lse_parts = (parts[0], parts[1]) if parts else None
            dq, dk, dv = _backward(grad_out, q, k, v, out, lse, ctx.run, grad_lse, ctx.backward_kernel, lse_parts)
        return dq, dk, dv, None, None, d_sinks


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    plan: BlockPlan,
    scale: float,
    sinks: torch.Tensor | None = None,
    forward_kernel: str = "cpu_flash_tiles",
    backward_kernel: str = "engine_per_call",
    out_dtype: torch.dtype | None = None,
    terms: ScoreTerms | None = None,
    diagonals: DiagonalTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the tiles of ``plan``: (output (N, H, L, Ev) in q's dtype, lse (N, H, L)).

    q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) on CPU; ``sinks`` (N | 1, H), float32 or
    wider: one attention-sink logit per head in every row's denominator (`qkv.backends.sinks`),
    and lse includes it. Both results are differentiable in q, k, v and the sinks; lse is
    float32 (float64 for float64 inputs). ``forward_kernel`` and ``backward_kernel``: the kernels
    `qkv.attention.dispatch` chose (`Plan.forward_kernel`); by default the portable ones, which
    take every plan. ``out_dtype``: the output's dtype instead of q's where no backward is
    recorded (an emulated bf16 call computed in float32: rounded as it is placed, no float32
    output in between); where one is, the output stays in q's dtype. ``terms``: score terms that the
    fused bf16 interval kernels apply (a softcap, a bias by diagonal, whose table ``diagonals``
    the plan may hold: `qkv.backends.blocks.diagonals`), or the scored engine where they cannot
    run.
    """
    if terms is not None:
        refusal = fused_terms_reason(terms, torch.is_grad_enabled())
        if refusal is not None:  # `qkv.backends.blocks.scored.scored_block_attention` takes them
            raise ValueError(f"block_attention(terms=...) takes the terms the fused interval kernels apply; {refusal}")
    # causal squares run on the kernel's is_causal, which needs a positive scale
    kernel_q, kernel_scale = causal_kernel_scale(q, scale)
    inputs, run = kernel_inputs(kernel_q, k, v), BlockRun(plan, mask, kernel_scale, terms, diagonals)
    grads = (q, k, v) if sinks is None else (q, k, v, sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in grads):
        out, lse = _BlockAttention.apply(*inputs, run, (forward_kernel, backward_kernel), sinks)
    else:  # no backward: the fused kernel writes the output in q's dtype (half the bytes, no copy)
        # ... unless a sink rescales it first: then it is rounded once, after the fold
        out_acc, lse = _forward(*inputs, run, rounded=sinks is None, kernel=forward_kernel, out_dtype=out_dtype)
        if sinks is not None:
            out_acc, lse, _ = sink_fold(out_acc, lse, sinks)
        out = out_acc.to(out_dtype or q.dtype)
    return out[..., : v.shape[3]], lse


def _piece_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: Mask | None,
    plan: BlockPlan,
    scale: float,
    heads: torch.Tensor,
    rows: torch.Tensor,
    terms: ScoreTerms | None = None,
) -> Iterator[tuple[int, torch.Tensor, list[tuple[Piece, torch.Tensor]]]]:
    """For each batch row and row group holding chosen rows: (n, positions of those rows in
    ``rows``, [(piece, scores (h, r, width) with the score terms applied and -inf where
    masked)]), visited pieces only."""
    N, H, L, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    device = q.device
    acc = accumulation_dtype(q.dtype)
    kv_heads = heads // (H // G)
    for n in range(N):
        groups: dict[tuple[int, int], list[Piece]] = {}
        for p in plan.pieces[n if len(plan.pieces) > 1 else 0]:
            groups.setdefault((p.q0, p.q1), []).append(p)
        for (q0, q1), pieces in groups.items():
            where = torch.nonzero((rows >= q0) & (rows < q1)).flatten()  # positions in ``rows``
            if where.numel() == 0:
                continue
            q_rows = rows[where]
            q_n = q[n][heads][:, q_rows].to(acc)  # (h, r, E)
            scored = []
            for p in pieces:
                k_n = k[n][kv_heads][:, p.k0 : p.k1].to(acc)  # (h, width, E)
                s = torch.matmul(q_n, k_n.transpose(-1, -2)) * scale  # (h, r, width)
                if terms is not None and terms.active:
                    keys = torch.arange(p.k0, p.k1, device=device).view(1, 1, -1)  # (1, 1, width)
                    b = torch.full((1, 1, 1), n, device=device)
                    s = terms.apply(s, b, heads.view(-1, 1, 1), q_rows.view(1, -1, 1), keys)
                if p.masked or p.causal:
                    assert mask is not None  # masked and causal pieces come from a mask
                    b = torch.full((1, 1, 1), n if mask.batch is not None else 0, device=device)
                    h = heads.view(-1, 1, 1) if mask.heads is not None else torch.zeros(1, 1, 1, dtype=torch.long, device=device)  # (h | 1, 1, 1)
                    keys = torch.arange(p.k0, p.k1, device=device).view(1, 1, -1)  # (1, 1, width)
                    visible = mask.visible(b, h, q_rows.view(1, -1, 1), keys, L, S)  # q_rows as (1, r, 1)
                    s = s.masked_fill(~torch.broadcast_to(visible, s.shape), _NEG_INF)
                scored.append((p, s))
            yield n, where, scored


def block_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: Mask | None,
    plan: BlockPlan,
    scale: float,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """log sum_j exp(s_ij) (N, H, L) over the non-empty tiles, block by block (no gradient)."""
    N, H, L, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    lse = torch.full((N, H, L), _NEG_INF, dtype=acc, device=q.device)
    heads, rows = torch.arange(H, device=q.device), torch.arange(L, device=q.device)
    with torch.no_grad():
        for n, where, scored in _piece_scores(q, k, mask, plan, scale, heads, rows, terms):
            if scored:
                lse[n][:, rows[where]] = torch.logsumexp(torch.cat([s for _, s in scored], dim=-1), dim=-1)
    return lse


def block_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: Mask | None,
    plan: BlockPlan,
    scale: float,
    heads: torch.Tensor,
    rows: torch.Tensor,
    lse: torch.Tensor | None = None,
    terms: ScoreTerms | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact probabilities (N, len(heads), len(rows), S) of chosen heads and query rows.

    Computed block by block over the non-empty pieces of each query block only: with the
    saved ``lse`` (N, H, L) of the forward pass (over the keys alone) as exp(s - lse), or,
    without it, from a log-sum-exp over the same pieces first. With ``sinks`` (N | 1, H) each
    row's sink joins its denominator: the weights over the keys then sum to the keys' share
    exp(lse - logaddexp(lse, sink)) < 1. No gradient; float32 or wider.
    """
    N, S = q.shape[0], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    weights = torch.zeros(N, len(heads), len(rows), S, dtype=acc, device=q.device)
    # the keys' lse of every chosen row (-inf: no visible key), for the sinks' share
    keys_lse = torch.full((N, len(heads), len(rows)), _NEG_INF, dtype=acc, device=q.device)
    with torch.no_grad():
        for n, where, scored in _piece_scores(q, k, mask, plan, scale, heads, rows, terms):
            if not scored:
                continue
            if lse is None:
                row_lse = torch.logsumexp(torch.cat([s for _, s in scored], dim=-1), dim=-1)  # (h, r)
            else:
                row_lse = lse[n][heads][:, rows[where]].to(acc)  # (h, r)
            keys_lse[n, :, where] = row_lse
            # rows with no visible key: every score is -inf, any finite normalizer gives 0
            safe = row_lse.masked_fill(row_lse == _NEG_INF, 0.0).unsqueeze(-1)  # (h, r, 1)
            for p, s in scored:
                weights[n, :, where, p.k0 : p.k1] = torch.exp(s - safe)
        # exp(s - lse) carries lse's rounding (about eps * |s|) into every weight of a row; the
        # row sum is 1 in exact arithmetic, so dividing by it removes that common error
        sums = weights.sum(dim=-1, keepdim=True)  # (N, h, r, 1)
        weights = weights / sums.masked_fill(sums == 0, 1.0)
        if sinks is not None:
            sink = sinks[:, heads].to(acc).unsqueeze(-1)  # (N | 1, h, 1)
            folded = torch.logaddexp(keys_lse, sink)  # (N, h, r): the row's lse with its sink
            share = torch.exp(keys_lse - folded)  # (N, h, r); 0 on rows with no visible key
            weights = weights * share.unsqueeze(-1)  # (N, h, r, S)
    return weights


def engine_extra_bytes(
    dtype: torch.dtype,
    *,
    N: int,
    H: int,
    G: int,
    L: int,
    S: int,
    E: int,
    Ev: int,
    plan: BlockPlan | None,
    call_bytes: int,
    n_tiles: int,
    mask_heads: int,
    reuses_tiles: bool,
    score_terms: bool = False,
    interval_kernel: bool = False,
) -> int:
    """Memory the engine allocates beyond inputs and output (an estimate), with or without
    score terms (`qkv.backends.blocks.scored`): the lse, a float32 accumulator for a low-precision
    output, keys and values expanded to every head / padded to Ep = max(E, Ev), then

    - with its ``plan``: the largest call's temporaries (`BlockPlan.max_call_bytes`), the packed
      keys and values of the fused bf16 kernel where it runs (``interval_kernel``), and, for a
      mask whose tiles repeat along the diagonals (``reuses_tiles``), the tiles kept for reuse
      (`block_calls.mask_tile`), at most ``call_bytes``;
    - without (a layout still to be found when attention runs): one call's temporaries, at
      most ``call_bytes``, and the layout's byte per tile (``n_tiles``).
    """
    Ep = max(E, Ev)
    itemsize = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
    extra = N * H * L * acc  # lse
    extra += N * H * L * Ep * acc if acc != itemsize else 0
    if G != H or Ev != E:
        extra += 2 * N * H * S * Ep * itemsize
    if plan is None:
        return extra + call_bytes + n_tiles
    extra += plan.max_call_bytes()
    if interval_kernel and not score_terms:
        # the fused bf16 kernel's buffers, per thread: one head's values transposed (keys padded
        # to 64), and the scores and probabilities of 64 queries by up to 1,024 keys
        extra += torch.get_num_threads() * (-(-S // 64) * 64 * Ep * itemsize + 64 * 1024 * (4 + itemsize))
    masked = [c for c in plan.calls if c.masked]
    if masked and reuses_tiles:
        tile = max(c.q_len * c.width for c in masked) * (itemsize + 1) * mask_heads
        extra += min(call_bytes, tile * len(masked))
    return extra
