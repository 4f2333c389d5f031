"""qkv.MultiHeadAttention against the NumPy float64 reference, and its module contract.

The reference (`qkv.reference.multi_head_attention`) takes per-head matrices w_q (H, D, E),
w_k (G, Dc, E), w_v (G, Dc, Ev), w_o (H*Ev, D); they are cut here from the module's
`nn.Linear` weights by the documented convention (head h = output features [h*E, (h+1)*E)).
"""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import functional_call

import qkv
from qkv import reference
from qkv.nn.positional import RotaryEmbedding


def reference_output(
    m: qkv.MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None, mask: np.ndarray | None
) -> reference.MultiHeadTrace:
    """Run the float64 reference on the module's weights."""
    cfg = m.config
    H, G, E, Ev = cfg.num_heads, cfg.num_kv_heads, cfg.d_k, cfg.d_v

    def per_head(linear: torch.nn.Linear, heads: int, width: int) -> tuple[np.ndarray, np.ndarray | None]:
        w = linear.weight.detach().double().numpy()  # (heads * width, D_in)
        w = w.T.reshape(w.shape[1], heads, width).transpose(1, 0, 2)  # (heads, D_in, width)
        b = None if linear.bias is None else linear.bias.detach().double().numpy().reshape(heads, width)
        return w, b

    w_q, b_q = per_head(m.q_proj, H, E)
    w_k, b_k = per_head(m.k_proj, G, E)
    w_v, b_v = per_head(m.v_proj, G, Ev)
    w_o = m.out_proj.weight.detach().double().numpy().T  # (H * Ev, D)
    b_o = None if m.out_proj.bias is None else m.out_proj.bias.detach().double().numpy()
    return reference.multi_head_attention(
        x.double().numpy(), w_q, w_k, w_v, w_o,
        context=None if context is None else context.double().numpy(),
        mask=mask, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o,
    )


def make_mask(kind: str, B: int, H: int, L: int, S: int, gen: torch.Generator):
    """(mask for the module, the same mask as a NumPy array for the reference)."""
    if kind == "none":
        return None, None
    if kind == "causal":
        return qkv.masks.causal(), qkv.masks.causal().to_dense(L, S).numpy()
    if kind == "padding":
        # batch row 0 sees its first keys only; the last row sees no key at all (empty rows)
        lengths = torch.randint(1, S + 1, (B,), generator=gen)
        lengths[-1] = 0
        valid = torch.arange(S)[None, :] < lengths[:, None]  # (B, S)
        mask = valid[:, None, None, :]  # (B, 1, 1, S)
        return mask, mask.numpy()
    if kind == "float":
        mask = torch.randn(B, H, L, S, generator=gen, dtype=torch.float64)
        return mask, mask.numpy()
    raise AssertionError(kind)


CONFIGS = [
    # D, H, d_k, d_v, G, Dc (None: self-attention), bias, mask
    (12, 3, 5, 7, 3, None, True, "none"),
    (16, 4, 6, 3, 2, None, True, "causal"),
    (10, 6, 4, 5, 1, 7, True, "padding"),
    (8, 4, None, None, 4, 8, False, "float"),
    (9, 3, 2, 11, 3, None, False, "padding"),
]


@pytest.mark.parametrize(("D", "H", "d_k", "d_v", "G", "Dc", "bias", "mask_kind"), CONFIGS)
def test_matches_float64_reference(D, H, d_k, d_v, G, Dc, bias, mask_kind):
    gen = torch.Generator().manual_seed(D * 100 + H)
    B, L = 3, 7
    S = L if Dc is None else 9
    m = qkv.MultiHeadAttention(D, H, d_k=d_k, d_v=d_v, num_kv_heads=G, d_context=Dc, bias=bias).double()
    x = torch.randn(B, L, D, generator=gen, dtype=torch.float64)
    context = None if Dc is None else torch.randn(B, S, Dc, generator=gen, dtype=torch.float64)
    mask, np_mask = make_mask(mask_kind, B, H, L, S, gen)

    out, weights = m(x, context, mask=mask, return_weights=True)
    expected = reference_output(m, x, context, np_mask)
    np.testing.assert_allclose(out.detach().numpy(), expected.output, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(weights.detach().numpy(), expected.heads.weights, rtol=1e-10, atol=1e-10)
    # the call without weights takes the fast path and must give the same output
    np.testing.assert_allclose(m(x, context, mask=mask).detach().numpy(), expected.output, rtol=1e-10, atol=1e-10)


@given(
    H=st.integers(1, 4),
    group=st.integers(1, 3),
    d_k=st.integers(1, 6),
    d_v=st.integers(1, 6),
    L=st.integers(1, 6),
    cross=st.booleans(),
    causal=st.booleans(),
)
def test_random_configs_match_reference(H, group, d_k, d_v, L, cross, causal):
    """GQA through num_kv_heads = H / group, widths unrelated to D / H."""
    gen = torch.Generator().manual_seed(H * 1000 + group * 100 + d_k * 10 + d_v)
    D, G = 5, H
    H = H * group
    S = L + 2 if cross else L
    m = qkv.MultiHeadAttention(D, H, d_k=d_k, d_v=d_v, num_kv_heads=G, d_context=3 if cross else None).double()
    x = torch.randn(2, L, D, generator=gen, dtype=torch.float64)
    context = torch.randn(2, S, 3, generator=gen, dtype=torch.float64) if cross else None
    mask = qkv.masks.causal() if causal else None
    expected = reference_output(m, x, context, qkv.masks.causal().to_dense(L, S).numpy() if causal else None)
    np.testing.assert_allclose(m(x, context, mask=mask).detach().numpy(), expected.output, rtol=1e-10, atol=1e-10)


def test_float32_close_to_reference():
    m = qkv.MultiHeadAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 33, 32)
    out = m(x, mask=qkv.masks.causal())
    expected = reference_output(m, x, None, qkv.masks.causal().to_dense(33, 33).numpy())
    np.testing.assert_allclose(out.detach().numpy(), expected.output, rtol=1e-4, atol=1e-5)


def test_defaults_and_parameters():
    m = qkv.MultiHeadAttention(24, 4)
    cfg = m.config
    assert (cfg.d_k, cfg.d_v, cfg.num_kv_heads, cfg.d_context) == (6, 6, 4, 24)
    shapes = {name: tuple(p.shape) for name, p in m.named_parameters()}
    assert shapes == {
        "q_proj.weight": (24, 24), "q_proj.bias": (24,),
        "k_proj.weight": (24, 24), "k_proj.bias": (24,),
        "v_proj.weight": (24, 24), "v_proj.bias": (24,),
        "out_proj.weight": (24, 24), "out_proj.bias": (24,),
    }
    gqa = qkv.MultiHeadAttention(24, 6, d_k=5, d_v=3, num_kv_heads=2, d_context=7, bias=False)
    shapes = {name: tuple(p.shape) for name, p in gqa.named_parameters()}
    assert shapes == {
        "q_proj.weight": (30, 24), "k_proj.weight": (10, 7), "v_proj.weight": (6, 7), "out_proj.weight": (24, 18),
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 10, "num_heads": 4}, "not divisible by num_heads=4"),
        ({"d_model": 8, "num_heads": 4, "num_kv_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"d_model": 8, "num_heads": 0}, "num_heads must be a positive int, got 0"),
        ({"d_model": 8, "num_heads": 2, "dropout": 1.0}, "dropout must be a probability in \\[0, 1\\), got 1.0"),
        ({"d_model": 8, "num_heads": 2, "rope": RotaryEmbedding(6)}, "rope.head_dim=6 must equal d_k=4"),
    ],
)
def test_bad_construction_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        qkv.MultiHeadAttention(**kwargs)


def test_bad_inputs_raise_before_work():
    m = qkv.MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, 8\), got \(2, 5, 6\)"):
        m(torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match=r"context must have shape \(B, S, 8\), got \(2, 4, 3\)"):
        m(x, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="x has batch 2 but context has batch 3"):
        m(x, torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 1, 4\) does not broadcast"):
        m(x, mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got torch\.int64"):
        m(x, mask=torch.ones(5, 5, dtype=torch.long))
    cross = qkv.MultiHeadAttention(8, 2, d_context=3)
    with pytest.raises(ValueError, match="cross-attention layer: pass context"):
        cross(x)
    roped = qkv.MultiHeadAttention(8, 2, rope=RotaryEmbedding(4, max_len=4))
    with pytest.raises(ValueError, match=r"positions 0..4 go past max_len=4"):
        roped(x)
    with pytest.raises(ValueError, match="rope applies to self-attention only"):
        roped(x, torch.randn(2, 3, 8))


def test_return_weights_is_exact_and_leaves_output_unchanged():
    m = qkv.MultiHeadAttention(16, 4, d_k=3, d_v=5, num_kv_heads=2)
    x = torch.randn(2, 6, 16)
    out, weights = m(x, mask=qkv.masks.causal(), return_weights=True)
    torch.testing.assert_close(out, m(x, mask=qkv.masks.causal()), rtol=1e-5, atol=1e-6)
    assert weights.shape == (2, 4, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    assert bool((weights.triu(diagonal=1) == 0).all())  # causal: nothing above the diagonal


def test_dropout_only_in_training():
    m = qkv.MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    plain = qkv.MultiHeadAttention(16, 4)
    plain.load_state_dict(m.state_dict())
    m.eval()
    torch.testing.assert_close(m(x), plain(x))
    m.train()
    assert not torch.allclose(m(x), plain(x))


def test_dropped_weights_are_the_ones_that_produced_the_output():
    """Training with dropout and return_weights: out = out_proj(concat(weights @ V)).

    Checked against the module's own projections recomputed here in float64, and the kept
    weights against the eval-mode weights scaled by 1 / (1 - p).
    """
    p = 0.4
    m = qkv.MultiHeadAttention(12, 3, d_k=4, d_v=2, dropout=p).double().train()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    out, weights = m(x, return_weights=True)
    v = m.v_proj(x).view(2, 5, 3, 2).transpose(1, 2)  # (B, H, S, Ev)
    concat = (weights @ v).transpose(1, 2).reshape(2, 5, 6)  # (B, L, H * Ev)
    torch.testing.assert_close(out, m.out_proj(concat), rtol=1e-10, atol=1e-10)
    m.eval()
    _, clean = m(x, return_weights=True)
    kept = weights != 0
    assert 0.3 < 1 - kept.double().mean().item() < 0.5  # about p of the 150 weights dropped
    torch.testing.assert_close(weights[kept], clean[kept] / (1 - p), rtol=1e-10, atol=1e-12)


def test_gradients_reach_every_parameter():
    rope = RotaryEmbedding(4, layout="interleaved")
    m = qkv.MultiHeadAttention(12, 4, d_k=4, d_v=3, num_kv_heads=2, rope=rope).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    m(x, mask=qkv.masks.causal()).square().sum().backward()
    for name, param in m.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().sum() > 0), name
    assert x.grad is not None

    # and the gradients are the right ones: finite differences through every parameter
    params = {name: p.detach().clone().requires_grad_(True) for name, p in m.named_parameters()}
    names = list(params)

    def f(x, *values):
        return functional_call(m, dict(zip(names, values, strict=True)), (x,), {"mask": qkv.masks.causal()})

    inputs = (x.detach().clone().requires_grad_(True), *params.values())
    # fast_mode checks random directions of the Jacobian instead of all of it
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


def test_cross_attention_gradients_reach_context():
    m = qkv.MultiHeadAttention(6, 2, d_context=4).double()
    x = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    c = torch.randn(1, 5, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([True, True, True, False, True])[None, None, None, :]  # (1, 1, 1, S)
    assert torch.autograd.gradcheck(lambda x, c: m(x, c, mask=mask), (x, c))


def test_permutation_equivariance_without_positions():
    """The seeds' point: permuting the tokens permutes the outputs; RoPE breaks this."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 6, 8, generator=gen, dtype=torch.float64)
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    plain = qkv.MultiHeadAttention(8, 2).double()
    torch.testing.assert_close(plain(x[:, perm]), plain(x)[:, perm], rtol=1e-12, atol=1e-12)
    roped = qkv.MultiHeadAttention(8, 2, rope=RotaryEmbedding(4)).double()
    assert not torch.allclose(roped(x[:, perm]), roped(x)[:, perm], atol=1e-6)


def _compiler_missing() -> str | None:
    if sys.platform == "win32":
        return "torch.compile's inductor backend is not supported on Windows"
    if not any(shutil.which(cc) for cc in ("g++", "clang++", "c++")):
        return "no C++ compiler on PATH: inductor cannot build CPU kernels"
    return None


@pytest.mark.skipif(_compiler_missing() is not None, reason=str(_compiler_missing()))
def test_torch_compile_matches_eager():
    m = qkv.MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 8, 16, requires_grad=True)
    eager = m(x, mask=qkv.masks.causal())
    eager.sum().backward()
    eager_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    compiled = torch.compile(m, fullgraph=False)
    out = compiled(x, mask=qkv.masks.causal())
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    for grad, expected in zip((p.grad for p in m.parameters()), eager_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)
