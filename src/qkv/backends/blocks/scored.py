"""The CPU block engine with score terms: bias, softcap and score_mod on the visible tiles only.

The plan, the strided views of the items, the placement of results and the exact lse merge are
the engine's call loop (`qkv.backends.blocks.calls`); what changes is how one call's scores are made:

- an additive bias alone: PyTorch's CPU flash kernel with a *bias tile* as its float mask
  (the bias of the call's pairs, -inf where the mask hides a pair), float32 or wider whatever
  the input dtype. A bias that depends only on the diagonal (ALiBi, relative) on a
  shift-invariant plan is built once per tile shape and reused by every item and call.
- softcap or score_mod: a tile kernel of qkv's own, FlashAttention's algorithm on one tile in
  the accumulation dtype: s = scale * q k^T, the terms (`ScoreTerms.apply`), -inf where
  masked, lse = logsumexp(s), o = exp(s - lse) v; partial results merge by lse as in blocks.

Backward (FlashAttention-2's recomputation with the final lse): for each call the tile's
scores are recomputed *with autograd*, from detached copies of its queries, keys and bias
tensors, and given the gradient

    dS = P * (dP - delta + dlse),   P = exp(s - lse),  dP = dO V^T,  delta = rowsum(dO * O)

so torch.autograd.grad carries it through score_mod, the bias and the softcap to q, k and the
bias tensors, whatever the terms are; dV = P^T dO. The dlse term is the gradient of a returned
lse (zero when the caller does not use it). Calls run in a fixed order and add their shares
in place: two runs give bitwise equal gradients. Bias-only calls without a bias gradient or
dlse use the flash kernel's backward with the same bias tile, in the accumulation dtype on
each call's exact copies of low-precision inputs.

Tensors a score_mod closes over receive no gradient here (FlexAttention's captured buffers
do); `qkv.attention.dispatch` sends such a problem to the math path instead (`closes_over_grad`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from qkv._checks import broadcasts
from qkv._private import torch as private_torch
from qkv.backends import sinks as sinks_module
from qkv.backends.blocks import calls
from qkv.backends.blocks.planner import BlockPlan, Call
from qkv.backends.softmax import accumulation_dtype
from qkv.bias import Bias
from qkv.masks import Mask
from qkv.scores import ScoreMod, ScoreTerms

__all__ = ["closes_over_grad", "scored_block_attention"]

_NEG_INF = float("-inf")
# Bias tiles kept for reuse (by later items, calls and the backward pass), at most this many
# bytes: a window's few diagonals fit many times over, while a problem without a mask, whose
# every row group is a diagonal of its own, would otherwise keep an L x S bias.
_BIAS_CACHE_BYTES = 64 * 2**20
# Bias tensors up to this many elements (ALiBi's slopes, a relative table) are converted once to
# the accumulation dtype for the forward's bias tiles, so that a tile is computed in that dtype
# (the default ALiBi slopes are float64: a float64 tile and a conversion per tile otherwise).
# Larger ones (a dense bias) are read as they are, never copied whole.
_SMALL_BIAS_ELEMENTS = 2**16
# A call whose bias tile has a row offset (its largest value) at least this large in magnitude
# runs on the own tile kernel, which returns the lse in two parts (row max, rest): the flash
# kernel's one float32 lse rounds to 2**-10 here and has no digits for log(keys) at all from
# 2**24 on (a padding bias of -1e20 or finfo.min), which the exact merge and the backward's
# exp(s - lse) need. Below it the rounding is no larger than that of a float32 score of the
# same size.
_HUGE_OFFSET = 2.0**14


def closes_over_grad(score_mod: ScoreMod) -> bool:
    """Whether score_mod mixes in tensors that require grad (probed on one score): the engine
    would not differentiate them."""
    zero = torch.zeros((), dtype=torch.long)
    try:
        with torch.enable_grad():
            out = score_mod(torch.zeros(()), zero, zero, zero, zero)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.requires_grad


@dataclass(frozen=True, eq=False)
class _ScoredRun:
    """The plan, the mask's tiles (`block_calls.BlockRun`), the terms and the bias tiles built so far."""

    masks: calls.BlockRun
    terms: ScoreTerms
    # the bias that the forward's tiles read: ``terms.bias`` with its small tensors detached and
    # in the accumulation dtype (`_tile_bias`)
    tile_bias: Bias | None = None
    bias_tiles: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, bool]] = field(default_factory=dict)
    # whether calls run on the flash kernel (a bias alone: the plan's "bias_tiles") instead of
    # the own tile kernel ("score_tiles")
    flash: bool = False

    @property
    def plan(self) -> BlockPlan:
        return self.masks.plan


def _tile_bias(bias: Bias | None, acc: torch.dtype) -> Bias | None:
    """``bias`` reading detached copies of its small tensors in ``acc`` (see _SMALL_BIAS_ELEMENTS):
    for tiles built without autograd."""
    if bias is None:
        return None
    tensors = tuple(
        t.detach().to(acc) if t.is_floating_point() and t.numel() <= _SMALL_BIAS_ELEMENTS else t.detach() for t in bias.tensors()
    )
    return bias.with_tensors(tensors) if tensors else bias


def _owned(tile: torch.Tensor, bias: Bias) -> bool:
    """Whether ``tile`` is a tensor of its own that may be overwritten: dense (no broadcast
    stride) and sharing no memory with the bias's tensors (a bias may return a view of them)."""
    if not tile.is_contiguous():
        return False
    storage = tile.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != storage for t in bias.tensors())


def _indices(call: Call, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch row b (items | 1, 1, 1, 1), query rows (items | 1, 1, q_len, 1) and keys
    (items | 1, 1, 1, width) of the call's items."""
    j = torch.arange(call.items, device=device).view(-1, 1, 1, 1)  # (items, 1, 1, 1)
    rows = torch.arange(call.q_len, device=device).view(1, 1, -1, 1)  # (1, 1, q_len, 1)
    keys = torch.arange(call.width, device=device).view(1, 1, 1, -1)  # (1, 1, 1, width)
    if call.over_batch:
        return call.n + j, call.q0 + rows, call.k0 + keys
    b = torch.full((1, 1, 1, 1), call.n, device=device)
    return b, call.q0 + j * call.q_len + rows, call.k0 + j * call.k_step + keys


def _scores(
    q: torch.Tensor, k: torch.Tensor, call: Call, run: _ScoredRun, terms: ScoreTerms, acc: torch.dtype, inplace: bool = False
) -> torch.Tensor:
    """The call's scores (items, H, q_len, width) with the terms applied, before the mask."""
    H = q.shape[1]
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(run.masks.scale)  # (items, H, q_len, width)
    b, rows, keys = _indices(call, q.device)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)  # (1, H, 1, 1)
    return terms.apply(s, b, h, rows, keys, inplace=inplace)


def _bias_tile(run: _ScoredRun, call: Call, H: int, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The flash kernel's float mask of a call: bias (items | 1, H, q_len, width), -inf where
    hidden, in the accumulation dtype; the rows it hides entirely (items | 1, H, q_len), by the
    mask or by a bias of -inf; and whether a row's offset reaches _HUGE_OFFSET.

    A bias that depends on the diagonal only is the same for every item whose keys move with
    its rows (or that are batch rows of the same rows); with a shift-invariant mask (or none)
    the finished tile is built once per diagonal and shape, and kept for the later calls and
    the backward pass (up to _BIAS_CACHE_BYTES).
    """
    terms = run.terms
    assert terms.bias is not None
    mask = run.masks.mask
    shared = terms.shift_invariant and (call.items == 1 or call.over_batch or call.k_step == call.q_len)
    reusable = shared and (not call.masked or (mask is not None and mask.shift_invariant))
    key = (call.q0 - call.k0, call.q_len, call.width, call.masked)
    if reusable and key in run.bias_tiles:
        return run.bias_tiles[key]
    b, rows, keys = _indices(call, torch.device("cpu"))
    if shared:
        b, rows, keys = b[:1], rows[:1], keys[:1]  # the first item's tile serves every item
    h = torch.arange(H).view(1, H, 1, 1)  # (1, H, 1, 1)
    bias = run.tile_bias if run.tile_bias is not None else terms.bias
    with torch.no_grad():
        tile = bias.terms(b, h, rows, keys, terms.q_pos(b, rows)).to(acc)  # (items | 1, H | 1, q_len, width)
    if call.masked:
        mask_bias, _ = calls.mask_tile(run.masks, call, acc)
        tile = tile.add_(mask_bias) if _owned(tile, bias) and broadcasts(mask_bias.shape, tile.shape) else tile + mask_bias
    tile = tile.expand(tile.shape[0], H, call.q_len, call.width)
    # a bias of -inf hides keys as the mask does: rows are empty by either
    top = tile.amax(dim=-1)  # (items | 1, H, q_len)
    empty = top == _NEG_INF
    huge = bool((top.abs() >= _HUGE_OFFSET).logical_and_(~empty).any())
    if reusable:
        held = sum(t.shape[0] * H * t.shape[2] * t.shape[3] * t.element_size() for t, _, _ in run.bias_tiles.values())
        if held + tile.shape[0] * H * call.q_len * call.width * tile.element_size() <= _BIAS_CACHE_BYTES:
            run.bias_tiles[key] = (tile, empty, huge)
    return tile, empty, huge


def _own_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Call, run: _ScoredRun, acc: torch.dtype) -> calls.CallResult:
    """One call on qkv's tile kernel: o (items, H, q_len, Ep) and its lse in two parts, the row
    max and the rest (items, H, q_len) each, in acc (`merge.merge_split`)."""
    s = _scores(calls.item_view(q, call, keys=False), calls.item_view(k, call, keys=True), call, run, run.terms, acc, inplace=True)
    if call.masked or call.causal:  # this kernel has no is_causal: a causal square gets its tile
        # overwritten, not added to: a score_mod may return NaN or +inf on pairs the mask removes
        s.masked_fill_(calls.mask_tile(run.masks, call, acc)[0] == _NEG_INF, _NEG_INF)
    # softmax in place over the tile (no autograd here): s becomes exp(s - row max)
    row_max = s.amax(dim=-1, keepdim=True)  # (items, H, q_len, 1)
    empty = row_max == _NEG_INF
    s.sub_(row_max.masked_fill(empty, 0.0)).exp_()  # rows with no visible key: exp(-inf) = 0
    total = s.sum(dim=-1, keepdim=True)  # (items, H, q_len, 1)
    o = torch.matmul(s, calls.item_view(v, call, keys=True).to(acc))  # (items, H, q_len, Ep)
    o.div_(total.clamp(min=torch.finfo(acc).tiny))
    # (items, H, q_len) each, both -inf where nothing is visible: an offset of 0 there would
    # become the merged offset of a row whose other pieces sit at -1e20
    return o, row_max.squeeze(-1), total.log_().squeeze(-1)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _ScoredRun) -> calls.CallResult:
    """Output (N, H, L, Ep) and lse (N, H, L) in two parts, shift + rest, float32 or wider. The output is in the accumulation
    dtype (not rounded to q's), except where every value comes from the flash kernel, rounded
    already, and no row merges: then in q's dtype (`block_calls.run_calls`)."""
    H = q.shape[1]
    acc = accumulation_dtype(q.dtype)
    flash = private_torch.cpu_flash_attention

    def compute(call: Call) -> calls.CallResult:
        if not run.flash:
            return _own_forward(q, k, v, call, run, acc)
        tile, empty_rows, huge = _bias_tile(run, call, H, acc)
        if huge:
            return _own_forward(q, k, v, call, run, acc)
        o, lse_o = flash(
            calls.item_view(q, call, keys=False), calls.item_view(k, call, keys=True), calls.item_view(v, call, keys=True),
            0.0, call.causal, attn_mask=tile, scale=run.masks.scale,
        )[:2]  # (items, H, q_len, Ep), (items, H, q_len)
        # the kernel gives rows it sees no key of lse 0 (and output 0)
        return o, lse_o.masked_fill(empty_rows, _NEG_INF)

    # the own kernel's output is in the accumulation dtype, unrounded; the flash kernel's is in q's
    return calls.run_calls(q, run.plan, compute, rounded=run.flash, split=True)


def _own_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shift: torch.Tensor,
    rest: torch.Tensor,
    delta: torch.Tensor,
    grad_lse: torch.Tensor | None,
    call: Call,
    run: _ScoredRun,
    bias_tensors: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """One call's gradients: dq (items, H, q_len, Ep), dk, dv (items, H, width, Ep), d bias tensors.
    The final lse comes in two parts, shift + rest (N, H, L) each, finite (0 on empty rows)."""
    acc = shift.dtype
    q_t = calls.item_view(q, call, keys=False).detach().to(acc).requires_grad_(True)
    k_t = calls.item_view(k, call, keys=True).detach().to(acc).requires_grad_(True)
    leaves = tuple(t.detach().requires_grad_(True) for t in bias_tensors)
    terms = run.terms
    if leaves:
        assert terms.bias is not None
        terms = dataclasses.replace(terms, bias=terms.bias.with_tensors(leaves))
    with torch.enable_grad():
        s = _scores(q_t, k_t, call, run, terms, acc)  # (items, H, q_len, width)
    hidden = s.detach()
    if call.masked or call.causal:  # overwritten, as in the forward
        hidden = hidden.masked_fill(calls.mask_tile(run.masks, call, acc)[0] == _NEG_INF, _NEG_INF)
    row_shift = calls.row_view(shift, call).unsqueeze(-1)  # (items, H, q_len, 1)
    row_rest = calls.row_view(rest, call).unsqueeze(-1)  # (items, H, q_len, 1)
    # the offset first: a padding bias of -1e20 leaves the rest no digits in a single lse
    p = (hidden - row_shift).sub_(row_rest).exp_()  # (items, H, q_len, width): 0 where masked
    d_o = calls.item_view(grad_out, call, keys=False).to(acc)  # (items, H, q_len, Ep)
    dv = torch.matmul(p.transpose(-1, -2), d_o)  # (items, H, width, Ep)
    dp = torch.matmul(d_o, calls.item_view(v, call, keys=True).to(acc).transpose(-1, -2))  # (items, H, q_len, width)
    row_term = calls.row_view(delta, call)
    if grad_lse is not None:
        row_term = row_term - calls.row_view(grad_lse, call)
    ds = p * (dp - row_term.unsqueeze(-1))
    grads = torch.autograd.grad(s, (q_t, k_t, *leaves), ds, allow_unused=True)
    dq_t, dk_t = grads[0], grads[1]
    assert dq_t is not None and dk_t is not None
    return dq_t, dk_t, dv, tuple(grads[2:])


def _backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    shift: torch.Tensor,
    rest: torch.Tensor,
    run: _ScoredRun,
    bias_tensors: tuple[torch.Tensor, ...],
    bias_needs_grad: bool,
) -> tuple[torch.Tensor | None, ...]:
    """dq, dk, dv (N, H, *, Ep) and the gradients of the bias tensors, from the forward's lse in
    two parts, shift + rest (N, H, L) each."""
    N, H, L, Ep = q.shape
    S = k.shape[2]
    acc = accumulation_dtype(q.dtype)
    lse = shift + rest
    empty = lse == _NEG_INF
    # exp(-inf - 0) = 0 on rows with no key
    finite_lse, shift, rest = (x.masked_fill(empty, 0.0) for x in (lse, shift, rest))
    dq = torch.zeros(N, H, L, Ep, dtype=acc)
    dk = torch.zeros(N, H, S, Ep, dtype=acc)
    dv = torch.zeros(N, H, S, Ep, dtype=acc)
    d_bias = [torch.zeros_like(t, dtype=accumulation_dtype(t.dtype)) for t in bias_tensors]
    own = not run.flash or bias_needs_grad or grad_lse is not None
    delta = (grad_out.to(acc) * out).sum(dim=-1)  # (N, H, L), from the unrounded output
    flash_backward = private_torch.cpu_flash_attention_backward
    for call in run.plan.calls:
        tile, huge = None, False
        if not own:
            tile, _, huge = _bias_tile(run, call, H, acc)
        if own or huge:  # huge offsets: the flash kernel's single lse has lost the rest's digits
            gq, gk, gv, gb = _own_backward(
                grad_out, q, k, v, shift, rest, delta, grad_lse, call, run, bias_tensors if bias_needs_grad else ()
            )
            for total, g in zip(d_bias, gb, strict=False):
                if g is not None:
                    total += g
        else:
            # the kernel in the accumulation dtype on this call's exact copies of low-precision
            # inputs (as the block engine's backward): PyTorch's bf16 flash backward is slower,
            # and its per-call float32 buffers of varying sizes fragment the heap
            q_, o_ = (calls.item_view(x, call, keys=False).to(acc) for x in (q, out))  # (items, H, q_len, Ep)
            k_, v_ = (calls.item_view(x, call, keys=True).to(acc) for x in (k, v))  # (items, H, width, Ep)
            gq, gk, gv = flash_backward(
                calls.gradient_view(grad_out, call, acc), q_, k_, v_, o_, calls.row_view(finite_lse, call), 0.0,
                call.causal, attn_mask=tile, scale=run.masks.scale,
            )  # (items, H, q_len, Ep), (items, H, width, Ep) x 2
            del q_, k_, v_, o_
        calls.add_query_grads(dq, call, gq)
        calls.add_key_grads(dk, call, gk)
        calls.add_key_grads(dv, call, gv)
    grads_bias = tuple(g.to(t.dtype) if bias_needs_grad else None for g, t in zip(d_bias, bias_tensors, strict=True))
    accumulators = [dq, dk, dv]
    del dq, dk, dv
    return (*calls.rounded_in_turn(accumulators, Ep, (q.dtype, k.dtype, v.dtype)), *grads_bias)


class _ScoredBlockAttention(torch.autograd.Function):
    """Forward and backward of the engine with score terms; lse is differentiable."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _ScoredRun, sinks: torch.Tensor | None, *bias_tensors: torch.Tensor):  # type: ignore[override]
        # the backward's row term rowsum(dO * O) reads the unrounded output (where any is), as the block engine's
        out_acc, shift, rest = _forward(q, k, v, run)
        sink_state: tuple[torch.Tensor, ...] = ()
        if sinks is not None:
            # the sink-inclusive output and lse: the backward's formulas hold unchanged (qkv.backends.sinks)
            out_acc, rest, p_sink = sinks_module.fold(out_acc, rest, sinks, shift)
            sink_state = (p_sink, sinks)
        ctx.save_for_backward(q, k, v, out_acc, shift, rest, *sink_state, *bias_tensors)
        ctx.run = run
        ctx.sinks = len(sink_state)
        return out_acc.to(q.dtype), shift + rest

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):  # type: ignore[override]
        q, k, v, out, shift, rest, *saved = ctx.saved_tensors
        sink_state, bias_tensors = saved[: ctx.sinks], saved[ctx.sinks :]
        d_sinks = None
        if sink_state and ctx.needs_input_grad[4]:
            d_sinks = sinks_module.sink_gradient(grad_out, out, grad_lse, *sink_state)
        if grad_lse is not None and not bool(grad_lse.any()):
            grad_lse = None
        needs = ctx.needs_input_grad[5:]
        grads = _backward(grad_out, grad_lse, q, k, v, out, shift, rest, ctx.run, tuple(bias_tensors), any(needs))
        dq, dk, dv, *d_bias = grads
        return (dq, dk, dv, None, d_sinks, *(g if need else None for g, need in zip(d_bias, needs, strict=True)))


def scored_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    plan: BlockPlan,
    scale: float,
    terms: ScoreTerms,
    sinks: torch.Tensor | None = None,
    forward_kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with score terms over the tiles of ``plan``: (output (N, H, L, Ev) in q's
    dtype, lse (N, H, L) float32 or wider, differentiable).

    q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) on CPU; ``sinks`` (N | 1, H) float32 or
    wider, one attention-sink logit per head (`qkv.backends.sinks`), included in lse; gradients
    reach q, k, v, the sinks and the tensors of ``terms.bias``. ``forward_kernel``: the kernel
    `qkv.attention.dispatch` chose, "bias_tiles" (a bias alone, on the flash kernel) or
    "score_tiles"; None: by the terms.
    """
    bias_only = terms.softcap is None and terms.score_mod is None
    if forward_kernel is None:
        forward_kernel = "bias_tiles" if bias_only else "score_tiles"
    if forward_kernel not in ("bias_tiles", "score_tiles") or (forward_kernel == "bias_tiles" and not bias_only):
        raise ValueError(f"forward_kernel={forward_kernel!r} cannot apply {terms.describe()}")
    bias_tensors = terms.tensors()
    run = _ScoredRun(
        calls.BlockRun(plan, mask, scale), terms, _tile_bias(terms.bias, accumulation_dtype(q.dtype)),
        flash=forward_kernel == "bias_tiles",
    )
    out, lse = _ScoredBlockAttention.apply(*calls.kernel_inputs(q, k, v), run, sinks, *bias_tensors)
    return out[..., : v.shape[3]], lse
