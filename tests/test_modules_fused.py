"""The fused q, k, v projection of `MultiHeadAttention` (self-attention on many rows).

Expected values come from PyTorch's own ``nn.MultiheadAttention`` (converted with
`MultiHeadAttention.from_torch`), which projects with its packed ``in_proj_weight``. The inputs
have B * L >= d_model rows, the size at which the module runs one matrix multiply over the
three weights side by side: these tests check that it follows every change of the weights,
including updates through ``.data`` that no version counter records (a concatenation kept
between calls once went stale there).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qkv

D, H = 16, 4


def _pair(seed: int = 0) -> tuple[nn.MultiheadAttention, qkv.MultiHeadAttention]:
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(D, H, batch_first=True).eval()
    return theirs, qkv.MultiHeadAttention.from_torch(theirs)


def _check(theirs: nn.MultiheadAttention, ours: qkv.MultiHeadAttention, x: torch.Tensor) -> None:
    want = theirs(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(ours(x), want, rtol=1e-5, atol=1e-5)


def test_fused_projection_follows_in_place_updates_and_moves() -> None:
    theirs, ours = _pair()
    x = torch.randn(3, 7, D)  # 21 rows >= d_model: the fused projection
    with torch.no_grad():
        _check(theirs, ours, x)
        _check(theirs, ours, x)  # a second call: nothing kept from the first may go stale
        # an in-place update (what an optimizer step or copy_ does) of every projection
        theirs.in_proj_weight.mul_(1.5)
        theirs.in_proj_bias.add_(0.25)
        for proj, (w, b) in zip(
            (ours.q_proj, ours.k_proj, ours.v_proj),
            zip(theirs.in_proj_weight.chunk(3), theirs.in_proj_bias.chunk(3), strict=True),
            strict=True,
        ):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        _check(theirs, ours, x)
        # a state dict loaded into the module, then a move to another dtype
        ours.load_state_dict(qkv.MultiHeadAttention.from_torch(_pair(seed=1)[0]).state_dict())
        _check(_pair(seed=1)[0], ours, x)
        theirs64, ours64 = _pair(seed=1)[0].double(), ours.double()
        _check(theirs64, ours64, x.double())
        # an EMA-style step through .data: values change, version counters and addresses do not
        for module in (theirs64, ours64):
            for p in module.parameters():
                p.data.mul_(0.5)
        _check(theirs64, ours64, x.double())


# (H, D // H): one layout for q, k, v, the head-major copy; (2, 3): GQA and Ev != E, the split
@pytest.mark.parametrize(("kv_heads", "d_v"), [(H, D // H), (2, 3)])
def test_gradients_through_the_fused_projection(kv_heads: int, d_v: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 9, D, dtype=torch.float64)  # 18 rows >= d_model
    ours = qkv.MultiHeadAttention(D, H, num_kv_heads=kv_heads, d_v=d_v).double()
    with torch.no_grad():
        ours(x)  # a kept concatenation from an earlier inference call must not leak in
    out = ours(x.requires_grad_(True))
    assert out.requires_grad
    # finite differences through the q, k, v weights: the concatenation is differentiated
    params = (ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight)

    def f(*weights: torch.Tensor) -> torch.Tensor:
        state = dict(zip(("q_proj.weight", "k_proj.weight", "v_proj.weight"), weights, strict=True))
        return torch.func.functional_call(ours, state, (x,))

    inputs = tuple(p.detach().clone().requires_grad_(True) for p in params)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, fast_mode=True)
