"""The one mask vocabulary of qkv: True = may attend, everywhere.

A mask object describes which keys each query may see without materializing the L x S
matrix. Every mask answers three questions:

- ``visible(b, h, q_idx, kv_idx, L, S)``: a vectorized predicate on broadcasting index
  tensors (the ``mask_mod`` of PyTorch's FlexAttention), used for the tiles the kernels
  compute and for `to_dense`;
- ``to_dense(L, S)``: the bool tensor (B | 1, H | 1, L, S) for the explicit paths and tests;
- ``layout(L, S, block_q, block_k)``: which tiles of the score matrix are empty, full or
  partial (`BlockLayout`), computed from the mask's structure: causal, sliding
  windows and prefix-LM from their per-query key intervals, documents from the smallest and
  largest id of each block, key padding from each key block. Only `dense` (a tensor that
  exists anyway) and `predicate` (an opaque function) evaluate every point, block row by
  block row. ``print(mask.draw(L, S))`` shows the layout.

Variable-length sequences (`varlen`, `padded`) align causal masks and windows bottom-right
to each document's own query and key lengths, as FlashAttention's varlen kernels do.

Positions are absolute and aligned bottom-right when L != S: query i sits at absolute
position i + S - L, so a decoding step (L = 1) sees the whole cache. With L = 2, S = 4::

    bottom-right (default)    top-left (PyTorch's is_causal)
        k0 k1 k2 k3               k0 k1 k2 k3
    q0   1  1  1  .           q0   1  .  .  .
    q1   1  1  1  1           q1   1  1  .  .

When L > S bottom-right alignment leaves the first L - S queries with no visible key:
their output rows are zeros (see `qkv.attention`).

Where things are: `Mask` and `Combined` (``&``, ``|``) in ``_base.py``; the interval masks
(`causal`, `sliding_window`, `prefix_lm`) in ``_interval.py``; the masks given by data
(`documents`, `key_padding`) in ``_data.py``; `varlen` and `padded` in ``_varlen.py``;
`predicate` and `dense` in ``_opaque.py``; `BlockLayout` and the tile states EMPTY, PARTIAL,
FULL in ``_layout.py``. The kernels read layouts; nothing here imports a kernel.

References: Beltagy et al., "Longformer" (2020) for sliding windows; Raffel et al., "T5"
(2020) for prefix-LM; Krell et al., "Efficient sequence packing without cross-contamination"
(2021) for packed documents; PyTorch's FlexAttention ``mask_mod`` / ``BlockMask`` API.
"""

from __future__ import annotations

from qkv.masks._base import POINTWISE_BUDGET, Combined, Mask
from qkv.masks._data import Documents, KeyPadding, documents, key_padding
from qkv.masks._interval import Causal, PrefixLM, SlidingWindow, causal, prefix_lm, sliding_window
from qkv.masks._layout import EMPTY, FULL, PARTIAL, BlockLayout
from qkv.masks._opaque import Dense, Predicate, dense, predicate
from qkv.masks._varlen import Padded, Varlen, padded, varlen

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "POINTWISE_BUDGET",
    "BlockLayout",
    "Causal",
    "Combined",
    "Dense",
    "Documents",
    "KeyPadding",
    "Mask",
    "Padded",
    "Predicate",
    "PrefixLM",
    "SlidingWindow",
    "Varlen",
    "causal",
    "dense",
    "documents",
    "key_padding",
    "padded",
    "predicate",
    "prefix_lm",
    "sliding_window",
    "varlen",
]
