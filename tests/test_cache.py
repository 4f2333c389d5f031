"""KVCache: a prefill then steps give what one causal forward over the whole sequence gives."""

from __future__ import annotations

import itertools

import pytest
import torch

import qkv
from qkv.nn.positional import RotaryEmbedding

CAUSAL = qkv.masks.causal()


def make_model(H: int, G: int, d_k: int, d_v: int, layout: str | None, dtype: torch.dtype) -> qkv.MultiHeadAttention:
    rope = None if layout is None else RotaryEmbedding(d_k, max_len=64, layout=layout)
    return qkv.MultiHeadAttention(12, H, d_k=d_k, d_v=d_v, num_kv_heads=G, rope=rope).to(dtype).eval()


@pytest.mark.parametrize(
    ("H", "G", "d_k", "d_v", "layout", "dtype", "tol"),
    [
        (4, 4, 3, 5, None, torch.float64, 1e-10),
        (4, 2, 6, 6, "half", torch.float64, 1e-10),
        (6, 1, 4, 2, "interleaved", torch.float64, 1e-10),
        (4, 2, 8, 4, "half", torch.float32, 2e-5),
    ],
)
def test_prefill_then_steps_equal_one_causal_forward(H, G, d_k, d_v, layout, dtype, tol):
    gen = torch.Generator().manual_seed(H * 10 + G)
    m = make_model(H, G, d_k, d_v, layout, dtype)
    B, T = 3, 13
    x = torch.randn(B, T, 12, generator=gen, dtype=dtype)
    with torch.no_grad():
        full, full_weights = m(x, mask=CAUSAL, return_weights=True)
        cache = m.new_cache(B, max_len=16)
        # a prefill of 5, one step, a chunk of 3, then single steps to the end
        bounds = [0, 5, 6, 9, *range(10, T + 1)]
        for start, stop in itertools.pairwise(bounds):
            out, weights = m(x[:, start:stop], mask=CAUSAL, cache=cache, return_weights=True)
            assert cache.length == stop
            torch.testing.assert_close(out, full[:, start:stop], rtol=tol, atol=tol)
            torch.testing.assert_close(weights, full_weights[:, :, start:stop, :stop], rtol=tol, atol=tol)


def test_reset_starts_over():
    m = make_model(4, 2, 4, 4, "half", torch.float64)
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    cache = m.new_cache(2, max_len=8)
    with torch.no_grad():
        first = torch.cat([m(x[:, t : t + 1], mask=CAUSAL, cache=cache) for t in range(6)], dim=1)
        cache.reset()
        assert cache.length == 0
        again = m(x, mask=CAUSAL, cache=cache)
    torch.testing.assert_close(again, first, rtol=1e-10, atol=1e-10)


def test_left_padded_batch_decodes_like_separate_sequences():
    """The documented batch recipe: left-pad prompts, mask the padding at every step.

    With RoPE the padded row is shifted in position, which changes nothing since scores depend
    only on relative positions.
    """
    gen = torch.Generator().manual_seed(7)
    m = make_model(4, 2, 4, 4, "interleaved", torch.float64)
    short, long_ = torch.randn(1, 3, 12, generator=gen, dtype=torch.float64), torch.randn(1, 5, 12, generator=gen, dtype=torch.float64)
    steps = torch.randn(2, 4, 12, generator=gen, dtype=torch.float64)  # the tokens fed after the prompts
    pad = 2
    prompts = torch.cat([torch.cat([torch.zeros(1, pad, 12, dtype=torch.float64), short], dim=1), long_])  # (2, 5, D)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[0, :pad] = False  # (B, max_len): False where row 0 is padding
    cache = m.new_cache(2, max_len=9)
    with torch.no_grad():
        outs = [m(prompts, mask=CAUSAL & qkv.masks.dense(valid[:, None, None, :5]), cache=cache)[:, -1:]]
        for t in range(4):
            S = cache.length + 1
            outs.append(m(steps[:, t : t + 1], mask=CAUSAL & qkv.masks.dense(valid[:, None, None, :S]), cache=cache))
        batched = torch.cat(outs, dim=1)  # (2, 5, D): last prompt token, then the 4 steps
        for row, prompt in enumerate((short, long_)):
            alone = m(torch.cat([prompt, steps[row : row + 1]], dim=1), mask=CAUSAL)[:, -5:]
            # the shift by `pad` positions goes through float32 cos/sin tables (rounded ~6e-8)
            torch.testing.assert_close(batched[row : row + 1], alone, rtol=1e-6, atol=1e-6)


def test_overflow_raises_before_writing():
    m = make_model(4, 2, 4, 4, None, torch.float32)
    cache = m.new_cache(1, max_len=4)
    with torch.no_grad():
        m(torch.randn(1, 3, 12), mask=CAUSAL, cache=cache)
        before = cache.k.clone()
        with pytest.raises(ValueError, match=r"KVCache overflow: it holds 3 of max_len=4 positions and cannot take 2 more"):
            m(torch.randn(1, 2, 12), mask=CAUSAL, cache=cache)
    assert cache.length == 3
    torch.testing.assert_close(cache.k, before)


def test_rope_positions_past_its_table_raise():
    m = qkv.MultiHeadAttention(8, 2, rope=RotaryEmbedding(4, max_len=4))
    cache = m.new_cache(1, max_len=10)
    with torch.no_grad():
        m(torch.randn(1, 4, 8), mask=CAUSAL, cache=cache)
        with pytest.raises(ValueError, match=r"RotaryEmbedding: positions 4..4 go past max_len=4"):
            m(torch.randn(1, 1, 8), mask=CAUSAL, cache=cache)


def test_cache_checks_what_it_is_given():
    m = make_model(4, 2, 4, 3, None, torch.float32)
    cache = m.new_cache(2, max_len=8)
    assert (tuple(cache.k.shape), tuple(cache.v.shape)) == ((2, 2, 8, 4), (2, 2, 8, 3))
    with pytest.raises(ValueError, match="KVCache holds batch_size=2 sequences, got a batch of 3"):
        m(torch.randn(3, 1, 12), cache=cache)
    other = qkv.KVCache(2, 8, num_kv_heads=4, d_k=4, d_v=3)
    with pytest.raises(ValueError, match="does not fit this layer"):
        m(torch.randn(2, 1, 12), cache=other)
    with pytest.raises(ValueError, match="the KV cache is for self-attention decoding"):
        qkv.MultiHeadAttention(12, 4, d_context=5)(torch.randn(2, 1, 12), torch.randn(2, 3, 5), cache=cache)
    with pytest.raises(TypeError, match=r"k is torch\.float64 on cpu but the cache stores torch\.float32"):
        cache.update(torch.zeros(2, 2, 1, 4, dtype=torch.float64), torch.zeros(2, 2, 1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"v must have shape \(2, 2, L, 3\), got \(2, 2, 1, 4\)"):
        cache.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        qkv.KVCache(1, 0, 1, 4)
    assert cache.length == 0
