"""The block engine's backward for a bfloat16 call, built from the CPU's bf16 matrix products.

PyTorch's CPU flash backward gains nothing from bfloat16 although the CPU's matrix units
(AMX) multiply bf16 about seven times faster than float32: on one block of 8 heads x 256
queries x 768 keys (E = 64, one core) it takes 11.0 ms in bf16 and 8.9 ms in float32. The
same gradients from five batched bf16 matrix products, one softmax and one softmax backward
take about 5 ms. That is what this module computes, for a call of the engine whose pieces
hold *every* visible key of their rows (``not call.merge``), so that the softmax over the
piece is the row's whole softmax and needs no saved log-sum-exp:

    P  = softmax(scale q k^T + bias)        bias: 0 where visible, -inf where the mask hides
    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - rowsum(dP * P))          rowsum(dP * P) = rowsum(dO * O): FlashAttention's D
    dQ = scale dS K,   dK = dS^T (scale q)

Numerics. PyTorch offers no CPU bf16 product with a float32 result, so every product above
accumulates in float32 inside the matrix unit and rounds its result to bf16, as a naive bf16
implementation does; the softmax and its backward keep their row state (max, sum, rowsum)
in float32 (docs/design.md), and the gradients of a call are added into float32 accumulators.
The gradients obey docs/design.md's tolerance rule (at most 3x the error of the naive bf16
implementation, plus a small floor: tests/kernels/test_matmul_backward.py); they are less
exact than the float32 kernel's, which is the price of the speed.

Rows with no visible key get zero gradients: their bias row is set to 0 (a finite softmax)
and their output gradient to 0, so that every product they enter contributes nothing.

Memory: scores, probabilities and their gradients of a few items at a time, at most
``budget`` bytes (the engine's per-call bound); never an L x S tensor.

References: Dao, "FlashAttention-2" (2023), algorithm 2 (the backward's products);
Intel AMX (Advanced Matrix Extensions) bf16 tile multiply with float32 accumulation.
"""

from __future__ import annotations

import torch

from qkv._private import torch as private_torch

__all__ = ["MATMUL_BACKWARD_DTYPES", "MAX_THREADS", "call_gradients", "suits"]

# Input dtypes whose calls take this backward: bfloat16, whose products the CPU's matrix
# units run natively (amx_bf16). float16 has no such units on these CPUs (no amx_fp16) and
# keeps the flash kernel.
MATMUL_BACKWARD_DTYPES = (torch.bfloat16,)
# Score-sized temporaries alive at once per item: scores / probabilities, their gradient,
# and the softmax backward's result.
_SCORE_TENSORS = 3
# Bytes of one score-sized tensor per piece of work, so that the softmax passes find the scores
# in cache. Measured on one core, a call of 14 items x 8 heads x 192 x 704 (2.1 MiB per item
# and tensor): pieces of 1 head 105 ms, 3 heads 72, 7 heads 74, 1 item 66, 7 items 91.
_CACHE_BYTES = 4 * 2**20


# Intra-op threads up to which calls take this backward. It runs about a dozen short
# parallel operations per item where the flash kernel runs one per call. On one thread it
# wins (benchmarks/bf16_engine.py, n = 16,384: forward + backward 1.13-1.25x float32, against
# 0.90-1.03x with the flash backward); on 2 threads of a busy 2-core machine (load ~9) each of
# those operations waits for a descheduled thread, and the same step took 24 s against the
# flash route's 3.3 s. It has not been measured on a quiet machine with 2 threads; the
# benchmark prints both routes in one run, so that this bound can be raised on evidence.
MAX_THREADS = 1


def suits(dtype: torch.dtype, merge: bool, lse_gradient: bool) -> bool:
    """Whether a call of the engine in ``dtype`` takes this backward: a bf16 call whose pieces
    hold all the keys of their rows (``merge`` False), for a loss that does not read the lse,
    when PyTorch runs at most `MAX_THREADS` intra-op threads."""
    return (
        dtype in MATMUL_BACKWARD_DTYPES and not merge and not lse_gradient and torch.get_num_threads() <= MAX_THREADS
    )


def call_gradients(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    empty: torch.Tensor | None,
    scale: float,
    budget: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq (items, H, q_len, D), dk and dv (items, H, width, D) of one engine call (module docstring).

    grad_out and q (items, H, q_len, D), k and v (items, H, width, D): bf16 views, last dim
    contiguous. bias (count | 1, heads | 1, q_len, width) in q's dtype, 0 or -inf, for a masked
    call (None otherwise), and empty (count | 1, heads | 1, q_len) its rows with no visible
    key. ``budget``: bytes of score-sized temporaries allowed at once.
    """
    items, H, q_len, D = q.shape
    width = k.shape[2]
    if bias is not None and empty is not None and bool(empty.any()):
        # a finite softmax on empty rows, whose zero output gradient then cancels every product
        bias = torch.where(empty.unsqueeze(-1), torch.zeros((), dtype=bias.dtype), bias)
        keep = (~empty).to(grad_out.dtype).unsqueeze(-1)  # (count | 1, heads | 1, q_len, 1)
        grad_out = grad_out * keep  # (items, H, q_len, D)
    # work in pieces whose score-sized tensors stay in the core's cache: a few items with all
    # their heads, or some heads of one item
    per_head = q_len * width * q.element_size()
    limit = max(per_head, min(budget // _SCORE_TENSORS, _CACHE_BYTES))
    item_step = max(1, limit // (H * per_head))
    head_step = H if item_step > 1 else max(1, min(H, limit // per_head))
    # dq and dk leave in float32 with the scale applied there (one bf16 rounding fewer);
    # dv leaves in bf16 as its product returns it
    dq = torch.empty(items, H, q_len, D, dtype=torch.float32)
    dk = torch.empty(items, H, width, D, dtype=torch.float32)
    dv = torch.empty(items, H, width, D, dtype=q.dtype)
    for a in range(0, items, item_step):
        b = min(items, a + item_step)
        # contiguous copies: the engine's strided item views (overlapping key windows) cannot be
        # flattened into one batch of products, so every product would copy them again
        q_a, k_a, v_a, grad_a = (x[a:b].contiguous() for x in (q, k, v, grad_out))  # (chunk, H, *, D)
        q_scaled = q_a * scale  # rounded to bf16 once, as a naive implementation's scores are
        for h in range(0, H, head_step):
            heads = slice(h, h + head_step)
            tile = None
            if bias is not None:
                tile = bias if bias.shape[0] == 1 else bias[a:b]  # shared, or these items' own
                tile = tile if tile.shape[1] == 1 else tile[:, heads]
            _chunk(grad_a[:, heads], q_a[:, heads], q_scaled[:, heads], k_a[:, heads], v_a[:, heads], tile, scale,
                   dq[a:b, heads], dk[a:b, heads], dv[a:b, heads])
    return dq, dk, dv


def _chunk(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    q_scaled: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """The products of the module docstring for a few items, written into dq, dk, dv."""
    scores = torch.matmul(q_scaled, k.transpose(-1, -2))  # (items, H, q_len, width)
    if bias is not None:
        scores.add_(bias)  # adding 0 or -inf is exact
    probs = torch.softmax(scores, dim=-1)  # (items, H, q_len, width): float32 row state inside
    del scores
    torch.matmul(probs.transpose(-1, -2), grad_out, out=dv)  # (items, H, width, D)
    grad_probs = torch.matmul(grad_out, v.transpose(-1, -2))  # (items, H, q_len, width)
    # P * (dP - rowsum(dP * P)) in one pass, float32 inside (the softmax's own backward)
    grad_scores = private_torch.softmax_backward(grad_probs, probs, -1, probs.dtype)
    del grad_probs, probs
    dq.copy_(torch.matmul(grad_scores, k)).mul_(scale)  # (items, H, q_len, D)
    dk.copy_(torch.matmul(grad_scores.transpose(-1, -2), q)).mul_(scale)  # (items, H, width, D)
