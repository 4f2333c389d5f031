"""`qkv.compat.flex_attention` and its mask helpers against PyTorch's FlexAttention itself.

The peer runs eagerly on CPU in float64 (``torch.nn.attention.flex_attention.flex_attention``
without torch.compile), which warns (once per process) that it materializes the scores:
each peer call ignores exactly that warning. The masks are built with PyTorch's own ``create_block_mask``,
``and_masks`` and ``or_masks`` for the peer and with qkv's for the drop-in, from the same
mask_mod functions; PyTorch's BlockMask objects also go through `from_block_mask`.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import qkv
from qkv.compat import and_masks, create_block_mask, flex_attention, from_block_mask, or_masks

EAGER_WARNING = "flex_attention called without torch.compile"


def peer(q, k, v, **kwargs):
    # PyTorch warns once per process that the eager path materializes the scores: the point here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EAGER_WARNING, category=UserWarning)
        return torch_flex.flex_attention(q, k, v, **kwargs)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 3


def odd_heads_see_half(b, h, q_idx, kv_idx):
    return (h % 2 == 0) | (kv_idx % 2 == 0)


def second_row_sees_nothing_from_query_5(b, h, q_idx, kv_idx):
    return (b == 0) | (q_idx < 5)


DOCS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4])  # 21 keys


def same_document(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


def relative_bias(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (h + 1) * (q_idx - kv_idx).abs()


# name -> (mask_mod or None, B, H given to create_block_mask)
MASKS = {
    "none": (None, None, None),
    "causal": (causal, None, None),
    "causal&window": ("and", None, None),
    "document|window": ("or", None, None),
    "per-head": (odd_heads_see_half, None, 4),
    "per-row, empty rows": (second_row_sees_nothing_from_query_5, 2, None),
}


def _mods(name: str, ours: bool):
    mod = MASKS[name][0]
    both, either = (and_masks, or_masks) if ours else (torch_flex.and_masks, torch_flex.or_masks)
    if mod == "and":
        return both(causal, window)
    if mod == "or":
        return either(same_document, window)
    return mod


# (B, H, G, L, S, E, Ev)
SIZES = [(2, 4, 4, 21, 21, 8, 8), (2, 4, 2, 9, 21, 59, 16), (2, 4, 1, 21, 13, 16, 16)]
assert all(len(DOCS) >= max(s[3], s[4]) for s in SIZES)  # same_document indexes DOCS by query and key


@pytest.mark.parametrize("score_mod", [None, relative_bias])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("sizes", SIZES, ids=["L=S", "L<S, head dim 59, GQA", "L>S, MQA"])
def test_matches_pytorch_flex_attention(sizes, mask_name, score_mod) -> None:
    B, H, G, L, S, E, Ev = sizes
    gen = torch.Generator().manual_seed(L + S)
    q = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, S, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, S, Ev, generator=gen, dtype=torch.float64)
    _, mask_B, mask_H = MASKS[mask_name]
    ours_mod, theirs_mod = _mods(mask_name, True), _mods(mask_name, False)
    ours = None if ours_mod is None else create_block_mask(ours_mod, mask_B, mask_H, L, S)
    theirs = None if theirs_mod is None else torch_flex.create_block_mask(theirs_mod, mask_B, mask_H, L, S, device="cpu")
    gqa = G != H
    want, aux = peer(q, k, v, score_mod=score_mod, block_mask=theirs, enable_gqa=gqa, return_aux=torch_flex.AuxRequest(lse=True))
    want_lse = aux.lse
    for block_mask in (ours, None if theirs is None else from_block_mask(theirs), theirs):
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(lse[finite], want_lse[finite].to(lse.dtype), atol=1e-10, rtol=0)


def test_block_mask_from_kv_blocks_keeps_its_block_semantics() -> None:
    """A BlockMask built from block tables alone: full blocks are seen whole, partial blocks
    through its mask_mod, the others not at all."""
    L = S = 256
    counts = torch.tensor([[[1, 1]]], dtype=torch.int32)  # (1, 1, nQ): one partial block per row
    indices = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)  # row 0 -> block 0, row 1 -> block 1
    full_counts = torch.tensor([[[0, 1]]], dtype=torch.int32)
    full_indices = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)  # row 1 sees key block 0 whole
    theirs = torch_flex.BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, mask_mod=causal, seq_lengths=(L, S))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = peer(q, k, v, block_mask=theirs)
    converted = from_block_mask(theirs)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=converted), want, atol=1e-10, rtol=0)
    dense = converted.to_dense()[0, 0]
    assert dense[200, :128].all() and dense[200, 129:201].all() and not dense[200, 201:].any()
    assert dense[5, :6].all() and not dense[5, 6:].any()


def test_create_block_mask_is_a_qkv_mask() -> None:
    block_mask = create_block_mask(causal, None, None, 300, 300)
    assert block_mask.shape == (1, 1, 300, 300)
    q = k = v = torch.randn(1, 2, 300, 8, dtype=torch.float64)
    torch.testing.assert_close(
        qkv.attention(q, k, v, block_mask.mask), qkv.attention(q, k, v, qkv.masks.causal()), atol=1e-12, rtol=0
    )


def test_and_or_masks_with_no_mods() -> None:
    b = h = i = j = torch.tensor(0)
    assert bool(and_masks()(b, h, i, j)) and not bool(or_masks()(b, h, i, j))


def test_refusals() -> None:
    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flex_attention(q, k, k)
    with pytest.raises(ValueError, match=r"made for \(Q_LEN, KV_LEN\) = \(5, 6\)"):
        flex_attention(q, q, q, block_mask=create_block_mask(causal, None, None, 5, 6))
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        create_block_mask("causal", None, None, 5, 6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Q_LEN must be a positive int"):
        create_block_mask(causal, None, None, 0, 6)
    with pytest.raises(TypeError, match="takes mask_mod functions"):
        and_masks(causal, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="from_block_mask takes"):
        flex_attention(q, q, q, block_mask=object())
    with pytest.raises(TypeError, match="return_aux must be"):
        flex_attention(q, q, q, return_aux=object())
    with pytest.raises(ValueError, match="max_scores"):
        flex_attention(q, q, q, return_aux=torch_flex.AuxRequest(max_scores=True))


def test_return_aux_gives_the_lse() -> None:
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    out, aux = flex_attention(q, q, q, return_aux=torch_flex.AuxRequest(lse=True))
    want, want_lse = flex_attention(q, q, q, return_lse=True)
    assert torch.equal(out, want) and torch.equal(aux.lse, want_lse)
