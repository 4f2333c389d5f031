"""The explicit formula by query chunks: the math path under torch.compile without an L x S tensor.

Under torch.compile a score_mod (a Python function) or a predicate mask cannot enter the block
engine's operators, so the traced call takes the math path. Its formula traces whole, but it
holds (N, H, L, S) scores, exponentials and weights, and autograd saves the weights for the
backward: at n = 4,096 a training step ran 1.22x slower compiled than eagerly on the engine.

Here the queries are split into chunks of ``rows`` rows. Each chunk computes the same formula
(`qkv.backends.dense.scores_with_mask`: scale, score terms, mask, `masked_softmax`, weights times values) on
the keys its rows may see, by `qkv.masks.Mask.key_span` from the mask's Python parameters, so
torch.compile can decide them while it traces (a causal chunk skips the keys after its last
row). Each chunk runs under activation checkpointing (`torch.utils.checkpoint`): autograd
saves the chunk's inputs, and the backward recomputes its scores instead of keeping them.
What a call holds at once is one chunk's scores, (N, H, rows, keys), and Inductor fuses a
chunk's score terms, mask and softmax into a few loops.

Every value is the math path's, row for row: each query row's softmax runs over the same keys
(the hidden ones are -inf there and absent here) in the same accumulation dtype.

A score_mod (and a predicate) then runs inside the checkpointed regions, which Dynamo traces as
higher-order operators: like FlexAttention's, it must be a function of its arguments (and the
tensors it reads), without side effects. One that changes outside state (appends to a list,
counts its calls) breaks the graph there, and `torch.compile(fullgraph=True)` raises;
``qkv.backends.disabled("math_chunks")`` traces the whole formula instead.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint

from qkv.backends.dense import scores_with_mask
from qkv.backends.softmax import accumulation_bytes, accumulation_dtype, masked_softmax
from qkv.masks import Mask
from qkv.scores import ScoreTerms

__all__ = ["CHUNK_SCORE_BYTES", "chunk_rows", "chunk_spans", "chunked_attention", "chunked_extra_bytes", "chunked_pairs"]

# The scores of one chunk, in bytes, that `chunk_rows` aims at: 16 MiB. Measured under
# torch.compile with Inductor (training step with a score_mod, n = 4,096, B = 1, H = 4, E = 32,
# float32, AMD EPYC, 2 threads), compiled against eager qkv (the block engine) in the same run:
# 16 MiB chunks (256 rows) no mask 338 against 407 ms, causal 155 against 234 ms; 32 MiB 392
# against 355 and 210 against 206; 64 MiB 415 against 409 and 337 against 202. Larger chunks
# fall out of the caches, and a causal chunk computes more hidden pairs. The whole formula
# compiled took 467 and 443 ms.
CHUNK_SCORE_BYTES = 16 << 20
# Chunks are a multiple of this many rows, and at least as many.
_ROW_ALIGN = 64
# At most this many chunks. Each is a region of the compiled graph, and Inductor generates
# its kernels apart: the first call of the cases above compiled in 23-31 s with 16 chunks, 13-15
# s with 8 and 8-9 s with 4, against 3-4 s for the whole formula.
_MAX_CHUNKS = 16


def chunk_rows(N: int, H: int, L: int, S: int, dtype: torch.dtype) -> int:
    """Query rows per chunk for an (N, H, L, S) problem in ``dtype``: about `CHUNK_SCORE_BYTES`
    of scores per chunk, a multiple of 64 rows, at most 16 chunks; L itself when one chunk
    holds every row."""
    row_bytes = max(1, N * H * S * accumulation_bytes(dtype))
    rows = max(_ROW_ALIGN, CHUNK_SCORE_BYTES // row_bytes // _ROW_ALIGN * _ROW_ALIGN)
    fewest = -(-L // _MAX_CHUNKS)  # ceil(L / _MAX_CHUNKS)
    rows = max(rows, -(-fewest // _ROW_ALIGN) * _ROW_ALIGN)
    return min(rows, L)


def chunk_spans(
    mask: Mask | torch.Tensor | None, causal_offset: int | None, L: int, S: int, rows: int
) -> list[tuple[int, int, int, int]]:
    """(first, last, lo, hi) per chunk: query rows first..last against keys lo..hi, the keys
    they may see at most (`Mask.key_span`, then the causal offset); one key, which the mask
    hides, where they see none. Python numbers only: torch.compile decides them while it traces."""
    spans = []
    for first in range(0, L, rows):
        last = min(L, first + rows) - 1
        lo, hi = (0, S - 1) if not isinstance(mask, Mask) else mask.key_span(first, last, L, S)
        if causal_offset is not None:
            hi = min(hi, last + causal_offset)
        if lo > hi:  # these rows see no key: one key, hidden by the mask, gives empty rows
            lo = hi = 0
        spans.append((first, last, lo, hi))
    return spans


def chunked_pairs(spans: list[tuple[int, int, int, int]]) -> int:
    """The (query, key) pairs the chunks compute, per batch row and head."""
    return sum((last - first + 1) * (hi - lo + 1) for first, last, lo, hi in spans)


def chunked_extra_bytes(
    dtype: torch.dtype, spans: list[tuple[int, int, int, int]], *, N: int, H: int, L: int, Ev: int
) -> int:
    """Memory `chunked_attention` allocates beyond inputs and output: the largest chunk's
    scores, exponentials and weights, the chunks' outputs and lse before they are joined."""
    acc = accumulation_bytes(dtype)
    largest = max((last - first + 1) * (hi - lo + 1) for first, last, lo, hi in spans)
    return 3 * N * H * largest * acc + N * H * L * (acc + Ev * dtype.itemsize)


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | torch.Tensor | None,
    scale: float,
    *,
    rows: int,
    causal_offset: int | None = None,
    terms: ScoreTerms | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + terms, masked) v by chunks of ``rows`` query rows: (output
    (N, H, L, Ev) in q's dtype, lse (N, H, L) in the accumulation dtype).

    q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev); ``mask``: a `qkv.masks` object (evaluated
    per chunk by its ``visible``, on the keys of its ``key_span``), a tensor (N | 1, H | 1, L, S)
    (sliced per chunk) or None; ``causal_offset``: query i sees the keys j <= i + offset;
    ``sinks`` (N | 1, H): one attention-sink logit per head in every row's denominator.
    """
    L, S = q.shape[2], k.shape[2]
    outputs, lses = [], []
    for first, last, lo, hi in chunk_spans(mask, causal_offset, L, S, rows):
        mask_rows = mask[..., first : last + 1, lo : hi + 1] if isinstance(mask, torch.Tensor) else None
        chunk = functools.partial(
            _chunk_formula, scale=scale, first=first, first_key=lo, L=L, S=S,
            mask=mask if isinstance(mask, Mask) else None, causal_offset=causal_offset, terms=terms,
        )  # fmt: skip
        out, lse = torch.utils.checkpoint.checkpoint(
            chunk, q[:, :, first : last + 1], k[:, :, lo : hi + 1], v[:, :, lo : hi + 1], mask_rows, sinks,
            use_reentrant=False,
        )  # fmt: skip  # (N, H, rows, Ev), (N, H, rows)
        outputs.append(out)
        lses.append(lse)
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=2)  # (N, H, L, Ev), (N, H, L)


def _chunk_formula(
    q_rows: torch.Tensor,
    k_keys: torch.Tensor,
    v_keys: torch.Tensor,
    mask_rows: torch.Tensor | None,
    sinks: torch.Tensor | None,
    *,
    scale: float,
    first: int,
    first_key: int,
    L: int,
    S: int,
    mask: Mask | None,
    causal_offset: int | None,
    terms: ScoreTerms | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: query rows first.. (q_rows (N, H, R, E)) against keys first_key..
    (k_keys (N, G, K, E), v_keys (N, G, K, Ev)): (output (N, H, R, Ev), lse (N, H, R))."""
    N, H, R, _ = q_rows.shape
    G, K, Ev = k_keys.shape[1], k_keys.shape[2], v_keys.shape[3]
    acc = accumulation_dtype(q_rows.dtype)
    device = q_rows.device
    row_ids = torch.arange(first, first + R, device=device)
    scores = scores_with_mask(
        q_rows, k_keys, mask_rows, scale, causal_offset, terms, rows=row_ids, first_key=first_key
    )  # fmt: skip  # (N, G, r, R, K)
    if mask is not None:
        # the mask's own batch rows and heads (one where it does not vary over them)
        b = torch.arange(mask.batch or 1, device=device).view(-1, 1, 1, 1, 1)  # (N | 1, 1, 1, 1, 1)
        heads = torch.arange(mask.heads or 1, device=device)
        h = heads.view(1, G, H // G, 1, 1) if mask.heads not in (None, 1) else heads.view(1, 1, 1, 1, 1)  # (1, G | 1, r | 1, 1, 1)
        i = row_ids.view(1, 1, 1, R, 1)  # (1, 1, 1, R, 1)
        j = torch.arange(first_key, first_key + K, device=device).view(1, 1, 1, 1, K)  # (1, 1, 1, 1, K)
        scores = scores.masked_fill(~mask.visible(b, h, i, j, L, S), float("-inf"))
    sink = None if sinks is None else sinks.to(acc).reshape(sinks.shape[0], G, H // G, 1, 1)  # (N | 1, G, r, 1, 1)
    weights, lse = masked_softmax(scores, sink)  # (N, G, r, R, K), (N, G, r, R)
    out = torch.matmul(weights, v_keys.to(acc).unsqueeze(2))  # (N, G, r, R, Ev)
    return out.reshape(N, H, R, Ev).to(q_rows.dtype), lse.reshape(N, H, R)  # (N, H, R, Ev), (N, H, R)
