"""`flash_attn_with_kvcache`: FlashAttention 2's ``flash_attn_with_kvcache`` on qkv's dispatcher,
for contiguous and paged caches.

q (B, L, H, E) attends to row b of the cache, k_cache / v_cache (B_cache, S_cache, G, E):
its first cache_seqlens[b] keys, plus the L_new keys of ``k`` / ``v`` when given, which are
first written into the cache *in place* at positions cache_seqlens[b] .. + L_new (what
FlashAttention does for incremental decoding). Row b thus has n_b keys, and ``causal``,
``window_size`` and ``alibi_slopes`` align bottom-right to n_b (query i sits at i + n_b - L):
`qkv.masks.padded` with per-row key lengths. ``cache_batch_idx`` picks the cache rows.

Paged cache (``block_table`` (B, max_blocks) int32): k_cache / v_cache are (num_blocks,
block_size, G, E) and position t of row b lives at ``k_cache[block_table[b, t // block_size],
t % block_size]`` (FlashAttention's and vLLM's layout; `qkv.PagedKVCache` keeps one). Any
block_size works here (FlashAttention's CUDA kernel wants a multiple of 256). Entries of a row
past its ceil(n_b / block_size) blocks are never read, nor are blocks no row names.

A paged decoding step (few queries, many keys: where `qkv.attention` would take the decode
path) attends in place over the pool, as `qkv.PagedKVCache.attend` does
(`qkv.backends.decode.decode_blocks`), nothing gathered: the compiled decode kernel reads each
row's blocks through its block table (the bits of a contiguous cache); where it does not run
(a bias such as ALiBi, no compiler), each row's runs of consecutive blocks are strided views that
the decode kernel's PyTorch ops read chunk by chunk and merge by lse. Other calls (long query blocks, short caches, score terms the decode
kernel does not take, non-finite data for the NaN rule) gather each row's blocks into one
contiguous copy and run `qkv.attention` on it.

Refused with a clear error: ``cache_batch_idx`` together with ``block_table``, ``rotary_cos`` / ``rotary_sin`` (rotate q and k first, e.g. with `qkv.nn.positional.RotaryEmbedding`)
and ``cache_leftpad``. ``num_splits`` is a kernel scheduling knob and changes nothing here.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from qkv.attention.bounds import KVBounds, largest_magnitude
from qkv.attention.dispatch import choose_path
from qkv.attention.functional import attention
from qkv.attention.problem import describe_problem
from qkv.backends.decode import block_runs, decode_blocks
from qkv.backends.softmax import accumulation_dtype
from qkv.compat._alibi import alibi_from_slopes
from qkv.compat._args import (
    check_flag,
    flash_mask,
    flash_mask_options,
    flash_softcap,
    tensor_of_rank,
)
from qkv.masks import Mask, padded

__all__ = ["flash_attn_with_kvcache"]

_LAYOUT_CACHE = "(batch_size_cache, seqlen_cache, nheads_k, headdim), or (num_blocks, page_block_size, nheads_k, headdim) with block_table"
_LAYOUT_NEW = "(batch_size, seqlen_new, nheads_k, headdim)"


def _index_tensor(value: object, name: str, size: int, device: torch.device) -> torch.Tensor:
    """A (size,) int32 / int64 tensor as int64 on ``device``."""
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{name} must be an int32 or int64 tensor (batch_size,), got {got}")
    if tuple(value.shape) != (size,):
        raise ValueError(f"{name} must have shape (batch_size,) = ({size},), got {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.long)


def _block_table(value: object, B: int, device: torch.device) -> torch.Tensor:
    """block_table (B, max_blocks) int32 as int64 on ``device`` (its entries are checked once the
    lengths say which of them are read)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int32:
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"block_table must be an int32 tensor (batch_size, max_num_blocks_per_seq), got {got}")
    if value.ndim != 2 or value.shape[0] != B or value.shape[1] == 0:
        raise ValueError(f"block_table must have shape (batch_size={B}, max_num_blocks_per_seq >= 1), got {tuple(value.shape)}")
    return value.to(device=device, dtype=torch.long)


def _blocks_read(table: torch.Tensor, n: torch.Tensor, num_blocks: int, P: int) -> torch.Tensor:
    """The table with the entries row b reads (its first ceil(n_b / P)) checked against the pool,
    and every other entry 0: (B, max_blocks)."""
    used = torch.arange(table.shape[1], device=table.device)[None, :] < ((n + P - 1) // P)[:, None]  # (B, max_blocks)
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} is read but the cache has blocks 0 .. {num_blocks - 1}")
    return torch.where(used, table, torch.zeros((), dtype=table.dtype, device=table.device))


def _cache_lengths(cache_seqlens: object, B: int, S_cache: int, device: torch.device) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.full((B,), S_cache, dtype=torch.long, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = torch.full((B,), cache_seqlens, dtype=torch.long, device=device)
    else:
        lengths = _index_tensor(cache_seqlens, "cache_seqlens", B, device)
    if bool(((lengths < 0) | (lengths > S_cache)).any()):
        raise ValueError(f"cache_seqlens must lie in [0, seqlen_cache={S_cache}], got {lengths.tolist()}")
    return lengths


@overload
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = ...,
    v: torch.Tensor | None = ...,
    rotary_cos: torch.Tensor | None = ...,
    rotary_sin: torch.Tensor | None = ...,
    cache_seqlens: int | torch.Tensor | None = ...,
    cache_batch_idx: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    rotary_interleaved: bool = ...,
    alibi_slopes: torch.Tensor | None = ...,
    num_splits: int = ...,
    return_softmax_lse: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = ...,
    v: torch.Tensor | None = ...,
    rotary_cos: torch.Tensor | None = ...,
    rotary_sin: torch.Tensor | None = ...,
    cache_seqlens: int | torch.Tensor | None = ...,
    cache_batch_idx: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    rotary_interleaved: bool = ...,
    alibi_slopes: torch.Tensor | None = ...,
    num_splits: int = ...,
    *,
    return_softmax_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = ...,
    v: torch.Tensor | None = ...,
    rotary_cos: torch.Tensor | None = ...,
    rotary_sin: torch.Tensor | None = ...,
    cache_seqlens: int | torch.Tensor | None = ...,
    cache_batch_idx: torch.Tensor | None = ...,
    cache_leftpad: torch.Tensor | None = ...,
    block_table: torch.Tensor | None = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    rotary_interleaved: bool = ...,
    alibi_slopes: torch.Tensor | None = ...,
    num_splits: int = ...,
    return_softmax_lse: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's ``flash_attn_with_kvcache`` on a contiguous cache, computed by `qkv.attention`.

    Args:
        q: (B, L, H, E).
        k_cache, v_cache: (B_cache, S_cache, G, E) and (B_cache, S_cache, G, Ev), updated in
            place when k and v are given.
        k, v: None, or the new keys and values (B, L_new, G, E) / (B, L_new, G, Ev), written
            at cache_seqlens[b] (cache_seqlens is then required, as in FlashAttention).
        cache_seqlens: None (every row holds S_cache keys), an int, or (B,) int32 / int64.
        cache_batch_idx: None (rows 0..B-1, B_cache = B), or (B,) cache row of each query row.
        block_table: None (a contiguous cache), or (B, max_blocks) int32: the paged cache's
            blocks of each row, k_cache / v_cache then (num_blocks, block_size, G, E | Ev).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as `flash_attn_func`,
            with S = n_b, the keys of row b.
        return_softmax_lse: also return softmax_lse (B, H, L).
        rotary_cos, rotary_sin, cache_leftpad: must be None (ValueError).
        rotary_interleaved, num_splits: accepted (a bool, an int >= 0); they change nothing here.

    Returns:
        out (B, L, H, Ev), or (out, softmax_lse) with softmax_lse float32 (float64 for float64
        inputs), -inf for a row that sees no key. If the attention raises, the cache is left
        as it was.

    Example: one decoding step over a cache holding 3 and 5 keys:
        >>> import torch
        >>> from qkv.compat import flash_attn_with_kvcache
        >>> k_cache, v_cache = torch.zeros(2, 8, 1, 4), torch.zeros(2, 8, 1, 4)
        >>> q, k, v = torch.randn(2, 1, 2, 4), torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
        >>> lengths = torch.tensor([3, 5], dtype=torch.int32)
        >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
        >>> out.shape, torch.equal(k_cache[1, 5], k[1, 0])
        (torch.Size([2, 1, 2, 4]), True)
    """
    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError(
            "rotary_cos / rotary_sin are not supported: rotate q and the new k before the call "
            "(qkv.nn.positional.RotaryEmbedding) and pass them already rotated"
        )
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad is not supported: keep each cache row's keys from position 0")
    check_flag(rotary_interleaved, "rotary_interleaved")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    want_lse = check_flag(return_softmax_lse, "return_softmax_lse")
    q = tensor_of_rank(q, 4, "q", "(batch_size, seqlen, nheads, headdim)")
    k_cache = tensor_of_rank(k_cache, 4, "k_cache", _LAYOUT_CACHE)
    v_cache = tensor_of_rank(v_cache, 4, "v_cache", _LAYOUT_CACHE)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share (B_cache, S_cache, G)")
    B, L, H, _ = q.shape
    B_cache, S_cache = k_cache.shape[:2]
    device = q.device
    table = None if block_table is None else _block_table(block_table, B, device)  # (B, max_blocks)
    if table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table: the table already names each row's blocks")
        P = k_cache.shape[1]  # positions per block
        S_cache = table.shape[1] * P  # what a row's table can address
        rows = None
    elif cache_batch_idx is None:
        if B_cache != B:
            raise ValueError(f"k_cache has {B_cache} rows and q {B}; pass cache_batch_idx to pick cache rows")
        rows = None
    else:
        rows = _index_tensor(cache_batch_idx, "cache_batch_idx", B, device)
        if bool(((rows < 0) | (rows >= B_cache)).any()):
            raise ValueError(f"cache_batch_idx must lie in [0, {B_cache}), got {rows.tolist()}")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new keys and values) or neither")
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens is required with k and v: it says where the new keys go")
    lengths = _cache_lengths(cache_seqlens, B, S_cache, device)  # (B,) keys already in each row
    new = 0
    if k is not None and v is not None:
        k = tensor_of_rank(k, 4, "k", _LAYOUT_NEW)
        v = tensor_of_rank(v, 4, "v", _LAYOUT_NEW)
        if k.shape[0] != B or k.shape[2:] != k_cache.shape[2:] or v.shape[:2] != k.shape[:2] or v.shape[2:] != v_cache.shape[2:]:
            raise ValueError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (batch_size={B}, seqlen_new, G, E) matching "
                f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}"
            )
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise TypeError(f"k and v ({k.dtype}, {v.dtype}) must have the caches' dtypes ({k_cache.dtype}, {v_cache.dtype})")
        new = k.shape[1]
        if bool((lengths + new > S_cache).any()):
            raise ValueError(
                f"the cache holds {S_cache} positions; cache_seqlens {lengths.tolist()} plus {new} new keys do not fit"
            )
    n = lengths + new  # (B,) keys each query row sees
    S = max(1, int(n.max()))
    cache_rows = torch.arange(B, device=device) if rows is None else rows
    if table is not None:
        table = _blocks_read(table, n, k_cache.shape[0], P)  # (B, max_blocks)
    slots = None
    if k is not None and v is not None and new > 0:
        positions = lengths[:, None] + torch.arange(new, device=device)  # (B, L_new)
        if table is None:
            slots = (cache_rows[:, None], positions)  # (B, 1), (B, L_new)
        else:
            slots = (table.gather(1, positions // P), positions % P)  # (B, L_new) block, (B, L_new) offset
        saved = k_cache[slots].clone(), v_cache[slots].clone()  # (B, L_new, G, E | Ev): restored on error
        k_cache[slots], v_cache[slots] = k, v
    if table is not None:
        try:
            in_place = _paged_in_place(
                q, k_cache, v_cache, table, n, causal, window_size, alibi_slopes, softcap, softmax_scale, want_lse
            )
        except Exception:
            if slots is not None:
                k_cache[slots], v_cache[slots] = saved
            raise
        if in_place is not None:
            out, lse = in_place  # (B, H, L, Ev), (B, H, L)
            out = out.transpose(1, 2).contiguous()  # (B, L, H, Ev)
            return (out, lse) if want_lse else out
        read = table[:, : (S + P - 1) // P]  # (B, nb): the blocks that hold positions 0 .. S - 1
        keys = k_cache[read].flatten(1, 2)[:, :S]  # (B, nb, P, G, E) -> (B, nb * P, G, E) -> (B, S, G, E)
        values = v_cache[read].flatten(1, 2)[:, :S]  # (B, S, G, Ev)
    else:
        keys = k_cache[:, :S] if rows is None else k_cache[rows, :S]  # (B, S, G, E)
        values = v_cache[:, :S] if rows is None else v_cache[rows, :S]  # (B, S, G, Ev)
    is_causal, window = flash_mask_options(causal, window_size, max(L, S))
    try:
        result = attention(
            q.transpose(1, 2),  # (B, H, L, E)
            keys.transpose(1, 2),  # (B, G, S, E)
            values.transpose(1, 2),  # (B, G, S, Ev)
            padded(torch.full((B,), L, dtype=torch.long, device=device), n, causal=is_causal, window=window),
            bias=alibi_from_slopes(alibi_slopes, B, H),
            softcap=flash_softcap(softcap),
            scale=softmax_scale,
            return_lse=want_lse,
        )
    except Exception:
        if slots is not None:
            k_cache[slots], v_cache[slots] = saved
        raise
    if not want_lse:
        assert isinstance(result, torch.Tensor)
        return result.transpose(1, 2).contiguous()  # (B, L, H, Ev)
    out, lse = result
    return out.transpose(1, 2).contiguous(), lse  # (B, L, H, Ev), (B, H, L)


def _paged_in_place(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    n: torch.Tensor,
    causal: object,
    window_size: object,
    alibi_slopes: torch.Tensor | None,
    softcap: object,
    scale: float | None,
    want_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every row's attention over its blocks where they lie in the pools (num_blocks, P, G, E | Ev),
    by the decode kernel: (out (B, H, L, Ev), lse (B, H, L)); None when some row would not take
    the decode path of `qkv.attention` (the caller then gathers). Each row is checked as
    `qkv.attention` checks it, on a stand-in of its shape without storage (stride 0) whose data
    checks the bounds scanned over its runs replace."""
    B, L, H, E = q.shape
    G, Ev, P = k_pool.shape[2], v_pool.shape[3], k_pool.shape[1]
    if q.device.type != "cpu" or bool((n == 0).any()):
        return None  # the decode kernel is a CPU one; a row with no key goes the general way
    lengths, blocks = n.tolist(), table.tolist()
    outs, lses = [], []
    for b in range(B):
        S = lengths[b]
        row_blocks = blocks[b][: (S + P - 1) // P]
        runs = block_runs(k_pool, v_pool, row_blocks, S)  # (first, k (1, G, m, E), v) views
        k_max = max(largest_magnitude(k) for _, k, _ in runs)
        v_max = max(largest_magnitude(v) for _, _, v in runs)
        if not (math.isfinite(k_max) and math.isfinite(v_max)):
            return None  # the NaN rule needs the data: the gathered path applies it
        q_row = q[b : b + 1].transpose(1, 2)  # (1, H, L, E)
        factor = max(1.0, abs(1.0 / math.sqrt(E) if scale is None else float(scale)))
        if factor * E * largest_magnitude(q_row) * k_max > torch.finfo(accumulation_dtype(q.dtype)).max / 2:
            return None  # the overflow check would read the keys for its tight bound: gather
        k_like = k_pool[0, 0][None, :, None, :].expand(1, G, S, E)  # (1, G, S, E), stride 0 along S
        v_like = v_pool[0, 0][None, :, None, :].expand(1, G, S, Ev)  # (1, G, S, Ev)
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.ndim == 2 else alibi_slopes
        problem = describe_problem(
            q_row, k_like, v_like, flash_mask(causal, window_size, L, S), scale,
            bias=alibi_from_slopes(slopes, 1, H), softcap=flash_softcap(softcap),
            kv_bounds=KVBounds.of(k_like, v_like, k_max, v_max),
        )  # fmt: skip
        if problem.nonfinite or choose_path(problem, "auto", False, want_lse).path != "decode":
            return None
        assert problem.mask is None or isinstance(problem.mask, Mask)  # flash_mask's, as the decode path takes it
        # spans=False: the pool is the caller's, its other blocks may hold NaN (FlashAttention never reads them)
        out, lse = decode_blocks(problem.q, k_pool, v_pool, row_blocks, S, problem.scale, problem.mask, problem.terms, spans=False)  # (1, H, L, Ev), (1, H, L)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)  # (B, H, L, Ev), (B, H, L)
