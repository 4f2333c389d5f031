"""Type-checked by .ci/typecheck, never run: the common calls of every function whose result
depends on a flag get a precise type (a Tensor, or a tuple of the right length), so that
``out.shape`` and tuple unpacking check without casts. Inside a function: importing this
module (pytest's doctest collection) runs nothing."""

from __future__ import annotations

import torch

import qkv
from qkv.compat import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    flex_attention,
)


def _probe() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    cu = torch.tensor([0, 4])
    flag = bool(q.sum() > 0)

    out = qkv.attention(q, k, v)
    shape = out.shape
    out, w = qkv.attention(q, k, v, return_weights=True)
    out, lse = qkv.attention(q, k, v, return_lse=True)
    out, w, lse = qkv.attention(q, k, v, return_weights=True, return_lse=True)
    shapes = w.shape, lse.shape
    either = qkv.attention(q, k, v, return_weights=flag)  # a bool known at run time only: the union
    first = either[0] if isinstance(either, tuple) else either

    out = qkv.attention_varlen(q[0], k[0], v[0], cu)
    out, lse = qkv.attention_varlen(q[0], k[0], v[0], cu, return_lse=True)

    mha = qkv.MultiHeadAttention(8, 2)
    x = torch.randn(1, 4, 8)
    out = mha.forward(x)
    out, w = mha.forward(x, return_weights=True)

    out = flash_attn_func(q, k, v)
    out, lse, p = flash_attn_func(q, k, v, return_attn_probs=True)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4)
    out, lse, p = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, return_attn_probs=True)
    out = flash_attn_with_kvcache(q, k, v)
    out, lse = flash_attn_with_kvcache(q, k, v, return_softmax_lse=True)
    out = flex_attention(q, k, v)
    out, lse = flex_attention(q, k, v, return_lse=True)
    print(out.shape, lse.shape, p.shape, w.shape, first.shape, shape, shapes)
