"""Dense paths: the explicit "math" path and PyTorch's fused SDPA kernels.

Both take the flattened problem of `qkv.attention.problem`: q (N, H, L, E), k (N, G, S, E),
v (N, G, S, Ev) and a mask that is None, is_causal, or a tensor (N | 1, H | 1, L, S).

- `math_attention` materializes scores and weights in float32 or wider (the softmax state
  of docs/design.md) and reads grouped key/value heads without copying them.
- `fused_attention` calls `torch.nn.functional.scaled_dot_product_attention`, the kernels
  people run. Query rows with no visible key are made harmless before the call (their mask
  row is opened) and zeroed after it, so neither the forward nor the backward sees a NaN.
  On CPU, when the caller needs the log-sum-exp, it calls the flash kernel that SDPA
  dispatches to (`aten._scaled_dot_product_flash_attention_for_cpu`), which returns it,
  inside an autograd Function whose backward also carries lse's gradient
  (`qkv.backends.lse_grad`).

Float masks reach every kernel in the accumulation dtype (float32, float64 for float64
inputs), never rounded to a float16 / bfloat16 input's dtype: 7e4 stays finite, -1e5 stays
-1e5 and a bias keeps its float32 digits (PyTorch's CPU kernels add a float32 mask to
low-precision scores in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv._private import torch as private_torch
from qkv.backends.blocks.calls import kernel_inputs
from qkv.backends.lse_grad import with_lse_gradient
from qkv.backends.softmax import (
    accumulation_bytes,
    accumulation_dtype,
    causal_kernel_scale,
    masked_softmax,
)
from qkv.scores import ScoreTerms

__all__ = [
    "WIDE_BACKWARD_MAX_HEAD_DIM",
    "attention_weights_dense",
    "dense_lse",
    "flash_kernel_available",
    "fused_attention",
    "fused_extra_bytes",
    "fused_lse_available",
    "math_attention",
    "math_extra_bytes",
    "scores_with_mask",
    "wide_backward_wins",
]

_NEG_INF = float("-inf")


def scores_with_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal_offset: int | None,
    terms: ScoreTerms | None = None,
    heads: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """Scaled scores (N, G, r, L, S), then the score terms, then masked entries at -inf, in
    the accumulation dtype. For the terms and the causal rule, ``heads`` are the query head ids
    of q's heads, ``rows`` the query row ids of its L rows (default: all of them, in order) and
    k's S keys are the keys ``first_key``, ``first_key + 1``, ... of the problem."""
    N, H, L, E = q.shape
    G, S = k.shape[1], k.shape[2]
    acc = accumulation_dtype(q.dtype)
    q5 = q.to(acc).reshape(N, G, H // G, L, E)  # (N, G, r, L, E): query heads grouped by kv head
    k5 = k.to(acc).unsqueeze(2)  # (N, G, 1, S, E)
    scores = torch.matmul(q5, k5.transpose(-1, -2)) * scale  # (N, G, r, L, S)
    device = q.device
    row_ids = torch.arange(L, device=device) if rows is None else rows
    i = row_ids.view(1, 1, 1, L, 1)  # (1, 1, 1, L, 1)
    j = torch.arange(first_key, first_key + S, device=device).view(1, 1, 1, 1, S)  # (1, 1, 1, 1, S)
    if terms is not None and terms.active:
        head_ids = torch.arange(H, device=device) if heads is None else heads
        b = torch.arange(N, device=device).view(N, 1, 1, 1, 1)  # (N, 1, 1, 1, 1)
        h = head_ids.view(1, G, H // G, 1, 1)  # (1, G, r, 1, 1)
        scores = terms.apply(scores, b, h, i, j)
    if causal_offset is not None:
        # query i may see key j when j <= i + offset (offset S - L is bottom-right, 0 top-left)
        scores = scores.masked_fill(j > i + causal_offset, _NEG_INF)
    if mask is not None:
        m = _group_heads(mask, G, H)  # (N | 1, G | 1, r | 1, L, S)
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, _NEG_INF)
        else:
            scores = scores + m.to(acc)
    return scores


def _group_heads(mask: torch.Tensor, G: int, H: int) -> torch.Tensor:
    """(N | 1, H | 1, L, S) -> (N | 1, G | 1, r | 1, L, S) to match grouped query heads."""
    n, h, L, S = mask.shape
    if h == 1:
        return mask.unsqueeze(1)  # (N | 1, 1, 1, L, S)
    return mask.reshape(n, G, H // G, L, S)  # (N | 1, G, r, L, S)


def attention_weights_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal_offset: int | None = None,
    terms: ScoreTerms | None = None,
    heads: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact probabilities (N, H, L, S) and lse (N, H, L), in the accumulation dtype; with
    ``sinks`` (N | 1, H), one attention-sink logit per head in every row's denominator."""
    N, H, L, _ = q.shape
    G, S = k.shape[1], k.shape[2]
    scores = scores_with_mask(q, k, mask, scale, causal_offset, terms, heads, rows)  # (N, G, r, L, S)
    sink = None if sinks is None else sinks.to(scores.dtype).reshape(sinks.shape[0], G, H // G, 1, 1)  # (N | 1, G, r, 1, 1)
    weights, lse = masked_softmax(scores, sink)
    return weights.reshape(N, H, L, S), lse.reshape(N, H, L)  # (N, H, L, S), (N, H, L)


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    causal_offset: int | None = None,
    dropout: float = 0.0,
    generator: torch.Generator | None = None,
    terms: ScoreTerms | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v, every intermediate materialized.

    ``causal_offset``: query i may see key j only when j <= i + offset. ``sinks`` (N | 1, H):
    one attention-sink logit per head in every row's denominator (`masked_softmax`). Returns
    (output (N, H, L, Ev) in q's dtype, weights (N, H, L, S) as used for the output, i.e. after
    dropout, and lse (N, H, L)).
    """
    N, H, L, _ = q.shape
    G = k.shape[1]
    S, Ev = v.shape[2], v.shape[3]
    acc = accumulation_dtype(q.dtype)
    sink = None if sinks is None else sinks.to(acc).reshape(sinks.shape[0], G, H // G, 1, 1)  # (N | 1, G, r, 1, 1)
    scores = scores_with_mask(q, k, mask, scale, causal_offset, terms)  # (N, G, r, L, S)
    weights, lse = masked_softmax(scores, sink)  # (N, G, r, L, S), (N, G, r, L)
    if dropout > 0.0:
        keep = torch.rand(weights.shape, generator=generator, device=weights.device, dtype=acc) >= dropout
        weights = weights * keep / (1.0 - dropout)
    out = torch.matmul(weights, v.to(acc).unsqueeze(2))  # (N, G, r, L, Ev)
    return (
        out.reshape(N, H, L, Ev).to(q.dtype),  # (N, H, L, Ev)
        weights.reshape(N, H, L, S),  # (N, H, L, S)
        lse.reshape(N, H, L),  # (N, H, L)
    )


def math_extra_bytes(dtype: torch.dtype, *, N: int, H: int, L: int, S: int) -> int:
    """Memory `math_attention` allocates beyond inputs and output: scores, exponentials and
    weights, each (N, H, L, S) in the accumulation dtype."""
    return 3 * N * H * L * S * accumulation_bytes(dtype)


# PyTorch's CPU flash kernel works on query blocks of 256 rows (64 for short queries) and key
# blocks of 512; one block of scores per thread is its extra memory (aten/src/ATen/native/cpu).
_CPU_FLASH_Q_BLOCK = 256
_CPU_FLASH_KV_BLOCK = 512


def fused_extra_bytes(dtype: torch.dtype, device: torch.device, *, N: int, H: int, L: int, S: int, Ev: int) -> int:
    """Memory SDPA allocates beyond inputs, output and the mask it is given (an estimate): a
    block of scores and two of outputs per thread, and the (N, H, L) lse."""
    acc = accumulation_bytes(dtype)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    q_block, kv_block = min(L, _CPU_FLASH_Q_BLOCK), min(S, _CPU_FLASH_KV_BLOCK)
    return threads * (q_block * kv_block + 2 * q_block * Ev) * acc + N * H * L * acc


def flash_kernel_available() -> bool:
    """Whether this PyTorch has the CPU flash-attention kernels (forward and backward) that the
    fused path's lse and the CPU block engine call."""
    return private_torch.has_cpu_flash_attention()


def fused_lse_available(q: torch.Tensor) -> bool:
    """Whether the fused kernel can return the log-sum-exp: PyTorch's CPU flash kernel."""
    return q.device.type == "cpu" and flash_kernel_available()


# The widest head (max(E, Ev)) at which PyTorch's CPU flash backward runs faster on float32
# copies of bf16 inputs than in bf16 on an AMX machine. Measured (torch 2.15, 2 threads, the
# backward kernel alone, copies included; n 1,024 and 4,096, with and without causal): E = 32,
# H = 4: 1.16-1.30x faster on the copies; E = 64 (H 8, 16): 0.72-0.89x, E = 128: 0.54-0.59x.
WIDE_BACKWARD_MAX_HEAD_DIM = 32


def wide_backward_wins(q: torch.Tensor, v: torch.Tensor, tier: str) -> bool:
    """Whether the fused path's backward should run on float32 copies of these bf16 inputs
    (`fused_attention`'s ``wide_backward``): on the amx tier, where it was measured, for heads
    up to `WIDE_BACKWARD_MAX_HEAD_DIM`. Other tiers with native bf16 keep its bf16 backward; on
    tiers without, bf16 calls are computed in float32 throughout before they get here."""
    return (
        q.dtype == torch.bfloat16 and q.device.type == "cpu" and tier == "amx" and flash_kernel_available()
        and max(q.shape[-1], v.shape[-1]) <= WIDE_BACKWARD_MAX_HEAD_DIM
    )  # fmt: skip


# Query rows per chunk when the log-sum-exp is computed apart from the output: bounds the
# scores held at once to (N, H, _LSE_CHUNK, S).
_LSE_CHUNK = 256


def dense_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal_offset: int | None = None,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """log sum_j exp(score_ij) (N, H, L), by chunks of query rows.

    Differentiable (in q, k and a float mask); without autograd only one chunk of scores
    exists at a time, with it autograd keeps every chunk's scores (the math path's memory).
    """
    N, H, L, _ = q.shape
    parts = []
    for start in range(0, L, _LSE_CHUNK):
        stop = min(L, start + _LSE_CHUNK)
        rows = mask[..., start:stop, :] if mask is not None else None
        row_ids = torch.arange(start, stop, device=q.device)
        scores = scores_with_mask(q[:, :, start:stop], k, rows, scale, causal_offset, terms, rows=row_ids)  # (N, G, r, l, S)
        parts.append(masked_softmax(scores)[1].reshape(N, H, stop - start))  # (N, H, l)
    return torch.cat(parts, dim=-1)  # (N, H, L)


def _additive_mask(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The mask as the kernels take it: bool as it is, float in the accumulation dtype."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask.to(accumulation_dtype(q.dtype))


class _FlashWithLse(torch.autograd.Function):
    """PyTorch's CPU flash kernel, output and lse both differentiable in q, k, v. ``wide``: the
    backward runs the kernel on float32 copies of low-precision inputs ("sdpa_wide" in a Plan).
    ``with_lse``: lse is an output; without it only the output is, so that a compiled backward
    gets no zero lse gradient (AOTAutograd materializes one), which would cost the backward a
    column (`with_lse_gradient`: E + 1, an odd head dim the kernel runs slower: 112 against 88 ms,
    bf16 n = 4,096, H = 4, E = 32)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal: bool, scale: float, wide: bool = False, with_lse: bool = True):  # type: ignore[override]
        out, lse = private_torch.cpu_flash_attention(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )[:2]  # (N, H, L, Ev), (N, H, L)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale, ctx.wide, ctx.with_lse = is_causal, scale, wide, with_lse
        ctx.set_materialize_grads(False)
        return (out, lse) if with_lse else out

    @staticmethod
    def backward(ctx, grad_out, grad_lse=None):  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        dtypes = q.dtype, k.dtype, v.dtype
        E = q.shape[-1]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if ctx.wide:
            # exact float32 copies; the float mask is float32 already (the accumulation dtype)
            q, k, v, out, grad_out = (x.float() for x in (q, k, v, out, grad_out))
        if grad_lse is not None:
            q, k, v, out, grad_out = with_lse_gradient(q, k, v, out, grad_out, grad_lse)  # (N, H, *, E + 1)
            mask = _additive_mask(mask, q)
        dq, dk, dv = private_torch.cpu_flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale
        )
        grads = (g[..., :E].to(dtype) for g, dtype in zip((dq, dk, dv), dtypes, strict=True))
        return (*grads, None, None, None, None, None)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    *,
    is_causal: bool = False,
    dropout: float = 0.0,
    need_lse: bool = False,
    wide_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch's SDPA. ``is_causal`` is SDPA's (top-left). ``mask`` broadcasts to (N, H, L, S)
    (size 1 on any axis). Returns (output (N, H, L, Ev), lse (N, H, L) or None).
    ``wide_backward``: bf16 inputs on PyTorch's CPU flash kernel, whose backward then runs on
    float32 copies (`wide_backward_wins`); no dropout."""
    H = q.shape[1]
    if is_causal:
        q, scale = causal_kernel_scale(q, scale)  # the kernel's causal -inf needs a positive scale
    empty_rows: torch.Tensor | None = None
    if mask is not None:
        visible = mask if mask.dtype == torch.bool else mask != _NEG_INF  # (N | 1, H | 1, L | 1, S)
        has_key = visible.any(dim=-1, keepdim=True)  # (N | 1, H | 1, L | 1, 1)
        # where the host cannot read has_key (torch.compile, export, vmap) the rows are opened
        # and zeroed whatever it holds: the same result, without a branch on the data
        if private_torch.host_unreadable(has_key) or not bool(has_key.all()):
            empty_rows = ~has_key
            # Open the empty rows so that the kernel computes something finite there; the
            # rows are zeroed below, which also zeroes their gradient.
            mask = mask | empty_rows if mask.dtype == torch.bool else mask.masked_fill(empty_rows, 0.0)
    if need_lse or wide_backward:
        if dropout > 0.0:
            raise ValueError("the fused kernel returns no log-sum-exp and has no float32 backward under dropout")
        if mask is not None and mask.dtype == torch.bool:
            # built once, in the accumulation dtype the kernel takes (no second copy below)
            hidden = torch.zeros(mask.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
            mask = hidden.masked_fill(~mask, _NEG_INF)
        result = _FlashWithLse.apply(
            *kernel_inputs(q, k, v), _additive_mask(mask, q), is_causal, scale, wide_backward, need_lse
        )  # (N, H, L, Ep) and, with need_lse, (N, H, L)
        out, lse = result if need_lse else (result, None)
        out = out[..., : v.shape[-1]]  # (N, H, L, Ev)
        lse = None if lse is None else lse.to(accumulation_dtype(q.dtype))
    else:
        mask = _additive_mask(mask, q)
        # a Python bool where a tracer makes shapes tensors (ONNX) or symbols (dynamic shapes): the
        # branch guards on the head counts, which SDPA's enable_gqa must know as a constant
        gqa = True if k.shape[1] != H else False  # noqa: SIM210
        if gqa and torch.onnx.is_in_onnx_export():
            # ONNX's TorchScript exporter has no enable_gqa: each key/value head is repeated for its queries
            k = k.repeat_interleave(H // k.shape[1], dim=1)  # (N, H, S, E)
            v = v.repeat_interleave(H // v.shape[1], dim=1)  # (N, H, S, Ev)
            gqa = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
        lse = None
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
        if lse is not None:
            lse = lse.masked_fill(empty_rows.squeeze(-1), _NEG_INF)
    return out, lse
