"""Attention of one query shard against one key/value block, and the exact merge of partials.

This is the local arithmetic of ring attention (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"; the backward follows FlashAttention-2, Dao 2023, Algorithm 2):

- `block_forward` returns the block's normalized output and its log-sum-exp (lse), both in
  the accumulation dtype (float32, or float64 for float64 inputs);
- `qkv.backends.merge.merge_partial` (the block engine's merge too) folds a block's (output,
  lse) into the running (output, lse) of the same query rows: out = out_a * exp(lse_a - lse)
  + out_b * exp(lse_b - lse) with lse = logaddexp(lse_a, lse_b), which is exactly the
  softmax over the union of the keys;
- `block_backward` adds a block's contribution to dq, dk and dv given the *global* lse and
  delta_i = sum_j dO_ij O_ij of the full output: P_ij = exp(s_ij - lse_i) is then the final
  attention probability, and dS = P * (dP - delta) needs nothing else from other blocks.

Two implementations of a block, chosen by `block_path` (the dispatcher's sub-rule for ring
blocks, `qkv.attention.dispatch.ring_block_path`):

- ``cpu-flash``: PyTorch's CPU flash-attention kernels (the ones SDPA runs on CPU), which
  return the lse and whose backward takes the output and lse as arguments, so they accept
  the global ones. Used on CPU when E == Ev (their restriction); about 2-3x faster than the
  tiles on this machine. GQA key/value heads are repeated for them (a copy of the block).
- ``tiles``: the formula in PyTorch, for every other case (E != Ev, other devices): queries
  in tiles of `QUERY_TILE` rows against all keys of the block, so the scores held at once
  are (N, H, QUERY_TILE, S_blk) and fall with the block size, i.e. like 1/P for a ring of
  P ranks. GQA reads each key/value head once for its H/G query heads.

A block is "diagonal" when queries and keys are the same run of positions under a causal
mask: query i sees local keys 0..i only, and the keys after the tile's last query are not
even read. Blocks whose keys all lie in the queries' future are never passed here (the ring
skips them), so every query row of a block sees at least one key and no row is empty.

Shape legend: N batch (flattened), H query heads, G key/value heads, r = H // G, L_blk query
rows of the shard, S_blk keys of the block, T rows of a tile, E q/k head dim, Ev value dim.
"""

from __future__ import annotations

import torch

from qkv._private import torch as private_torch
from qkv.attention.dispatch import ring_block_path
from qkv.backends.heads import expand_kv_heads, sum_kv_heads
from qkv.backends.softmax import causal_kernel_scale

__all__ = ["QUERY_TILE", "block_backward", "block_forward", "block_path"]

# Query rows per tile. 256 keeps each tile's matrix products large enough to run near the
# machine's matmul rate while bounding the (T, S_blk) scores per head to T / S_blk of the block.
QUERY_TILE = 256

_NEG_INF = float("-inf")


def block_path(q: torch.Tensor, v: torch.Tensor) -> str:
    """Which implementation computes blocks of these queries and values: "cpu-flash" or "tiles",
    by the dispatcher's sub-rule for ring blocks (`qkv.attention.dispatch.ring_block_path`)."""
    return ring_block_path(q, v)


def _future_keys(t0: int, t1: int, keys: int, device: torch.device) -> torch.Tensor:
    """(T, keys) bool, True where local key j lies after local query t0 + a (diagonal blocks)."""
    return torch.ones(t1 - t0, keys, dtype=torch.bool, device=device).triu(diagonal=t0 + 1)  # (T, keys)


def _tile_scores(
    q_tile: torch.Tensor, k5: torch.Tensor, scale: float, t0: int, diagonal: bool
) -> torch.Tensor:
    """Scaled scores (N, G, r, T, keys) of one query tile, future keys at -inf when diagonal."""
    N, H, T, E = q_tile.shape
    G = k5.shape[1]
    keys = t0 + T if diagonal else k5.shape[3]
    q5 = q_tile.reshape(N, G, H // G, T, E)  # (N, G, r, T, E)
    scores = torch.matmul(q5, k5[:, :, :, :keys].transpose(-1, -2)).mul_(scale)  # (N, G, r, T, keys)
    if diagonal:
        scores.masked_fill_(_future_keys(t0, t0 + T, keys, scores.device), _NEG_INF)
    return scores


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q (N, H, L_blk, E) over k (N, G, S_blk, E), v (N, G, S_blk, Ev).

    All arguments must already be in the accumulation dtype. Returns (out (N, H, L_blk, Ev),
    lse (N, H, L_blk)). ``diagonal``: a causal block of the same positions (L_blk == S_blk).
    """
    H = q.shape[1]
    if block_path(q, v) == "cpu-flash":
        # the kernel's causal -inf needs a positive scale (`causal_kernel_scale`)
        q_, scale_ = causal_kernel_scale(q, scale) if diagonal else (q, scale)
        out, lse = private_torch.cpu_flash_attention(
            q_, expand_kv_heads(k, H), expand_kv_heads(v, H), 0.0, diagonal, scale=scale_
        )
        return out, lse.to(q.dtype)  # (N, H, L_blk, Ev), (N, H, L_blk)
    return _tiled_forward(q, k, v, scale, diagonal)


def _tiled_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_forward` by query tiles: m_i, l_i and acc of each tile against all block keys."""
    N, H, L, _ = q.shape
    Ev = v.shape[3]
    k5 = k.unsqueeze(2)  # (N, G, 1, S_blk, E)
    v5 = v.unsqueeze(2)  # (N, G, 1, S_blk, Ev)
    out = torch.empty(N, H, L, Ev, dtype=q.dtype, device=q.device)
    lse = torch.empty(N, H, L, dtype=q.dtype, device=q.device)
    for t0 in range(0, L, QUERY_TILE):
        t1 = min(L, t0 + QUERY_TILE)
        T = t1 - t0
        scores = _tile_scores(q[:, :, t0:t1], k5, scale, t0, diagonal)  # (N, G, r, T, keys)
        keys = scores.shape[-1]
        m_i = scores.amax(dim=-1, keepdim=True)  # (N, G, r, T, 1): finite, every row sees a key
        p = scores.sub_(m_i).exp_()  # (N, G, r, T, keys), in place of the scores
        l_i = p.sum(dim=-1, keepdim=True)  # (N, G, r, T, 1)
        acc = torch.matmul(p, v5[:, :, :, :keys])  # (N, G, r, T, Ev)
        out[:, :, t0:t1] = acc.div_(l_i).reshape(N, H, T, Ev)  # (N, H, T, Ev)
        lse[:, :, t0:t1] = (m_i + l_i.log()).reshape(N, H, T)  # (N, H, T)
    return out, lse


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    d_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    diagonal: bool,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add one block's gradient contributions to dq, dk and dv, in place.

    q (N, H, L_blk, E), k (N, G, S_blk, E), v (N, G, S_blk, Ev); out, d_out (N, H, L_blk, Ev),
    lse and delta (N, H, L_blk) of the *full* attention (all keys, every rank). Outputs: dq
    like q, dk like k, dv like v. Everything in the accumulation dtype.
    """
    H, G = q.shape[1], k.shape[1]
    if block_path(q, v) == "cpu-flash":
        # the kernel recomputes P from the lse and delta from out: pass the global ones
        q_, scale_ = causal_kernel_scale(q, scale) if diagonal else (q, scale)
        grad_q, grad_k, grad_v = private_torch.cpu_flash_attention_backward(
            d_out, q_, expand_kv_heads(k, H), expand_kv_heads(v, H), out, lse, 0.0, diagonal, scale=scale_
        )
        # d(q_)/dq: 1, -1 for a negative scale, 0 for a zero one
        dq.add_(grad_q, alpha=1.0 if scale_ == scale else -1.0 if scale < 0 else 0.0)
        dk += sum_kv_heads(grad_k, G)
        dv += sum_kv_heads(grad_v, G)
        return
    N, L, E = q.shape[0], q.shape[2], q.shape[3]
    Ev = v.shape[3]
    r = H // G
    k5 = k.unsqueeze(2)  # (N, G, 1, S_blk, E)
    v5 = v.unsqueeze(2)  # (N, G, 1, S_blk, Ev)
    for t0 in range(0, L, QUERY_TILE):
        t1 = min(L, t0 + QUERY_TILE)
        T = t1 - t0
        scores = _tile_scores(q[:, :, t0:t1], k5, scale, t0, diagonal)  # (N, G, r, T, keys)
        keys = scores.shape[-1]
        lse5 = lse[:, :, t0:t1].reshape(N, G, r, T, 1)  # (N, G, r, T, 1)
        p = scores.sub_(lse5).exp_()  # (N, G, r, T, keys): final probabilities, 0 where masked
        do5 = d_out[:, :, t0:t1].reshape(N, G, r, T, Ev)  # (N, G, r, T, Ev)
        p_rows = p.reshape(N, G, r * T, keys)  # (N, G, rT, keys): query heads of a group stacked
        dv[:, :, :keys] += torch.matmul(p_rows.transpose(-1, -2), do5.reshape(N, G, r * T, Ev))  # (N, G, keys, Ev)
        dp = torch.matmul(do5, v5[:, :, :, :keys].transpose(-1, -2))  # (N, G, r, T, keys)
        ds = dp.sub_(delta[:, :, t0:t1].reshape(N, G, r, T, 1)).mul_(p).mul_(scale)  # (N, G, r, T, keys)
        dq[:, :, t0:t1] += torch.matmul(ds, k5[:, :, :, :keys]).reshape(N, H, T, E)  # (N, H, T, E)
        q_rows = q[:, :, t0:t1].reshape(N, G, r * T, E)  # (N, G, rT, E)
        dk[:, :, :keys] += torch.matmul(ds.reshape(N, G, r * T, keys).transpose(-1, -2), q_rows)  # (N, G, keys, E)
