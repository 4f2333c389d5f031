"""Drop-in signatures of the attention functions people already call, on qkv's dispatcher.

Each function takes its peer's arguments with its peer's meaning and runs `qkv.attention`
(or `qkv.masks.varlen` / `padded` for packed and cached sequences), so the structured paths,
exact weights and `qkv.explain` apply. Switching is one import:

- PyTorch SDPA: `scaled_dot_product_attention` (``_sdpa.py``; ``is_causal`` top-left);
- FlashAttention 2: `flash_attn_func`, `flash_attn_varlen_func`, `flash_attn_with_kvcache`
  (``_flash.py``, ``_flash_varlen.py``, ``_flash_kvcache.py``; causal bottom-right, window -1
  unbounded, softcap 0.0 off, alibi_slopes);
- FlexAttention: `flex_attention`, `create_block_mask`, `and_masks`, `or_masks`,
  `from_block_mask` (``_flex.py``);
- xformers: `from_xformers` for its ``attn_bias`` types and `memory_efficient_attention`
  (``_xformers.py``).

Where a drop-in refuses an argument (a paged ``block_table``, rotary tables, ...) or
returns something else than its peer (FlashAttention's testing-only ``S_dmask``), its
docstring says so.
"""

from __future__ import annotations

from qkv.compat._flash import flash_attn_func
from qkv.compat._flash_kvcache import flash_attn_with_kvcache
from qkv.compat._flash_varlen import flash_attn_varlen_func
from qkv.compat._flex import (
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
    from_block_mask,
    or_masks,
)
from qkv.compat._sdpa import scaled_dot_product_attention
from qkv.compat._xformers import XformersBias, from_xformers, memory_efficient_attention

__all__ = [
    "BlockMask",
    "XformersBias",
    "and_masks",
    "create_block_mask",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flex_attention",
    "from_block_mask",
    "from_xformers",
    "memory_efficient_attention",
    "or_masks",
    "scaled_dot_product_attention",
]
