"""The CPU tile engine: attention that computes only the tiles a structured mask leaves visible.

The inputs are those of `qkv._problem`: q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev).
`qkv.kernels.tile_plan` cuts the visible part of the score matrix into pieces and groups
them into kernel calls; each call runs PyTorch's CPU flash-attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``) on strided views of many row groups
at once, with no mask for fully visible pieces and with the mask's tile (an additive -inf
bias) for partial ones.

Forward. Rows whose keys are split over several pieces get each piece's output
o_p and log-sum-exp lse_p, merged exactly (FlashAttention's rescaling, algorithm 1):

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Backward (a custom autograd Function, FlashAttention-2's recomputation): for every call the
kernel's backward is given the *final* output and lse of its rows. With those, the
probabilities exp(s - lse) and the row term D = rowsum(dO * O) are the global ones, so each
piece's dq, dk, dv is exactly its share and the shares simply add up. The returned lse is
differentiable too: its gradient enters as one extra head column (`qkv.kernels.lse_grad`).

Memory: besides the output and lse (O(n)), one call's temporaries at a time, bounded by
`TileConfig.call_bytes` (O(n x block)), and mask tiles kept for reuse, bounded by the same
figure; never an L x S tensor, whatever the mask.

Empty rows (no visible key): output 0, lse -inf, zero gradients, no NaN. The kernel itself
returns lse = 0 for a row with no visible key in its tile, so those rows are set to -inf
from the tile mask before any merge.

References: Dao et al., "FlashAttention" (2022), algorithm 1 and section 3.3; Dao,
"FlashAttention-2" (2023), algorithm 2 (backward from the saved log-sum-exp).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qkv.kernels.heads import expand_kv_heads
from qkv.kernels.lse_grad import with_lse_gradient
from qkv.kernels.matmul_backward import call_gradients, suits
from qkv.kernels.scores import ScoreTerms
from qkv.kernels.softmax import accumulation_dtype
from qkv.kernels.tile_plan import Call, Piece, TilePlan
from qkv.masks import Mask

__all__ = ["engine_extra_bytes", "flash_kernel_available", "tile_attention", "tile_lse", "tile_weights"]

_NEG_INF = float("-inf")
# The dtype the backward kernel runs in, by input dtype. PyTorch's CPU flash backward in
# bfloat16 converts every tile to float32 and back and runs at about 60 % of its float32
# rate (one core, sliding window tiles 192 x 704: 48 vs 82 GFLOP/s, benchmarks/sparse.py),
# so low-precision inputs are upcast once (exactly) and the float32 kernel runs; the
# gradients are rounded to the input dtype at the end.
_BACKWARD_DTYPE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def flash_kernel_available() -> bool:
    """Whether this PyTorch has the CPU flash-attention kernels the engine calls."""
    ops = torch.ops.aten
    return hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu") and hasattr(
        ops, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


@dataclass(eq=False)
class _Run:
    """What the autograd Function needs besides the tensors, and the tiles kept for reuse."""

    plan: TilePlan
    mask: Mask | None
    scale: float
    tiles: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tile_bytes: int = 0  # bytes held by ``tiles``, at most plan.config.call_bytes


def _items(x: torch.Tensor, call: Call, keys: bool) -> torch.Tensor:
    """Strided view of x (N, H, T, D) (any strides, last dim contiguous) for the items of
    ``call``: (items, H, len, D). Query views step by q_len rows per item, key views by
    call.k_step keys (0 or less than the width: windows overlap); nothing is copied."""
    start = call.k0 if keys else call.q0
    length = call.width if keys else call.q_len
    if call.over_batch:
        return x[call.n : call.n + call.items, :, start : start + length]  # (items, H, len, D)
    step = call.k_step if keys else call.q_len
    s_n, s_h, s_t, s_d = x.stride()
    offset = x.storage_offset() + call.n * s_n + start * s_t
    return x.as_strided((call.items, x.shape[1], length, x.shape[3]), (step * s_t, s_h, s_t, s_d), offset)  # (items, H, len, D)


def _rows(x: torch.Tensor, call: Call) -> torch.Tensor:
    """Strided view of per-row data x (N, H, L) for the items of ``call``: (items, H, q_len)."""
    if call.over_batch:
        return x[call.n : call.n + call.items, :, call.q0 : call.q0 + call.q_len]  # (items, H, q_len)
    s_n, s_h, s_l = x.stride()
    offset = x.storage_offset() + call.n * s_n + call.q0 * s_l
    return x.as_strided((call.items, x.shape[1], call.q_len), (call.q_len * s_l, s_h, s_l), offset)  # (items, H, q_len)


def _tile(run: _Run, call: Call, L: int, S: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The additive bias (items | 1, H | 1, q_len, width) of a masked call, and its empty rows.

    When every item sees the same tile (a shift-invariant mask whose keys move with the
    rows, one item, or items that are batch rows of a mask without a batch axis), the tile
    is built once and broadcast. Tiles of a shift-invariant mask repeat along diagonals, so
    they are kept for the other calls and the backward pass, up to ``call_bytes`` in all;
    any other tile is rebuilt when needed (keeping every tile of, say, unsorted documents
    would hold O(L x S) bytes).
    """
    mask = run.mask
    assert mask is not None  # plans without a mask have no masked calls
    shift = mask.shift_invariant and call.k_step == call.q_len
    shared = call.items == 1 or shift or (call.over_batch and mask.batch is None)
    b0 = call.n if mask.batch is not None else 0
    key = (call.q0 - call.k0, call.q_len, call.width, dtype)
    keep = shared and mask.shift_invariant
    if keep and key in run.tiles:
        return run.tiles[key]
    count = 1 if shared else call.items
    j = torch.arange(count).view(count, 1, 1, 1)  # (count, 1, 1, 1): item index
    if call.over_batch:
        b = (b0 + j) if mask.batch is not None else torch.zeros_like(j)
        q_first, k_first = torch.full_like(j, call.q0), torch.full_like(j, call.k0)
    else:
        b, q_first, k_first = torch.full_like(j, b0), call.q0 + j * call.q_len, call.k0 + j * call.k_step
    q_idx = q_first + torch.arange(call.q_len).view(1, 1, -1, 1)  # (count, 1, q_len, 1)
    k_idx = k_first + torch.arange(call.width).view(1, 1, 1, -1)  # (count, 1, 1, width)
    intervals = run.plan.intervals
    if intervals is not None:
        # the plan knows each query's keys lo..hi: two comparisons instead of the mask's rule
        lo, hi = intervals
        rows = (b if lo.shape[0] > 1 else torch.zeros_like(b), q_idx)
        lo_q, hi_q = lo[rows], hi[rows]  # (count, 1, q_len, 1) each
        visible = (k_idx >= lo_q) & (k_idx <= hi_q)  # (count, 1, q_len, width)
        empty = ((hi_q < k_first) | (lo_q > k_first + call.width - 1) | (lo_q > hi_q)).squeeze(-1)  # (count, 1, q_len)
    else:
        heads = mask.heads or 1
        h = torch.arange(heads).view(1, heads, 1, 1)  # (1, heads, 1, 1)
        visible = torch.broadcast_to(mask.visible(b, h, q_idx, k_idx, L, S), (count, heads, call.q_len, call.width))
        empty = ~visible.any(dim=-1)  # (count, heads, q_len)
    bias = torch.where(visible, torch.zeros((), dtype=dtype), torch.full((), _NEG_INF, dtype=dtype))
    result = bias, empty  # (count, heads | 1, q_len, width), (count, heads | 1, q_len)
    size = bias.numel() * bias.element_size() + empty.numel()
    if keep and run.tile_bytes + size <= run.plan.config.call_bytes:
        run.tiles[key] = result
        run.tile_bytes += size
    return result


def _row_slab(x: torch.Tensor, call: Call) -> torch.Tensor:
    """Rows covered by ``call`` of x stored as (N, L, H, ...): (items * q_len, H, ...) or (items, q_len, H, ...)."""
    if call.over_batch:
        return x[call.n : call.n + call.items, call.q0 : call.q0 + call.q_len]  # (items, q_len, H, ...)
    # adjacent row groups: the rows of the items are contiguous
    return x[call.n, call.q0 : call.q0 + call.items * call.q_len]  # (items * q_len, H, ...)


def _as_slab(y: torch.Tensor, call: Call) -> torch.Tensor:
    """Per-item results (items, H, q_len, ...) in the layout of `_row_slab`."""
    moved = y.transpose(1, 2)  # (items, q_len, H, ...): the kernel's own memory order, no copy
    return moved if call.over_batch else moved.flatten(0, 1)  # (items * q_len, H, ...)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor) -> None:
    """In place: (out, lse) <- the exact combination of two partial softmaxes (module docstring)."""
    new = torch.logaddexp(lse, lse_o)
    safe = new.masked_fill(new == _NEG_INF, 0.0)  # rows still empty: both weights are exp(-inf) = 0
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o * torch.exp(lse_o - safe).unsqueeze(-1))
    lse.copy_(new)


def _run_calls(
    q: torch.Tensor, plan: TilePlan, compute: Callable[[Call], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every call of ``plan`` and place or merge its (o, lse_o) into the output rows.

    ``compute(call)`` returns the call's output (items, H, q_len, D) and lse (items, H, q_len).
    Output (N, H, L, D) and lse (N, H, L), both in the accumulation dtype (float32 or wider:
    callers round the output to q's dtype, the backward may read it unrounded). Both are stored
    query-row major, (N, L, H, D) and (N, L, H), the order in which the kernel writes its
    items, so that placing a call's results is a contiguous copy. Shared by this engine and the
    score-term engine (`qkv.kernels.scored`), which differ only in how a call is computed.
    """
    N, H, L, D = q.shape
    acc_dtype = accumulation_dtype(q.dtype)
    out = torch.empty(N, L, H, D, dtype=acc_dtype)
    lse = torch.empty(N, L, H, dtype=acc_dtype)
    # rows that no piece covers, and rows that calls merge into, start as "nothing seen yet":
    # output 0, lse -inf (rows with no visible key stay so)
    per_batch = len(plan.uncovered) > 1
    for n in range(N):
        for first, stop in plan.uncovered[n if per_batch else 0]:
            out[n, first:stop] = 0.0
            lse[n, first:stop] = _NEG_INF
    for call in plan.calls:
        if call.merge:
            _row_slab(out, call).zero_()
            _row_slab(lse, call).fill_(_NEG_INF)
    for call in plan.calls:
        o, lse_o = compute(call)
        out_slab, lse_slab = _row_slab(out, call), _row_slab(lse, call)
        if call.merge:
            _merge(out_slab, lse_slab, _as_slab(o, call).to(acc_dtype), _as_slab(lse_o, call).to(acc_dtype))
        else:
            out_slab.copy_(_as_slab(o, call))
            lse_slab.copy_(_as_slab(lse_o, call))
    return out.transpose(1, 2), lse.transpose(1, 2)  # (N, H, L, D), (N, H, L)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _Run) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (N, H, L, D) and lse (N, H, L), float32 or wider, from q, k, v (N, H, *, D): the
    flash kernel per call."""
    L, S = q.shape[2], k.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def compute(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        bias, empty_rows = _tile(run, call, L, S, q.dtype) if call.masked else (None, None)
        o, lse_o = flash(
            _items(q, call, keys=False), _items(k, call, keys=True), _items(v, call, keys=True),
            0.0, False, attn_mask=bias, scale=run.scale,
        )[:2]  # (items, H, q_len, D), (items, H, q_len)
        if empty_rows is not None:
            lse_o = lse_o.masked_fill(empty_rows, _NEG_INF)
        return o, lse_o

    return _run_calls(q, run.plan, compute)


def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    run: _Run,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (N, H, *, D) from the final output and lse (FlashAttention-2 recomputation),
    with the gradient of lse (N, H, L) added when ``grad_lse`` is given.

    bf16 calls whose pieces hold all keys of their rows take the matrix-product backward
    (`qkv.kernels.matmul_backward`) on the inputs as they are; the other calls run the flash
    kernel, low-precision inputs on exact float32 copies (`_BACKWARD_DTYPE`).
    """
    dtypes = q.dtype, k.dtype, v.dtype
    D_in = q.shape[3]
    if grad_lse is not None:
        q, k, v, out, grad_out = with_lse_gradient(q, k, v, out, grad_out, grad_lse)  # (N, H, *, D + 1)
    N, H, L, D = q.shape
    S = k.shape[2]
    acc_dtype = accumulation_dtype(q.dtype)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    by_products = [suits(q.dtype, call.merge, grad_lse is not None) for call in run.plan.calls]
    kernel_dtype = _BACKWARD_DTYPE.get(q.dtype, q.dtype)
    if not all(by_products):
        # the flash kernel's inputs (N, H, *, D), converted once for all its calls
        flash_in = tuple(x.to(kernel_dtype) for x in (grad_out, q, k, v, out))
    # rows without a visible key: any finite normalizer keeps exp(-inf - lse) = 0 there
    lse = lse.masked_fill(lse == _NEG_INF, 0.0)
    dq = torch.zeros(N, H, L, D, dtype=acc_dtype)
    dk = torch.zeros(N, H, S, D, dtype=acc_dtype)
    dv = torch.zeros(N, H, S, D, dtype=acc_dtype)
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    for call, products in zip(run.plan.calls, by_products, strict=True):
        if products:
            # bf16 products on the matrix units (qkv.kernels.matmul_backward), not the flash kernel
            bias, empty = _tile(run, call, L, S, q.dtype) if call.masked else (None, None)
            gq, gk, gv = call_gradients(
                _items(grad_out, call, keys=False), _items(q, call, keys=False),
                _items(k, call, keys=True), _items(v, call, keys=True), bias, empty, run.scale, run.plan.config.call_bytes,
            )  # (items, H, q_len, D), (items, H, width, D) x 2
        else:
            g_, q_, k_, v_, o_ = flash_in
            bias = _tile(run, call, L, S, kernel_dtype)[0] if call.masked else None
            gq, gk, gv = flash_backward(
                _items(g_, call, keys=False), _items(q_, call, keys=False),
                _items(k_, call, keys=True), _items(v_, call, keys=True),
                _items(o_, call, keys=False), _rows(lse, call), 0.0, False, attn_mask=bias, scale=run.scale,
            )  # (items, H, q_len, D), (items, H, width, D) x 2
        _add_rows(dq, call, gq)
        _add_keys(dk, call, gk)
        _add_keys(dv, call, gv)
    return dq[..., :D_in].to(dtypes[0]), dk[..., :D_in].to(dtypes[1]), dv[..., :D_in].to(dtypes[2])


def _add_rows(dest: torch.Tensor, call: Call, grad: torch.Tensor) -> None:
    """dest (N, H, L, D) += the per-item query gradients grad (items, H, q_len, D)."""
    if call.over_batch:
        dest[call.n : call.n + call.items, :, call.q0 : call.q0 + call.q_len] += grad
        return
    rows = dest[call.n, :, call.q0 : call.q0 + call.items * call.q_len]  # (H, items * q_len, D)
    rows += grad.transpose(0, 1).reshape(rows.shape)  # (H, items * q_len, D)


def _add_keys(dest: torch.Tensor, call: Call, grad: torch.Tensor) -> None:
    """dest (N, H, S, D) += the per-item key gradients grad (items, H, width, D); windows may overlap."""
    if call.over_batch:
        dest[call.n : call.n + call.items, :, call.k0 : call.k0 + call.width] += grad
        return
    H, D = grad.shape[1], grad.shape[3]
    positions = call.k0 + call.k_step * torch.arange(call.items)[:, None] + torch.arange(call.width)[None, :]
    flat = grad.transpose(0, 1).reshape(H, call.items * call.width, D)  # (H, items * width, D)
    dest[call.n].index_add_(1, positions.reshape(-1), flat.to(dest.dtype))  # positions: (items * width,)


class _TileAttention(torch.autograd.Function):
    """Forward and backward of the tile engine; both the output and lse are differentiable."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: _Run):  # type: ignore[override]
        out_acc, lse = _forward(q, k, v, run)
        out = out_acc.to(q.dtype)
        # the backward's row term rowsum(dO * O) reads the unrounded output
        ctx.save_for_backward(q, k, v, out_acc, lse)
        ctx.run = run
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        with torch.autocast(q.device.type, enabled=False):  # float32 accumulators stay float32
            dq, dk, dv = _backward(grad_out, q, k, v, out, lse, ctx.run, grad_lse)
        return dq, dk, dv, None


def tile_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    plan: TilePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the tiles of ``plan``: (output (N, H, L, Ev) in q's dtype, lse (N, H, L)).

    q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) on CPU. Both results are differentiable
    in q, k, v; lse is float32 (float64 for float64 inputs).
    """
    H, E, Ev = q.shape[1], q.shape[3], v.shape[3]
    D = max(E, Ev)
    # the kernel wants one head size for q, k and v: zero columns change no score and no output
    q_, k_ = (F.pad(q, (0, D - E)), F.pad(k, (0, D - E))) if E < D else (q, k)
    v_ = F.pad(v, (0, D - Ev)) if Ev < D else v
    k_, v_ = expand_kv_heads(k_, H), expand_kv_heads(v_, H)
    q_, k_, v_ = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_, k_, v_))
    out, lse = _TileAttention.apply(q_, k_, v_, _Run(plan, mask, scale))
    return out[..., :Ev], lse


def _piece_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: Mask | None,
    plan: TilePlan,
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
                if p.masked:
                    assert mask is not None  # masked pieces come from a mask
                    b = torch.full((1, 1, 1), n if mask.batch is not None else 0, device=device)
                    h = heads.view(-1, 1, 1) if mask.heads is not None else torch.zeros(1, 1, 1, dtype=torch.long, device=device)  # (h | 1, 1, 1)
                    keys = torch.arange(p.k0, p.k1, device=device).view(1, 1, -1)  # (1, 1, width)
                    visible = mask.visible(b, h, q_rows.view(1, -1, 1), keys, L, S)  # q_rows as (1, r, 1)
                    s = s.masked_fill(~torch.broadcast_to(visible, s.shape), _NEG_INF)
                scored.append((p, s))
            yield n, where, scored


def tile_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: Mask | None,
    plan: TilePlan,
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


def tile_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: Mask | None,
    plan: TilePlan,
    scale: float,
    heads: torch.Tensor,
    rows: torch.Tensor,
    lse: torch.Tensor | None = None,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """Exact probabilities (N, len(heads), len(rows), S) of chosen heads and query rows.

    Computed block by block over the non-empty pieces of each query block only: with the
    saved ``lse`` (N, H, L) of the forward pass as exp(s - lse), or, without it, from a
    log-sum-exp over the same pieces first. No gradient; float32 or wider.
    """
    N, S = q.shape[0], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    weights = torch.zeros(N, len(heads), len(rows), S, dtype=acc, device=q.device)
    with torch.no_grad():
        for n, where, scored in _piece_scores(q, k, mask, plan, scale, heads, rows, terms):
            if not scored:
                continue
            if lse is None:
                row_lse = torch.logsumexp(torch.cat([s for _, s in scored], dim=-1), dim=-1)  # (h, r)
            else:
                row_lse = lse[n][heads][:, rows[where]].to(acc)  # (h, r)
            # rows with no visible key: every score is -inf, any finite normalizer gives 0
            safe = row_lse.masked_fill(row_lse == _NEG_INF, 0.0).unsqueeze(-1)  # (h, r, 1)
            for p, s in scored:
                weights[n, :, where, p.k0 : p.k1] = torch.exp(s - safe)
        # exp(s - lse) carries lse's rounding (about eps * |s|) into every weight of a row; the
        # row sum is 1 in exact arithmetic, so dividing by it removes that common error
        sums = weights.sum(dim=-1, keepdim=True)  # (N, h, r, 1)
        weights = weights / sums.masked_fill(sums == 0, 1.0)
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
    plan: TilePlan | None,
    call_bytes: int,
    n_tiles: int,
    mask_heads: int,
    reuses_tiles: bool,
) -> int:
    """Memory the engine allocates beyond inputs and output (an estimate), with or without
    score terms (`qkv.kernels.scored`): the lse, a float32 accumulator for a low-precision
    output, keys and values expanded to every head / padded to max(E, Ev), then

    - with its ``plan``: the largest call's temporaries (`TilePlan.max_call_bytes`) and, for a
      mask whose tiles repeat along the diagonals (``reuses_tiles``), the tiles kept for reuse
      (`_tile`), at most ``call_bytes``;
    - without (a layout still to be found when attention runs): one call's temporaries, at
      most ``call_bytes``, and the layout's byte per tile (``n_tiles``).
    """
    width = max(E, Ev)
    itemsize = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=accumulation_dtype(dtype)).element_size()
    extra = N * H * L * acc  # lse
    extra += N * H * L * width * acc if acc != itemsize else 0
    if G != H or Ev != E:
        extra += 2 * N * H * S * width * itemsize
    if plan is None:
        return extra + call_bytes + n_tiles
    extra += plan.max_call_bytes(H, width, itemsize, mask_heads)
    masked = [c for c in plan.calls if c.masked]
    if masked and reuses_tiles:
        tile = max(c.q_len * c.width for c in masked) * (itemsize + 1) * mask_heads
        extra += min(call_bytes, tile * len(masked))
    return extra
