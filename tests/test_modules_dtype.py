"""MultiHeadAttention with bfloat16 parameters and under torch.autocast.

Judged by docs/design.md's tolerance rule against the float64 reference run on the same (bf16-
rounded) weights: the module's error at most 2x that of a naive module computed entirely in
bfloat16 (every projection, the scores, the softmax), plus a small floor.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from tests.test_modules import reference_output

FLOOR = 1e-3


def _naive_bf16(m: qkv.MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The module's formula with every op in bfloat16."""
    cfg = m.config
    B, L, _ = x.shape
    H, E = cfg.num_heads, cfg.d_k
    q = F.linear(x, m.q_proj.weight, m.q_proj.bias).view(B, L, H, E).transpose(1, 2)  # (B, H, L, E)
    k = F.linear(x, m.k_proj.weight, m.k_proj.bias).view(B, L, H, E).transpose(1, 2)  # (B, H, L, E)
    v = F.linear(x, m.v_proj.weight, m.v_proj.bias).view(B, L, H, E).transpose(1, 2)  # (B, H, L, E)
    scores = (q @ k.transpose(-1, -2)) * E**-0.5  # (B, H, L, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    heads = torch.softmax(scores, dim=-1) @ v  # (B, H, L, E)
    return m.out_proj(heads.transpose(1, 2).reshape(B, L, H * E))  # (B, L, D)


@pytest.mark.parametrize("masked", [False, True])
def test_bfloat16_parameters_by_the_tolerance_rule(masked: bool) -> None:
    torch.manual_seed(0)
    m = qkv.MultiHeadAttention(64, 4).to(torch.bfloat16)
    x = torch.randn(2, 37, 64).to(torch.bfloat16)
    mask = qkv.masks.causal() if masked else None
    dense = None if mask is None else mask.to_dense(37, 37)
    ref = torch.from_numpy(reference_output(m, x, None, None if dense is None else dense.numpy()).output)
    with torch.no_grad():
        ours = m(x, mask=mask)
        naive = _naive_bf16(m, x, dense)
    assert ours.dtype == torch.bfloat16
    err = (ours.double() - ref).abs().max().item()
    assert err <= 2 * (naive.double() - ref).abs().max().item() + FLOOR


def test_autocast_runs_the_products_in_bfloat16_and_stays_close() -> None:
    torch.manual_seed(1)
    m = qkv.MultiHeadAttention(32, 4)
    x = torch.randn(2, 20, 32)
    want = m(x, mask=qkv.masks.causal())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, weights = m(x, mask=qkv.masks.causal(), return_weights=True)
    assert got.dtype == torch.bfloat16 and weights.dtype == torch.float32
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)
    got.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


def test_mismatched_input_dtype_is_a_clear_error() -> None:
    m = qkv.MultiHeadAttention(16, 2).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"x is torch\.float32 on cpu but the layer's weights are torch\.bfloat16"):
        m(torch.randn(1, 3, 16))
    cross = qkv.MultiHeadAttention(16, 2, d_context=8).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"context is torch\.float32"):
        cross(torch.randn(1, 3, 16).to(torch.bfloat16), torch.randn(1, 4, 8))
