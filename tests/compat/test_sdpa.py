"""`qkv.compat.scaled_dot_product_attention` against PyTorch's SDPA itself, in float64.

Awkward sizes (1, 7, 97, head dim 59), L != S both ways, E != Ev, GQA with enable_gqa,
one key head broadcast, bool and float masks with fully masked rows, is_causal (top-left)
with L < S and L > S, several batch dims and (L, E) inputs; then SDPA's refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.compat import scaled_dot_product_attention

# (batch dims, H, G, L, S, E, Ev)
SIZES = [
    ((2,), 4, 4, 7, 7, 8, 8),
    ((1,), 3, 3, 5, 97, 59, 13),
    ((2,), 4, 2, 13, 5, 16, 16),
    ((2, 3), 2, 1, 1, 9, 4, 4),
    ((), 6, 3, 7, 11, 8, 5),
]
MASKS = ("none", "bool", "bool-empty-rows", "float", "float-empty-rows", "causal")


def _case(sizes: tuple, mask_kind: str, seed: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    batch, H, G, L, S, E, Ev = sizes
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H, L, E, generator=gen, dtype=torch.float64)
    k = torch.randn(*batch, G, S, E, generator=gen, dtype=torch.float64)
    v = torch.randn(*batch, G, S, Ev, generator=gen, dtype=torch.float64)
    kwargs: dict = {"enable_gqa": G != H}
    if mask_kind.startswith("bool"):
        mask = torch.rand(L, S, generator=gen) > 0.5
        if mask_kind.endswith("empty-rows"):
            mask[::2] = False
        kwargs["attn_mask"] = mask
    elif mask_kind.startswith("float"):
        mask = torch.randn(H, L, S, generator=gen, dtype=torch.float64)
        if mask_kind.endswith("empty-rows"):
            mask[:, -1] = float("-inf")
        kwargs["attn_mask"] = mask
    elif mask_kind == "causal":
        kwargs["is_causal"] = True
    return (q, k, v), kwargs


def _peer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    if q.ndim == 3:  # PyTorch's SDPA wants a batch dim for enable_gqa
        return F.scaled_dot_product_attention(q[None], k[None], v[None], **kwargs)[0]  # type: ignore[arg-type]
    return F.scaled_dot_product_attention(q, k, v, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("sizes", SIZES, ids=[f"case{i}" for i in range(len(SIZES))])
def test_matches_pytorch_sdpa(sizes: tuple, mask_kind: str, scale: float | None) -> None:
    (q, k, v), kwargs = _case(sizes, mask_kind, seed=len(mask_kind))
    got = scaled_dot_product_attention(q, k, v, scale=scale, **kwargs)
    want = _peer(q, k, v, scale=scale, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_is_causal_is_top_left_unlike_qkv_causal() -> None:
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])  # query 0 sees key 0 only (top-left)
    assert not torch.allclose(out, qkv.attention(q, k, v, qkv.masks.causal()))


def test_two_dim_inputs_and_gradients() -> None:
    q, k, v = (torch.randn(6, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got = scaled_dot_product_attention(q, k, v, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_dropout_is_applied_and_zero_dropout_is_exact() -> None:
    q = k = v = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    plain = scaled_dot_product_attention(q, k, v)
    assert torch.equal(plain, scaled_dot_product_attention(q, k, v, dropout_p=0.0))
    assert not torch.allclose(plain, scaled_dot_product_attention(q, k, v, dropout_p=0.5))


def test_refusals_before_any_work() -> None:
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="not both"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        scaled_dot_product_attention(q, q, q, is_causal=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"key must be a torch\.Tensor"):
        scaled_dot_product_attention(q, [1.0], v)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dropout"):
        scaled_dot_product_attention(q, q, q, dropout_p=1.0)
