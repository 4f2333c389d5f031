"""The decode kernel: a few queries against a long key cache, the keys split across threads.

Flash-Decoding (Dao, Haziza, Massa, Sizov 2023) in PyTorch ops. A decode step has L <= 16
queries and S >> L keys, so a kernel that parallelizes over queries and heads leaves most cores
idle and reads the cache from one of them. Here:

1. the query heads of each KV group sit side by side, q (N, H, L, E) -> (N, G, R*L, E) with
   R = H / G query heads per group, so one matmul reads each K block once for all of them;
2. the visible key range is split into ``splits`` contiguous chunks of C keys (the last one
   shorter when C does not divide it); all chunks go through one batched matmul, so PyTorch's
   intra-op threads each take some chunks;
3. each chunk keeps its softmax state: the row max m_c, the sum l_c = sum_j exp(s_j - m_c) and
   the unnormalized output acc_c = sum_j exp(s_j - m_c) v_j;
4. the chunks merge exactly (the rescaling of `qkv.backends.merge`, done for all chunks at once):
   M = max(max_c m_c, sink), den = sum_c exp(m_c - M) l_c + exp(sink - M),
   out = sum_c exp(m_c - M) acc_c / den, lse = M + log(den).

Keys that every query sees (all of them for one query, causal or not; all but the last L - 1
causal; the middle of a window) go to PyTorch's fused (flash) CPU attention kernel instead,
``aten._scaled_dot_product_flash_attention_for_cpu``, which returns each chunk's output and
lse: the chunk axis is its batch axis (strided views, no copy), q is (N, G, R*L, E), so it runs
one task per (chunk, KV head) that reads the chunk once for the whole group, with float32
scores and sums for bf16 inputs. It takes no gradient through its lse, no score term and needs
E == Ev, so gradients, softcaps, biases, key padding and the masked edges take the chunked PyTorch ops
below; all chunks merge as in 4. One fused chunk and no sink skip the merge. (benchmarks/decode.py,
S = 32k, B=1 Hq=32 G=8 E=128, 2 AMX threads, loaded: fused float32 ~75% of the read bandwidth and
~2.5x SDPA, where the chunked ops reached ~20%: their reductions over (C, R*L) score tiles cost
more than the products.)

Masks are applied per chunk from key positions (no L x S mask): an interval per query
(causal, sliding windows) or a key-validity row (key padding). Chunks outside every query's
interval are never read, so a window reads only its own keys. A row with no visible key gives
zeros and lse -inf, with a sink too (as the math path). The chunk count depends on S and
the thread count only, never on timing: two calls at one thread count are bitwise equal.

The compiled kernel. Without a gradient or a bias other than ALiBi (a softcap it applies too), with
one dtype (float32 or bfloat16) and unit strides along the head dims, a call runs ``qkv.native.decode`` instead (the
Plan names it ``native_decode``; `native_reason` says why not): the same splits and merge in one
C++ call per step, built for this CPU's tier (AVX2 or AVX-512), bf16 widened in registers; a paged
pool (`decode_blocks`) is read through its block table in that same call. Its build is tried
once per process; when it fails, these PyTorch ops run (one note on the ``qkv`` logger).

Low-precision inputs whose products this CPU emulates are widened to the compute dtype
(`qkv.native.machine.compute_dtype`) one wave of chunks at a time, never the whole cache.
Gradients flow through the PyTorch ops (autograd keeps the scores and exponentials,
(N, H, L, S) each in float32: L <= 16 rows, small beside the cache).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from qkv._private.torch import cpu_flash_attention
from qkv.backends.softmax import accumulation_bytes, accumulation_dtype
from qkv.bias import ALiBi
from qkv.masks import Causal, KeyPadding, Mask, SlidingWindow
from qkv.native import decode as native
from qkv.native.machine import compute_dtype
from qkv.scores import ScoreTerms

__all__ = [
    "MAX_QUERIES", "MIN_CHUNK", "block_runs", "decode_attention", "decode_blocks", "decode_extra_bytes", "decode_runs", "default_splits", "fused_splits", "native_reason", "supports_mask",
]  # fmt: skip

# At most this many queries: beyond it a query-parallel kernel has enough rows to share out,
# and R * L rows per group make the scores as large as the cache they replace.
MAX_QUERIES = 16
# Chunks hold at least this many keys: below it the per-chunk bookkeeping (max, sum, partial
# output of R * L rows) costs as much as reading the chunk.
MIN_CHUNK = 256
# Chunks per intra-op thread: several, so that a thread that starts late still finds work.
CHUNKS_PER_THREAD = 4
# Chunks hold at most about this many keys: a float32 chunk of E = 128 is then 512 KiB, which
# stays in a core's cache between the two products (benchmarks/decode.py: 1,024-key chunks
# read 1.5x faster than 4,096-key ones at S = 32k on 2 AVX2 threads).
TARGET_CHUNK = 1024
# Keys widened to the compute dtype at a time when the inputs are in an emulated dtype
# (benchmarks/decode.py, S = 32k, bf16 on 2 AVX2 threads, loaded: waves of 4k 546 ms, 16k 321 ms,
# 64k 347 ms, the whole cache copied to float32 first 380 ms).
WIDEN_WAVE = 16384

_NEG_INF = float("-inf")


def supports_mask(mask: object) -> bool:
    """Whether the kernel applies ``mask`` itself: none, causal, a sliding window or key padding."""
    return mask is None or isinstance(mask, (Causal, SlidingWindow, KeyPadding))


def default_splits(keys: int, threads: int | None = None) -> int:
    """Chunks for ``keys`` visible keys: `CHUNKS_PER_THREAD` per intra-op thread, more when
    chunks would exceed `TARGET_CHUNK` keys, each of at least `MIN_CHUNK` keys, at least one.

    >>> default_splits(32768, threads=2), default_splits(1025, threads=2), default_splits(17, threads=8)
    (32, 4, 1)
    """
    threads = torch.get_num_threads() if threads is None else threads
    wanted = max(CHUNKS_PER_THREAD * threads, math.ceil(keys / TARGET_CHUNK))
    return max(1, min(wanted, keys // MIN_CHUNK))


def decode_extra_bytes(dtype: torch.dtype, *, N: int, H: int, L: int, S: int, Ev: int, splits: int) -> int:
    """Memory `decode_attention` allocates beyond inputs and output (an estimate): scores and
    exponentials (N, H, L, S) and the partial outputs (N, H, L, splits, Ev), in the accumulation dtype."""
    acc = accumulation_bytes(dtype)
    return (2 * N * H * L * S + N * H * L * splits * Ev) * acc


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: Mask | None = None,
    terms: ScoreTerms | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
    kernel: str = "decode",
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias, masked) v with the keys split into chunks, merged by lse.

    q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev); ``mask``: None, `qkv.masks.causal`,
    `sliding_window` or `key_padding` (`supports_mask`); ``terms``: a softcap and a bias (no
    score_mod), in qkv's order (softcap first); ``sinks`` (N | 1, H) float32 or wider; ``splits``: the chunk count
    (`default_splits` when None; the compiled kernel's splits per KV head, `fused_splits`).
    ``kernel``: "native_decode" runs the compiled kernel (the caller checked `native_reason`),
    these PyTorch ops when its build failed; "decode" runs the PyTorch ops. Returns (output
    (N, H, L, Ev) in q's dtype, lse (N, H, L) in the accumulation dtype).
    """
    if kernel == "native_decode":
        result = _native_attention(q, k, v, scale, mask, terms, sinks, splits, k.shape[2])
        if result is not None:
            return result
        # its build or self-check failed just now (noted once): the PyTorch ops below
    return decode_runs(q, [(0, k, v)], k.shape[2], scale, mask, terms, sinks, splits)


def native_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: ScoreTerms | None, grad: bool
) -> str | None:
    """Why the compiled kernel (`qkv.native.decode`) cannot take this decode step, or None:
    it runs forward only, applies a softcap and ALiBi (per-head slopes) but no other bias, reads
    one dtype with a contiguous head dim. Never builds."""
    if grad:
        return "a gradient is needed (it runs forward only)"
    if terms is not None and (terms.score_mod is not None or (terms.bias is not None and _slopes(terms) is None)):
        return f"it applies a softcap and ALiBi but no other score terms, got {terms.describe()}"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v differ in dtype ({q.dtype}, {k.dtype}, {v.dtype})"
    if (k.stride(-1) != 1 and k.shape[-1] > 1) or (v.stride(-1) != 1 and v.shape[-1] > 1):
        return "the keys or values are strided along their head dim"
    return native.unavailable_reason(q.dtype, q.device)


def _native_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: Mask | None, terms: ScoreTerms | None,
    sinks: torch.Tensor | None, splits: int | None, S: int, table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The compiled kernel: (output (N, H, L, Ev) in q's dtype, lse (N, H, L) float32), or None
    when its build failed. k, v: a cache (N, G, S, E | Ev), or pools (num_blocks, P, G, E | Ev)
    read through ``table`` (N, blocks) of which the first S positions count. Splits per KV head:
    `fused_splits` (one task per (row, KV head, split), like the fused path's), the same for a
    pool as for a cache, so the two give equal bits."""
    N, _, L, _ = q.shape
    G = k.shape[1] if table is None else k.shape[2]
    start, stop, lo, hi, valid = _key_range(mask, N, L, S, q.device)
    if table is not None and valid is not None:  # the kernel's key axis is the table's reach
        valid = torch.nn.functional.pad(valid, (0, table.shape[1] * k.shape[1] - S))  # (N | 1, blocks * P)
    count = fused_splits(stop - start, N * G) if splits is None else splits
    count = max(1, min(count, stop - start))
    softcap = None if terms is None else terms.softcap
    slopes = qpos = None
    if terms is not None and terms.bias is not None:
        slopes = _slopes(terms)
        assert slopes is not None  # native_reason checked it
        rows = N if terms.positions is not None and terms.positions.shape[0] > 1 else 1
        b = torch.arange(rows, device=q.device)[:, None]  # (N | 1, 1)
        qpos = terms.q_pos(b, torch.arange(L, device=q.device)[None]).to(torch.int64)  # (N | 1, L)
    result = native.forward(
        q, k, v, scale, start, stop, count, lo, hi, valid, sinks, softcap=softcap, table=table, slopes=slopes, qpos=qpos
    )
    if result is None:
        return None
    out, lse = result  # (N, H, L, Ev), (N, H, L) float32
    acc = accumulation_dtype(q.dtype)
    return out if out.dtype == q.dtype else out.to(q.dtype), lse if lse.dtype == acc else lse.to(acc)


def _slopes(terms: ScoreTerms) -> torch.Tensor | None:
    """The head slopes (H,) when the bias is ALiBi alone (bound: slopes set), else None."""
    bias = terms.bias
    if isinstance(bias, ALiBi) and bias.slopes is not None and bias.slopes.dim() == 1:
        return bias.slopes
    return None


def decode_runs(
    q: torch.Tensor,
    runs: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    S: int,
    scale: float,
    mask: Mask | None = None,
    terms: ScoreTerms | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` over keys held in pieces: ``runs`` lists (first position, k (N, G, n, E),
    v (N, G, n, Ev)) covering positions 0 .. S - 1 once each, in any order, as strided views
    (a paged cache's runs of consecutive blocks: `qkv.PagedKVCache.attend`). Each run is split
    into chunks of its own; all chunks merge by lse, so nothing is gathered. One run (0, k, v)
    is `decode_attention`."""
    return _decode(q, runs, S, scale, mask, terms, sinks, splits, (runs[0][1], runs[0][2]), [])


def _decode(
    q: torch.Tensor,
    runs: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    S: int,
    scale: float,
    mask: Mask | None,
    terms: ScoreTerms | None,
    sinks: torch.Tensor | None,
    splits: int | None,
    like: tuple[torch.Tensor, torch.Tensor],
    extra: list[_State],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_runs` with ``like``, a (k, v) pair whose dtype and last dims the keys and values
    share, and ``extra``, softmax states of keys outside ``runs`` (fused, see `decode_blocks`)."""
    first_k, first_v = like
    N, H, L, E = q.shape
    G, Ev = first_k.shape[1], first_v.shape[3]
    R = H // G
    acc = accumulation_dtype(q.dtype)
    work = compute_dtype(q.dtype, q.device)
    start, stop, lo, hi, valid = _key_range(mask, N, L, S, q.device)
    grad = torch.is_grad_enabled() and (q.requires_grad or any(t.requires_grad for _, k, v in runs for t in (k, v)))
    qw = q.to(work)
    fused = _fused_range(qw, runs, start, stop, lo, hi, valid, terms, grad)
    chunk = max(1, math.ceil((stop - start) / (default_splits(stop - start) if splits is None else splits)))
    fused_chunk = chunk
    if fused is not None and splits is None:
        fused_chunk = max(1, math.ceil((fused[1] - fused[0]) / fused_splits(fused[1] - fused[0], N * G)))
    qg = (qw * scale).reshape(N, G, R * L, E)  # (N, G, R*L, E): rows r*L + l
    q_rows = qw.reshape(N, G, R * L, E)  # unscaled, for the fused kernel, which scales in float32
    sink_rows = None
    if sinks is not None:
        n = sinks.shape[0]
        sink_rows = sinks.to(acc).reshape(n, G, R, 1).expand(n, G, R, L).reshape(n, G, R * L, 1)  # (N | 1, G, R*L, 1)
    states: list[_State] = list(extra)  # (m, l, acc) per piece of chunks, each (N, G, c, R*L, ...)
    only_fused = True
    wave = stop - start if work == first_k.dtype else max(chunk, WIDEN_WAVE // chunk * chunk)
    # widened waves are copied into one buffer pair: a fresh float32 tensor per wave costs its
    # page faults (a new 16 MiB allocation is slower than the copy into it); autograd keeps
    # every wave, so with gradients each wave is its own tensor
    buffers = None
    if work != first_k.dtype and not grad and stop > start:
        size = min(wave, stop - start, max((k.shape[2] for _, k, _ in runs), default=1))
        buffers = (first_k.new_empty(N, G, size, E, dtype=work), first_v.new_empty(N, G, size, Ev, dtype=work))
    for position, k, v in runs:
        for first in range(max(start, position), min(stop, position + k.shape[2]), max(wave, 1)):
            last = min(first + wave, stop, position + k.shape[2])
            keys, values, offset = k, v, position
            if buffers is not None:
                keys = buffers[0][:, :, : last - first].copy_(k[:, :, first - position : last - position])  # (N, G, w, E)
                values = buffers[1][:, :, : last - first].copy_(v[:, :, first - position : last - position])  # (N, G, w, Ev)
                offset = first
            for a, b, inside in _pieces(first, last, fused):
                step = fused_chunk if inside else chunk
                body = (b - a) // step * step
                for x, y in ((a, a + body), (a + body, b)):
                    if y <= x:
                        continue
                    count = max(1, (y - x) // step)
                    only_fused = only_fused and inside
                    if inside:
                        states.append(_fused_states(q_rows, keys, values, x, y, offset, count, scale))
                    else:
                        states.append(
                            _chunk_states(qg, keys, values, x, y, offset, count, work, acc, lo, hi, valid, terms, R, L, grad)
                        )
    if only_fused and sink_rows is None and len(states) == 1 and states[0][2].shape[2] == 1:
        # one fused chunk and no sink: its output and lse are final (no merge, no second rounding)
        m, _, partial = states[0]
        out, lse = partial[:, :, 0], m[:, :, 0, :, 0].to(acc)  # (N, G, R*L, Ev), (N, G, R*L)
    else:
        out, lse = _merge(states, sink_rows, N, G, R * L, Ev, q, acc)
    return (
        out.reshape(N, G, R, L, Ev).reshape(N, H, L, Ev).to(q.dtype),  # (N, G, R*L, Ev) -> (N, H, L, Ev)
        lse.reshape(N, H, L),  # (N, G, R*L) -> (N, H, L)
    )


def decode_blocks(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    blocks: Sequence[int],
    S: int,
    scale: float,
    mask: Mask | None = None,
    terms: ScoreTerms | None = None,
    sinks: torch.Tensor | None = None,
    spans: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` for one sequence in a pool of blocks, nothing gathered: q (1, H, L, E),
    k_pool (num_blocks, P, G, E), v_pool (num_blocks, P, G, Ev) (FlashAttention's paged layout),
    ``blocks`` the physical blocks of positions 0 .. S - 1 in order.

    Where the compiled kernel runs (`native_reason`), it reads the blocks through the block
    table, one call whatever the pool's fragmentation, with the bits of a contiguous cache.
    Otherwise runs of consecutive physical blocks are strided views (`block_runs`). When there are more
    than `RUNS_APART` of them (a fragmented pool), the blocks whose keys every query sees go to
    the fused kernel in a few calls instead of one per run: each call takes a span of the pool
    whose blocks are at most `SPAN_GAP` apart as one strided sequence, the blocks of other
    sequences in it hidden by a (1, 1, 1, n*P) mask; the rest (edges, a part-filled last block)
    run as runs. ``spans=False``: never, for pools whose other blocks may hold anything (a
    NaN there would reach the output through its zero weight)."""
    P = k_pool.shape[1]
    N, H, L, E = q.shape
    G = k_pool.shape[2]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_pool, v_pool, *(terms.tensors() if terms else ())))
    used = list(blocks[: -(-S // P)])
    one_run = all(b == a + 1 for a, b in itertools.pairwise(used))
    like = (k_pool[0].transpose(0, 1)[None], v_pool[0].transpose(0, 1)[None])  # (1, G, P, E), (1, G, P, Ev)
    if not one_run and N == 1 and native_reason(q, *like, terms, grad) is None:
        # the compiled kernel reads the blocks through the table where they lie, in the blocks
        # of keys it reads a cache in: the bits of the same keys in a contiguous cache (and no
        # view per run: at 2,048 runs their views alone cost twice the kernel's step)
        table = torch.tensor([used], dtype=torch.int64, device=q.device)  # (1, blocks)
        result = _native_attention(q, k_pool, v_pool, scale, mask, terms, sinks, None, S, table)
        if result is not None:
            return result
    runs = block_runs(k_pool, v_pool, blocks, S)
    if len(runs) == 1:
        # one run is a contiguous cache (a strided view of the pool): the step of `qkv.attention`
        # on it, the compiled kernel where it runs, so the two give equal bits
        _, k, v = runs[0]
        kernel = "native_decode" if native_reason(q, k, v, terms, grad) is None else "decode"
        return decode_attention(q, k, v, scale, mask, terms, sinks, kernel=kernel)
    if not spans or len(runs) <= RUNS_APART or N != 1 or compute_dtype(q.dtype, q.device) != q.dtype:
        return decode_runs(q, runs, S, scale, mask, terms, sinks)
    start, stop, lo, hi, valid = _key_range(mask, N, L, S, q.device)
    fused = _fused_range(q, runs, start, stop, lo, hi, valid, terms, grad)
    first, last = (0, 0) if fused is None else (math.ceil(fused[0] / P), fused[1] // P)  # whole blocks inside
    if last <= first:
        return decode_runs(q, runs, S, scale, mask, terms, sinks)
    extra = _block_states(q.reshape(1, G, H // G * L, E), k_pool, v_pool, blocks[first:last], scale)
    rest = block_runs(k_pool, v_pool, blocks[:first], first * P)
    rest += [(last * P + a, k, v) for a, k, v in block_runs(k_pool, v_pool, blocks[last:], S - last * P)]
    return _decode(q, rest, S, scale, mask, terms, sinks, None, like, extra)


# A fragmented pool: beyond this many runs, whole blocks go to the fused kernel in spans
RUNS_APART = 16
# A span of the pool takes blocks at most this many blocks apart (the blocks between them, of
# other sequences, are read and masked: at most SPAN_GAP - 1 read in vain per block kept)
SPAN_GAP = 4


def block_runs(
    k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: Sequence[int], length: int
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Positions 0 .. length - 1 held in ``blocks`` of the pools (num_blocks, P, G, E) as one
    (first position, k (1, G, n, E), v (1, G, n, Ev)) per run of consecutive physical blocks:
    strided views, nothing copied."""
    P, G = k_pool.shape[1], k_pool.shape[2]
    runs, first = [], 0
    while first < len(blocks) and first * P < length:
        last = first + 1
        while last < len(blocks) and blocks[last] == blocks[last - 1] + 1:
            last += 1
        a, b = first * P, min(last * P, length)
        block = blocks[first]
        k = k_pool[block : block + last - first].reshape(-1, G, k_pool.shape[-1])[: b - a]  # (n, G, E): a view
        v = v_pool[block : block + last - first].reshape(-1, G, v_pool.shape[-1])[: b - a]  # (n, G, Ev)
        runs.append((a, k.transpose(0, 1)[None], v.transpose(0, 1)[None]))  # (1, G, n, E), (1, G, n, Ev)
        first = last
    return runs


def _block_states(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: Sequence[int], scale: float
) -> list[_State]:
    """Fused states of whole ``blocks`` (every query sees all their keys), one chunk per span of
    the pool: q (1, G, R*L, E) unscaled; states (1, G, 1, R*L, ...) per span."""
    G, E = q.shape[1], q.shape[3]
    order = sorted(blocks)
    spans, begin = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or order[i] - order[i - 1] > SPAN_GAP:
            spans.append(order[begin:i])
            begin = i
    states = []
    P = k_pool.shape[1]
    for span in spans:
        low, count = span[0], span[-1] - span[0] + 1
        keys = k_pool[low : low + count].reshape(count * P, G, E).transpose(0, 1)[None]  # (1, G, n*P, E): a view
        values = v_pool[low : low + count].reshape(count * P, G, -1).transpose(0, 1)[None]  # (1, G, n*P, Ev)
        hidden = None
        if len(span) < count:  # the blocks of other sequences between this one's: hidden by the mask
            mine = torch.zeros(count, dtype=torch.bool, device=q.device)
            mine[torch.tensor(span, device=q.device) - low] = True
            hidden = torch.zeros(count, P, dtype=q.dtype, device=q.device).masked_fill_(~mine[:, None], _NEG_INF)
            hidden = hidden.reshape(1, 1, 1, count * P)  # (1, 1, 1, n*P): every head and row
        # the span is one sequence of n*P keys to the kernel: long tasks, not one per 16-key block
        out, lse = cpu_flash_attention(q, keys, values, 0.0, False, attn_mask=hidden, scale=scale)  # (1, G, R*L, Ev), (1, G, R*L)
        m = lse.unsqueeze(2).unsqueeze(-1)  # (1, G, 1, R*L, 1)
        states.append((m, torch.ones_like(m), out.unsqueeze(2)))  # out (1, G, 1, R*L, Ev)
    return states


_State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def fused_splits(keys: int, tasks: int, threads: int | None = None) -> int:
    """Chunks for ``keys`` keys on the fused path, where each of ``tasks`` = N * G (sequence,
    KV head) pairs is already one task per chunk: enough chunks for `CHUNKS_PER_THREAD` tasks
    per intra-op thread, each of at least `MIN_CHUNK` keys, at least one.

    >>> fused_splits(32768, 8, threads=2), fused_splits(32768, 8, threads=16), fused_splits(300, 1, threads=16)
    (1, 8, 1)
    """
    threads = torch.get_num_threads() if threads is None else threads
    wanted = math.ceil(CHUNKS_PER_THREAD * threads / max(tasks, 1))
    return max(1, min(wanted, keys // MIN_CHUNK))


def _fused_range(
    q: torch.Tensor,
    runs: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    start: int,
    stop: int,
    lo: torch.Tensor | None,
    hi: torch.Tensor | None,
    valid: torch.Tensor | None,
    terms: ScoreTerms | None,
    grad: bool,
) -> tuple[int, int] | None:
    """The keys a <= t < b that every query sees, when PyTorch's fused CPU attention kernel can
    take them (else None): CPU, no gradient (its lse output has none, and the merge needs one),
    no score terms, no key padding, equal key and value widths, unit stride along the head dim."""
    if q.device.type != "cpu" or grad or valid is not None or (terms is not None and terms.active):
        return None
    if stop <= start or any(k.shape[-1] != v.shape[-1] or k.stride(-1) != 1 or v.stride(-1) != 1 for _, k, v in runs):
        return None
    if lo is None or hi is None:
        return start, stop
    a, b = int(lo.max()), int(hi.min()) + 1
    return (a, b) if b > a else None


def _pieces(first: int, last: int, fused: tuple[int, int] | None) -> list[tuple[int, int, bool]]:
    """Keys first..last-1 cut at the fused range's ends: (a, b, inside the fused range)."""
    if fused is None:
        return [(first, last, False)]
    a, b = max(first, fused[0]), min(last, fused[1])
    if b <= a:
        return [(first, last, False)]
    cuts = [(first, a, False), (a, b, True), (b, last, False)]
    return [c for c in cuts if c[1] > c[0]]


def _fused_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: int, b: int, offset: int, count: int, scale: float
) -> _State:
    """Softmax states of keys a..b-1, which every query sees, split into ``count`` equal chunks,
    from PyTorch's fused CPU attention kernel: each chunk's lse as its max, a sum of 1 and its
    normalized output, (N, G, c, R*L, 1), (N, G, c, R*L, 1), (N, G, c, R*L, Ev). q (N, G, R*L, E)
    unscaled; k and v hold key ``offset`` at their index 0.

    The kernel runs one task per (chunk, KV head), each reading its K/V chunk once for all R*L
    rows of the group, with float32 scores for bf16 inputs. Chunks are strided views of the
    cache: the chunk axis is the kernel's batch axis (stride C keys), so nothing is copied."""
    N, G, RL, E = q.shape
    C = (b - a) // count
    if count == 1:
        out, lse = cpu_flash_attention(q, k[:, :, a - offset : b - offset], v[:, :, a - offset : b - offset], 0.0, False, scale=scale)
        m = lse.unsqueeze(2).unsqueeze(-1)  # (N, G, R*L) -> (N, G, 1, R*L, 1)
        return m, torch.ones_like(m), out.unsqueeze(2)  # out (N, G, R*L, Ev) -> (N, G, 1, R*L, Ev)
    outs, lses = [], []
    for n in range(N):
        kc, vc = (_chunks(t[n], a - offset, count, C) for t in (k, v))  # (c, G, C, E), (c, G, C, Ev)
        out, lse = cpu_flash_attention(q[n].expand(count, G, RL, E), kc, vc, 0.0, False, scale=scale)  # (c, G, R*L, Ev), (c, G, R*L)
        outs.append(out.transpose(0, 1))  # (G, c, R*L, Ev)
        lses.append(lse.transpose(0, 1))  # (G, c, R*L)
    m = torch.stack(lses).unsqueeze(-1)  # (N, G, c, R*L, 1)
    return m, torch.ones_like(m), torch.stack(outs)  # ..., (N, G, c, R*L, Ev)


def _chunks(t: torch.Tensor, first: int, count: int, C: int) -> torch.Tensor:
    """``count`` chunks of C keys from key ``first`` of t (G, S, E) as a view (c, G, C, E)."""
    G, _, E = t.shape
    return t.as_strided((count, G, C, E), (C * t.stride(1), t.stride(0), t.stride(1), t.stride(2)),
                        t.storage_offset() + first * t.stride(1))  # fmt: skip



def _key_range(
    mask: Mask | None, N: int, L: int, S: int, device: torch.device
) -> tuple[int, int, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(start, stop, lo, hi, valid): the keys start <= t < stop that some query sees; per-query
    bounds lo, hi (B | 1, L) when some query in that range sees fewer keys (else None); the key
    validity (B | 1, S) bool of a key-padding mask (else None)."""
    if mask is None:
        return 0, S, None, None, None
    if isinstance(mask, KeyPadding):
        return 0, S, None, None, mask._valid(S, device)
    assert isinstance(mask, (Causal, SlidingWindow))
    (lo_first, hi_first), (lo_last, hi_last) = _row_bounds(mask, 0, L, S), _row_bounds(mask, L - 1, L, S)
    start, stop = lo_first, hi_last + 1  # both bounds grow with the query: its first and last rows
    if stop <= start:
        return 0, 0, None, None, None
    if lo_last <= start and hi_first >= stop - 1:
        return start, stop, None, None, None  # every query sees the whole range: no mask to apply
    lo, hi = mask.row_intervals(L, S, device)  # (1, L) each, clamped to [0, S - 1]
    return start, stop, lo, hi, None


def _row_bounds(mask: Causal | SlidingWindow, row: int, L: int, S: int) -> tuple[int, int]:
    """The first and last key query ``row`` sees, clamped to [0, S - 1] as `row_intervals` does,
    in Python integers (these masks' bounds take an int): the range of a decode step without
    building the (1, L) bounds, whose few tensor operations cost more than the kernel at short caches."""
    lo, hi = mask.bounds(row, L, S)
    return max(lo, 0), min(hi, S - 1)


def _chunk_states(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: int,
    b: int,
    offset: int,
    count: int,
    work: torch.dtype,
    acc: torch.dtype,
    lo: torch.Tensor | None,
    hi: torch.Tensor | None,
    valid: torch.Tensor | None,
    terms: ScoreTerms | None,
    R: int,
    L: int,
    grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax states of keys a..b-1 split into ``count`` equal chunks: row max m (N, G, c, R*L, 1),
    sum l (N, G, c, R*L, 1) and unnormalized output (N, G, c, R*L, Ev). k and v hold key
    ``offset`` at their index 0 (a widened wave); ``grad``: keep autograd's history (else the
    exponentials overwrite the scores in place)."""
    N, G, _, E = qg.shape
    C = (b - a) // count
    kc = k[:, :, a - offset : b - offset].to(work).reshape(N, G, count, C, E)  # (N, G, c, C, E)
    vc = v[:, :, a - offset : b - offset].to(work).reshape(N, G, count, C, v.shape[3])  # (N, G, c, C, Ev)
    # keys times queries, not queries times keys: a tall (C, E) x (E, R*L) product per chunk, which
    # BLAS runs near the read rate, where (R*L, E) x (E, C) is a slow matrix-vector shape
    scores = torch.matmul(kc, qg.unsqueeze(2).transpose(-1, -2)).to(acc)  # (N, G, c, C, R*L)
    positions = torch.arange(a, b, device=qg.device)  # (c*C,)
    if terms is not None and terms.softcap is not None:  # qkv's order: the softcap, then the bias
        cap = terms.softcap
        scores = torch.tanh(scores / cap) * cap if grad else scores.div_(cap).tanh_().mul_(cap)
    if terms is not None and terms.bias is not None:
        scores = scores + _bias_chunks(terms, positions, N, G, R, L, count, C).to(acc)
    hidden = None
    if lo is not None and hi is not None:
        j = positions.view(1, count, C, 1)  # (1, c, C, 1)
        lo_rows = lo.repeat(1, R)[:, None, None, :]  # (1, 1, 1, R*L): row r*L + l has query l's bound
        hi_rows = hi.repeat(1, R)[:, None, None, :]
        hidden = ((j < lo_rows) | (j > hi_rows)).unsqueeze(1)  # (1, 1, c, C, R*L)
    if valid is not None:
        padded = ~valid[:, a:b].reshape(valid.shape[0], 1, count, C, 1)  # (B | 1, 1, c, C, 1)
        hidden = padded if hidden is None else hidden | padded
    if hidden is not None:
        scores = scores.masked_fill(hidden, _NEG_INF)
    m = scores.amax(dim=-2, keepdim=True)  # (N, G, c, 1, R*L)
    shift = m.masked_fill(m == _NEG_INF, 0.0)  # rows of empty chunks: exp(-inf - 0) = 0
    p = torch.exp(scores - shift) if grad else scores.sub_(shift).exp_()  # (N, G, c, C, R*L)
    total = p.sum(dim=-2, keepdim=True)  # (N, G, c, 1, R*L)
    partial = torch.matmul(p.to(work).transpose(-1, -2), vc).to(acc)  # (N, G, c, R*L, Ev)
    m, total = m.transpose(-1, -2), total.transpose(-1, -2)  # (N, G, c, R*L, 1) each
    return m, total, partial


def _bias_chunks(terms: ScoreTerms, positions: torch.Tensor, N: int, G: int, R: int, L: int, count: int, C: int) -> torch.Tensor:
    """The bias of keys ``positions`` laid out as the chunk scores: (N | 1, G, c, C, R*L)."""
    bias = terms.bias
    assert bias is not None
    device = positions.device
    n = N if terms.batch_varies else 1
    b = torch.arange(n, device=device).view(n, 1, 1, 1)  # (N | 1, 1, 1, 1)
    h = torch.arange(G * R, device=device).view(1, G * R, 1, 1)  # (1, H, 1, 1)
    i = torch.arange(L, device=device).view(1, 1, L, 1)  # (1, 1, L, 1)
    j = positions.view(1, 1, 1, -1)  # (1, 1, 1, c*C)
    values = bias.terms(b, h, i, j, terms.q_pos(b, i))  # (N | 1, H | 1, L, c*C)
    values = values.expand(n, G * R, L, count * C)  # (N | 1, H, L, c*C)
    values = values.reshape(n, G, R, L, count, C).permute(0, 1, 4, 5, 2, 3)  # (N | 1, G, c, C, R, L)
    return values.reshape(n, G, count, C, R * L)  # (N | 1, G, c, C, R*L)


def _merge(
    states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    sink_rows: torch.Tensor | None,
    N: int,
    G: int,
    RL: int,
    Ev: int,
    q: torch.Tensor,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of every chunk's state, the sink joining the denominator once:
    (output (N, G, R*L, Ev), lse (N, G, R*L))."""
    if not states:  # no key visible to any query
        out = torch.zeros(N, G, RL, Ev, dtype=acc, device=q.device)
        return out, torch.full((N, G, RL), _NEG_INF, dtype=acc, device=q.device)
    m = torch.cat([s[0] for s in states], dim=2)  # (N, G, c, R*L, 1)
    total = torch.cat([s[1] for s in states], dim=2)  # (N, G, c, R*L, 1)
    partial = torch.cat([s[2].to(acc) for s in states], dim=2)  # (N, G, c, R*L, Ev)
    top = m.amax(dim=2)  # (N, G, R*L, 1)
    unseen = top == _NEG_INF  # rows with no visible key: zeros and lse -inf, sink or not
    if sink_rows is not None:
        top = torch.maximum(top, sink_rows)
    top = top.masked_fill(top == _NEG_INF, 0.0)  # rows with nothing: every weight below is exp(-inf) = 0
    weight = torch.exp(m - top.unsqueeze(2))  # (N, G, c, R*L, 1)
    den = (weight * total).sum(dim=2)  # (N, G, R*L, 1)
    if sink_rows is not None:
        den = den + torch.exp(sink_rows - top)
    out = (weight * partial).sum(dim=2)  # (N, G, R*L, Ev)
    empty = den == 0
    out = out / den.masked_fill(empty, 1.0)  # rows with no visible key stay zeros
    lse = (top + torch.log(den)).masked_fill(unseen, _NEG_INF).squeeze(-1)  # (N, G, R*L)
    return out, lse
