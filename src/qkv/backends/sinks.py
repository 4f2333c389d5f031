"""Attention sinks on the tile paths: the sink joins a row's denominator after its pieces merge.

A sink is one more logit per head in every row's softmax denominator, with no value. The
block engine and FlexAttention compute, per row, the output O and log-sum-exp lse over the
visible keys only; the sink then enters exactly, once per row:

    lse' = log(exp(lse) + exp(sink)),   c = exp(lse - lse'),   O' = c O,   p_sink = exp(sink - lse')

(c is the share of the keys, 1 - p_sink.) Rows with no visible key stay empty: O' = 0 and
lse' = -inf, as on the math path, and they give the sink no gradient.

Backward. With O' and lse' saved instead of O and lse, FlashAttention-2's backward is exact
as it stands: the sink-inclusive probabilities are p_ij = exp(s_ij - lse'), and since the
sink carries no value, dS_ij = p_ij (dP_ij - delta_i) with delta_i = rowsum(dO_i * O'_i), the
same formula; a returned lse' adds dlse_i p_ij as before. The sink's own gradient is

    d sink = sum over rows i of p_sink_i (dlse_i - delta_i),

summed over the rows (and the batch rows the sink is shared by) in a fixed order, in the
sinks' dtype or the accumulation dtype, whichever is wider: two runs give equal bits.

`SinkFold` is the same fold as an autograd Function of (O, lse, sinks), for a kernel whose
output and lse are differentiable but which saves its own (FlexAttention).
"""

from __future__ import annotations

import torch

__all__ = ["SinkFold", "fold", "key_share", "sink_gradient"]

_NEG_INF = float("-inf")


def _sink_rows(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """sinks (N | 1, H) -> (N | 1, H, 1) in lse's dtype, to meet lse (N, H, L)."""
    return sinks.detach().to(lse.dtype).unsqueeze(-1)  # (N | 1, H, 1)


def fold(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, shift: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(O' (N, H, L, Ev), lse' (N, H, L), p_sink (N, H, L)) from the keys' output O (N, H, L, Ev),
    their lse (N, H, L, float32 or wider) and sinks (N | 1, H); O' in lse's dtype. No autograd.

    With ``shift`` (N, H, L), the lse comes in two parts (`merge.merge_split`): ``lse`` is the
    rest relative to the row offset ``shift``, and so is the returned lse'; the offset is kept."""
    with torch.no_grad():
        sink = _sink_rows(sinks, lse)  # (N | 1, H, 1)
        empty = lse == _NEG_INF  # (N, H, L)
        if shift is not None:
            empty |= shift == _NEG_INF
            sink = sink - shift.masked_fill(empty, 0.0)  # (N, H, L): the sink relative to the offset
        folded = torch.logaddexp(lse, sink).masked_fill_(empty, _NEG_INF)  # (N, H, L)
        safe = folded.masked_fill(empty, 0.0)  # exp(-inf - 0) = 0 for the keys' share of an empty row
        share = torch.exp(lse - safe)  # (N, H, L): c
        p_sink = torch.exp(sink - safe).masked_fill_(empty, 0.0)  # (N, H, L)
        return out.to(lse.dtype) * share.unsqueeze(-1), folded, p_sink


def key_share(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """c = exp(lse - lse') (N, H, L): the keys' share of a row, to scale weights that sum to 1
    over the keys; 0 on rows with no visible key. No autograd."""
    with torch.no_grad():
        folded = torch.logaddexp(lse, _sink_rows(sinks, lse))  # (N, H, L)
        return torch.exp(lse - folded.masked_fill(lse == _NEG_INF, 0.0))


def sink_gradient(
    grad_out: torch.Tensor | None,
    out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    p_sink: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """d sinks (N | 1, H) in the sinks' dtype from the gradients of O' (N, H, L, >= Ev) and lse'
    (N, H, L), either may be None, the saved O' and p_sink (module docstring). ``out`` and
    ``grad_out`` may carry padding columns beyond Ev: both are zero there or ``out`` is."""
    wide = torch.promote_types(p_sink.dtype, sinks.dtype)
    per_row = torch.zeros_like(p_sink, dtype=wide)  # (N, H, L)
    if grad_out is not None:
        cols = min(grad_out.shape[-1], out.shape[-1])
        delta = (grad_out[..., :cols].to(p_sink.dtype) * out[..., :cols].to(p_sink.dtype)).sum(dim=-1)  # (N, H, L)
        per_row -= delta.to(wide)
    if grad_lse is not None:
        per_row += grad_lse.to(wide)
    # 0 on empty rows, whatever the incoming gradient holds there (a NaN times 0 is not 0)
    per_row = (per_row * p_sink.to(wide)).masked_fill_(p_sink == 0, 0.0)
    total = per_row.sum(dim=-1)  # (N, H)
    if sinks.shape[0] == 1:
        total = total.sum(dim=0, keepdim=True)  # (1, H): one sink shared by every batch row
    return total.to(sinks.dtype)


class SinkFold(torch.autograd.Function):
    """(O, lse, sinks) -> (O', lse'), differentiable in all three (module docstring): for
    kernels that carry lse's gradient themselves."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):  # type: ignore[override]
        folded_out, folded_lse, p_sink = fold(out, lse, sinks)
        share = torch.exp(lse - folded_lse.masked_fill(lse == _NEG_INF, 0.0))  # (N, H, L): c, 0 on empty rows
        ctx.save_for_backward(folded_out, share, p_sink, sinks)
        ctx.out_dtype = out.dtype
        ctx.set_materialize_grads(False)
        return folded_out.to(out.dtype), folded_lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None):  # type: ignore[override]
        folded_out, share, p_sink, sinks = ctx.saved_tensors
        acc = share.dtype
        d_out = d_lse = None
        # lse' = lse + log(1 + exp(sink - lse)): d lse'/d lse = c; O' = c O with dc/dlse = c p_sink
        # (O = O' / c), so d lse = c dlse' + p_sink rowsum(dO' * O')
        rows = torch.zeros_like(share)  # (N, H, L)
        if grad_out is not None:
            d_out = (grad_out.to(acc) * share.unsqueeze(-1)).to(ctx.out_dtype)
            rows += p_sink * (grad_out.to(acc) * folded_out).sum(dim=-1)
        if grad_lse is not None:
            rows += share * grad_lse.to(acc).masked_fill(share == 0, 0.0)
        if ctx.needs_input_grad[1]:
            d_lse = rows
        d_sinks = sink_gradient(grad_out, folded_out, grad_lse, p_sink, sinks) if ctx.needs_input_grad[2] else None
        return d_out, d_lse, d_sinks
