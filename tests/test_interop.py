"""MultiHeadAttention.from_torch and masks_from_torch against torch.nn.MultiheadAttention itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv
from qkv.nn.interop import masks_from_torch

B, L, S, D, H = 3, 5, 7, 12, 3


def batch_first(t: torch.Tensor, theirs: nn.MultiheadAttention) -> torch.Tensor:
    """PyTorch's (L, B, D) layout -> (B, L, D) when the module is not batch_first."""
    return t if theirs.batch_first else t.transpose(0, 1)


@pytest.mark.parametrize(
    ("bias", "first", "kdim", "cross", "train"),
    [
        (True, True, None, False, False),
        (True, False, None, False, True),
        (False, True, None, True, True),  # packed in_proj_weight used for cross-attention
        (True, True, 5, True, False),  # separate q/k/v_proj_weight
        (False, False, 5, True, True),
    ],
)
def test_same_outputs_and_weights_as_torch(bias, first, kdim, cross, train):
    theirs = nn.MultiheadAttention(D, H, bias=bias, batch_first=first, kdim=kdim, vdim=kdim).double()
    if bias:  # PyTorch starts its biases at zero; make them count
        with torch.no_grad():
            theirs.in_proj_bias.normal_()
            theirs.out_proj.bias.normal_()
    theirs.train(train)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    assert ours.training == train
    Dc = kdim or D
    x = torch.randn(B, L, D, dtype=torch.float64)
    c = torch.randn(B, S, Dc, dtype=torch.float64) if cross else x
    xt, ct = batch_first(x, theirs), batch_first(c, theirs)  # the same tensors in their layout
    assert ours.config.batch_first == first
    expected, expected_weights = theirs(xt, ct, ct, average_attn_weights=False)
    # both modules take and return the same layout: (L, B, D) when batch_first=False
    out, weights = ours(xt, ct if cross else None, return_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10)
    fast, _ = theirs(xt, ct, ct, need_weights=False)
    torch.testing.assert_close(ours(xt, ct if cross else None), fast, rtol=1e-10, atol=1e-10)


def test_sequence_first_module_is_not_read_batch_first():
    """batch_first=False with L != B: reading (L, B, D) as (B, L, D) would mix the batch rows."""
    theirs = nn.MultiheadAttention(D, H, batch_first=False).double().eval()
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(L, B, D, dtype=torch.float64)  # (L, B, D)
    with torch.no_grad():
        expected, _ = theirs(x, x, x, need_weights=False)
        out = ours(x)
    assert out.shape == (L, B, D)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # the same module read batch-first would be another computation entirely
    batch_major = qkv.MultiHeadAttention(D, H, batch_first=True).double()
    batch_major.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert not torch.allclose(batch_major(x), expected, atol=1e-3)


def test_float32_inference_path():
    """PyTorch's inference conditions (eval, no grad, self-attention, batch_first), float32."""
    theirs = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(2, 9, 32)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True
    with torch.no_grad():
        expected, _ = theirs(x, x, x, key_padding_mask=padding, need_weights=False)
        out = ours(x, mask=masks_from_torch(key_padding_mask=padding))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _torch_masks(kind: str, gen: torch.Generator) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(attn_mask, key_padding_mask) in PyTorch's conventions; no query row fully masked."""
    lengths = torch.tensor([S, 4, 2])
    padding = torch.arange(S)[None, :] >= lengths[:, None]  # (B, S), True = ignore
    if kind == "padding-bool":
        return None, padding
    if kind == "padding-float":
        return None, torch.randn(B, S, generator=gen, dtype=torch.float64)
    if kind == "attn-bool":
        ignore = torch.rand(L, S, generator=gen) > 0.6
        ignore[:, 0] = False  # every query keeps key 0
        return ignore, None
    if kind == "attn-float-3d":
        return torch.randn(B * H, L, S, generator=gen, dtype=torch.float64), None
    if kind == "both-bool":
        ignore = torch.rand(B * H, L, S, generator=gen) > 0.6
        ignore[..., 0] = False
        return ignore, padding
    if kind == "bool-and-float":
        return torch.randn(L, S, generator=gen, dtype=torch.float64), padding
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["padding-bool", "padding-float", "attn-bool", "attn-float-3d", "both-bool", "bool-and-float"]
)
@pytest.mark.parametrize("train", [False, True])
def test_masks_from_torch_give_torch_outputs(kind, train):
    gen = torch.Generator().manual_seed(len(kind))
    theirs = nn.MultiheadAttention(D, H, batch_first=True).double().train(train)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(B, L, D, dtype=torch.float64, generator=gen)
    c = torch.randn(B, S, D, dtype=torch.float64, generator=gen)
    attn_mask, key_padding_mask = _torch_masks(kind, gen)
    if kind == "bool-and-float":
        key_padding_mask = torch.zeros(B, S, dtype=torch.float64).masked_fill(key_padding_mask, float("-inf"))
    expected, expected_weights = theirs(
        x, c, c, attn_mask=attn_mask, key_padding_mask=key_padding_mask, average_attn_weights=False
    )
    mask = masks_from_torch(attn_mask, key_padding_mask, num_heads=H)
    out, weights = ours(x, c, mask=mask, return_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10)


def test_masks_from_torch_by_hand():
    assert masks_from_torch() is None
    ignore = torch.tensor([[False, True], [True, False]])  # (L, S)
    assert masks_from_torch(ignore).tolist() == [[True, False], [False, True]]
    padding = torch.tensor([[False, True], [False, False]])  # (B, S)
    both = masks_from_torch(ignore, padding)
    assert both.shape == (2, 1, 2, 2)
    assert both[0, 0].tolist() == [[True, False], [False, False]]
    assert both[1, 0].tolist() == [[True, False], [False, True]]
    mixed = masks_from_torch(torch.tensor([[0.5, -1.0], [2.0, 0.0]]), padding)
    assert mixed[0, 0].tolist() == [[0.5, float("-inf")], [2.0, float("-inf")]]
    assert mixed[1, 0].tolist() == [[0.5, -1.0], [2.0, 0.0]]
    per_head = masks_from_torch(torch.zeros(6, 2, 2, dtype=torch.bool), num_heads=3)
    assert per_head.shape == (2, 3, 2, 2) and bool(per_head.all())


def test_masks_from_torch_errors():
    with pytest.raises(ValueError, match=r"a 3-D attn_mask \(6, 2, 2\) is \(B\*H, L, S\); pass num_heads"):
        masks_from_torch(torch.zeros(6, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="first dim 6 is not a multiple of num_heads=4"):
        masks_from_torch(torch.zeros(6, 2, 2, dtype=torch.bool), num_heads=4)
    with pytest.raises(TypeError, match=r"key_padding_mask must be bool .* got torch\.int64"):
        masks_from_torch(key_padding_mask=torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, S\), got \(3,\)"):
        masks_from_torch(key_padding_mask=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask has S=3 keys but key_padding_mask has S=4"):
        masks_from_torch(torch.zeros(2, 3, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.bool))


def test_unsupported_modules_are_refused():
    with pytest.raises(ValueError, match="kdim=4 != vdim=6"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    with pytest.raises(ValueError, match="add_bias_kv=True"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn=True"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.MultiheadAttention, got Linear"):
        qkv.MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_dropout_matches_torch_in_distribution():
    """Dropout draws differ between the two implementations, so compare distributions.

    Each drops every attention weight with probability p and scales the rest by 1 / (1 - p),
    so over many draws both outputs average to the eval output and have the same variance.
    """
    p, draws = 0.3, 600
    theirs = nn.MultiheadAttention(8, 2, dropout=p, batch_first=True)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        clean = ours.eval()(x)
        ours.train()
        samples = {
            "ours": torch.stack([ours(x) for _ in range(draws)]).double(),  # (draws, B, L, D)
            "theirs": torch.stack([theirs(x, x, x, need_weights=False)[0] for _ in range(draws)]).double(),
        }
    for name, s in samples.items():
        std_error = s.std(dim=0) / draws**0.5  # (B, L, D)
        z = (s.mean(dim=0) - clean) / std_error
        assert z.abs().max() < 5, (name, z.abs().max())
    variance_ratio = samples["ours"].var(dim=0).mean() / samples["theirs"].var(dim=0).mean()
    assert 0.9 < variance_ratio < 1.1, variance_ratio
    assert samples["ours"].var(dim=0).mean() > 1e-4  # dropout is really on
