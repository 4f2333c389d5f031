"""qkv.nn.positional against formulas written independently here.

RoPE's reference uses complex numbers: a pair of features (a, b) is the complex a + ib, and
rotating it by the angle pos * theta is multiplying by exp(i * pos * theta).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv.nn.positional import LearnedEncoding, RotaryEmbedding, SinusoidalEncoding


def rope_complex(x: np.ndarray, positions: np.ndarray, layout: str, base: float = 10000.0) -> np.ndarray:
    """RoPE in complex float64 arithmetic. x (..., L, E), positions (L,) -> (..., L, E)."""
    E = x.shape[-1]
    theta = base ** (-np.arange(0, E, 2, dtype=np.float64) / E)  # (E/2,)
    rotation = np.exp(1j * positions[:, None].astype(np.float64) * theta)  # (L, E/2)
    if layout == "half":
        z = x[..., : E // 2] + 1j * x[..., E // 2 :]
        r = z * rotation
        return np.concatenate([r.real, r.imag], axis=-1)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    r = z * rotation
    out = np.empty_like(x, dtype=np.float64)
    out[..., 0::2], out[..., 1::2] = r.real, r.imag
    return out


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_matches_complex_rotation(layout):
    rope = RotaryEmbedding(10, max_len=64, layout=layout).double()
    x = torch.randn(2, 3, 7, 10, dtype=torch.float64)
    expected = rope_complex(x.numpy(), np.arange(5, 12), layout)
    # the tables are float32 (cos and sin rounded to ~6e-8) even for float64 inputs
    np.testing.assert_allclose(rope(x, offset=5).numpy(), expected, rtol=0, atol=1e-6)


def test_layouts_differ_and_keep_norms():
    x = torch.randn(4, 8, dtype=torch.float64)
    half = RotaryEmbedding(8, layout="half")(x, offset=3)
    interleaved = RotaryEmbedding(8, layout="interleaved")(x, offset=3)
    assert not torch.allclose(half, interleaved)
    torch.testing.assert_close(half.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    torch.testing.assert_close(interleaved.norm(dim=-1), x.norm(dim=-1))


@given(
    m=st.integers(0, 500),
    n=st.integers(0, 500),
    shift=st.integers(0, 500),
    layout=st.sampled_from(["half", "interleaved"]),
)
def test_rope_scores_depend_only_on_relative_position(m, n, shift, layout):
    rope = RotaryEmbedding(6, max_len=1001, layout=layout)
    gen = torch.Generator().manual_seed(m * 7 + n)
    q, k = torch.randn(1, 6, generator=gen, dtype=torch.float64), torch.randn(1, 6, generator=gen, dtype=torch.float64)
    at = (rope(q, offset=m) * rope(k, offset=n)).sum()
    shifted = (rope(q, offset=m + shift) * rope(k, offset=n + shift)).sum()
    torch.testing.assert_close(at, shifted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_accurate_at_long_positions_in_float32(layout):
    start = 100_000
    rope = RotaryEmbedding(64, max_len=start + 4, layout=layout)
    x = torch.randn(3, 4, 64)
    ours = rope(x, offset=start)
    expected = rope_complex(x.double().numpy(), np.arange(start, start + 4), layout)
    error = np.abs(ours.double().numpy() - expected).max()
    assert error < 2e-5, error

    # the test can tell: angles formed in float32, as a naive implementation does, are off
    positions = np.arange(start, start + 4)[:, None]  # (4, 1)
    theta = 10000.0 ** (-np.arange(0, 64, 2) / 64)  # (32,)
    naive_angles = positions.astype(np.float32) * theta.astype(np.float32)  # (4, 32), float32
    naive_error = np.abs(np.cos(naive_angles.astype(np.float64)) - np.cos(positions * theta)).max()
    assert naive_error > 50 * error


def test_rope_tables_stay_float32_in_a_low_precision_model():
    rope = RotaryEmbedding(8, max_len=32).to(torch.bfloat16)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    inside = qkv.MultiHeadAttention(16, 2, rope=RotaryEmbedding(8)).half()
    assert inside.q_proj.weight.dtype == torch.float16 and inside.rope.cos.dtype == torch.float32
    x = torch.randn(2, 5, 8).to(torch.bfloat16)
    out = rope(x, offset=20)
    assert out.dtype == torch.bfloat16
    expected = rope_complex(x.double().numpy(), np.arange(20, 25), "half")
    # bf16 keeps 8 bits: one rounding of the result, |x| < 5
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=0, atol=5 * 2**-8)


def test_rope_errors():
    with pytest.raises(ValueError, match="head_dim must be even, got 5"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match="layout must be one of 'half', 'interleaved'; got 'gptj'"):
        RotaryEmbedding(4, layout="gptj")
    rope = RotaryEmbedding(4, max_len=10)
    with pytest.raises(ValueError, match=r"positions 8..10 go past max_len=10"):
        rope(torch.randn(3, 4), offset=8)
    with pytest.raises(ValueError, match=r"needs x of shape \(..., L, 4\), got \(3, 6\)"):
        rope(torch.randn(3, 6))
    with pytest.raises(ValueError, match="offset must be an int >= 0, got -1"):
        rope(torch.randn(3, 4), offset=-1)


def test_sinusoidal_matches_the_paper_formula():
    D, max_len = 7, 50
    enc = SinusoidalEncoding(D, max_len=max_len)
    expected = np.zeros((max_len, D))
    for pos in range(max_len):
        for i in range(D):
            angle = pos / 10000 ** ((i - i % 2) / D)
            expected[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    x = torch.zeros(2, 10, D)
    np.testing.assert_allclose(enc(x, offset=40)[0].numpy(), expected[40:50], rtol=0, atol=1e-7)
    np.testing.assert_allclose(enc(x)[1, 0].numpy(), [0, 1, 0, 1, 0, 1, 0], atol=0)


def test_sinusoidal_shift_is_a_rotation():
    """PE(pos + k) is PE(pos) rotated pair by pair, the paper's argument for relative positions."""
    D = 8
    table = SinusoidalEncoding(D, max_len=40).table.double()  # (40, D)
    k = 9
    omega = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    s, c = table[:-k, 0::2], table[:-k, 1::2]  # sin, cos of pos * omega
    torch.testing.assert_close(table[k:, 0::2], s * torch.cos(k * omega) + c * torch.sin(k * omega), atol=1e-6, rtol=0)
    torch.testing.assert_close(table[k:, 1::2], c * torch.cos(k * omega) - s * torch.sin(k * omega), atol=1e-6, rtol=0)


def test_sinusoidal_adds_in_input_dtype_and_checks_length():
    enc = SinusoidalEncoding(4, max_len=6).half()
    assert enc.table.dtype == torch.float32
    x = torch.randn(1, 3, 4, dtype=torch.float16)
    out = enc(x, offset=2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, x + enc.table[2:5].half())
    with pytest.raises(ValueError, match=r"positions 4..6 go past max_len=6"):
        enc(x, offset=4)


def test_learned_encoding_adds_trainable_vectors():
    enc = LearnedEncoding(4, max_len=8)
    x = torch.randn(2, 3, 4)
    out = enc(x, offset=5)
    torch.testing.assert_close(out, x + enc.weight[5:8])
    out.sum().backward()
    assert enc.weight.grad is not None
    torch.testing.assert_close(enc.weight.grad[5:8], torch.full((3, 4), 2.0))  # batch of 2 adds twice
    assert bool((enc.weight.grad[:5] == 0).all())
    with pytest.raises(ValueError, match=r"positions 6..8 go past max_len=8"):
        enc(x, offset=6)
    with pytest.raises(ValueError, match=r"needs x of shape \(..., L, 4\), got \(2, 3, 5\)"):
        enc(torch.randn(2, 3, 5))
