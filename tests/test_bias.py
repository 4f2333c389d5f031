"""qkv.bias against independent sources: transformers' T5 bucketing and bias, transformers'
BLOOM slopes, the ALiBi paper's formula computed by hand; construction errors."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv import bias as Bi


def test_relative_bucket_matches_transformers_t5() -> None:
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-700, 701)
    for bidirectional in (True, False):
        for num_buckets, max_distance in ((32, 128), (8, 20), (64, 512)):
            ours = Bi.relative_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
            theirs = t5.T5Attention._relative_position_bucket(
                rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
            )
            assert torch.equal(ours, theirs), (bidirectional, num_buckets, max_distance)


@pytest.mark.parametrize(("L", "S", "decoder"), [(7, 7, False), (3, 9, True), (1, 40, True), (200, 200, False)])
def test_relative_bias_matches_transformers_t5_compute_bias(L: int, S: int, decoder: bool) -> None:
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from transformers import T5Config

    config = T5Config(d_model=16, d_kv=4, num_heads=3, is_decoder=decoder, relative_attention_num_buckets=32)
    layer = t5.T5Attention(config, has_relative_attention_bias=True)
    torch.nn.init.normal_(layer.relative_attention_bias.weight)
    with torch.no_grad():
        # a decoding step of L new queries after S - L cached positions: bottom-right as in qkv
        theirs = layer.compute_bias(L, S, past_seen_tokens=S - L)  # (1, H, L, S)
        ours = Bi.relative(layer.relative_attention_bias.weight.T, bidirectional=not decoder).to_dense(L, S)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def _paper_slopes(H: int) -> list[float]:
    """Press et al. section 3, by hand: ratio 2^(-8/n) from 2^(-8/n); for H not a power of two
    the first n = 2^floor(log2 H) of those and every other slope of 2n heads."""
    n = 2 ** math.floor(math.log2(H))
    own = [2 ** (-8 * i / n) for i in range(1, n + 1)]
    double = [2 ** (-8 * i / (2 * n)) for i in range(1, 2 * n + 1)]
    return own + double[0::2][: H - n]


def test_alibi_slopes_by_hand() -> None:
    assert Bi.alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]
    assert Bi.alibi_slopes(1).tolist() == [2.0**-8]
    # 12 heads: the 8 of H = 8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other of 16 heads)
    expected = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    torch.testing.assert_close(Bi.alibi_slopes(12), torch.tensor(expected, dtype=torch.float64))
    for H in (3, 5, 6, 7, 20, 48):
        torch.testing.assert_close(Bi.alibi_slopes(H), torch.tensor(_paper_slopes(H), dtype=torch.float64))


@pytest.mark.parametrize("H", [1, 5, 8, 12, 40])
def test_alibi_slopes_match_transformers_bloom(H: int) -> None:
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    # (H, 1, 2): each head's slope times the positions 0 and 1 of an unpadded sequence
    theirs = bloom.build_alibi_tensor(torch.ones(1, 2), H, torch.float32)[:, 0, 1]
    torch.testing.assert_close(Bi.alibi_slopes(H).float(), theirs, rtol=1e-6, atol=0)


def test_alibi_to_dense_is_minus_slope_times_distance_bottom_right() -> None:
    slopes = torch.tensor([0.5, 0.25])
    dense = Bi.alibi(slopes).to_dense(2, 4)  # queries at positions 2 and 3
    expected = torch.tensor([[2.0, 1.0, 0.0, 1.0], [3.0, 2.0, 1.0, 0.0]])
    torch.testing.assert_close(dense[0, 0], -0.5 * expected)
    torch.testing.assert_close(dense[0, 1], -0.25 * expected)
    # default slopes resolve to the number of heads asked for
    assert Bi.alibi().to_dense(3, 3, H=5).shape == (1, 5, 3, 3)


def test_sums_and_plain_tensors() -> None:
    table = torch.randn(2, 32)
    t = torch.randn(2, 5, 5)
    total = Bi.alibi(torch.tensor([1.0, 2.0])) + Bi.relative(table) + t
    assert isinstance(total, Bi.Sum) and len(total.parts) == 3
    expected = Bi.alibi(torch.tensor([1.0, 2.0])).to_dense(5, 5) + Bi.relative(table).to_dense(5, 5) + t
    torch.testing.assert_close(total.to_dense(5, 5), expected)
    assert (t + Bi.relative(table)).parts[0].tensor is t  # a tensor on the left works too
    assert "alibi(2 heads) + relative(2 heads" in total.describe()
    assert total.tensors()[1] is table


def test_bad_biases_are_refused_with_clear_errors() -> None:
    with pytest.raises(TypeError, match="float tensor"):
        Bi.alibi(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"\(H,\)"):
        Bi.alibi(torch.ones(2, 2))
    with pytest.raises(ValueError, match="num_buckets=32"):
        Bi.relative(torch.zeros(4, 16))
    with pytest.raises(ValueError, match="max_distance"):
        Bi.relative(torch.zeros(4, 32), max_distance=4)
    with pytest.raises(TypeError, match="floating-point"):
        Bi.dense(torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="heads"):
        (Bi.alibi(torch.ones(2)) + Bi.alibi(torch.ones(3))).heads  # noqa: B018
    q = k = v = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="3 heads, the queries have H=4"):
        qkv.attention(q, k, v, bias=Bi.alibi(torch.ones(3)))
    with pytest.raises(ValueError, match="does not broadcast"):
        qkv.attention(q, k, v, bias=torch.zeros(1, 4, 5, 6))
    with pytest.raises(TypeError, match="bias must be"):
        qkv.attention(q, k, v, bias="alibi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="softcap"):
        qkv.attention(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match="score_mod"):
        qkv.attention(q, k, v, score_mod=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a float tensor"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: i > j, backend="math")
