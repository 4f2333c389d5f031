"""KVCache reads its filled prefix only, and its bounds spare attention's checks the cache scan."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
import qkv.nn.multihead
from qkv.attention import problem as attention_problem
from qkv.attention.bounds import KVBounds

CAUSAL = qkv.masks.causal()


def record_scans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Every tensor attention's input checks scan for magnitudes, by shape."""
    scanned: list[tuple[int, ...]] = []
    original = attention_problem._largest_magnitudes

    def spy(tensors: tuple[torch.Tensor, ...]) -> list[float]:
        scanned.extend(tuple(t.shape) for t in tensors)
        return original(tensors)

    monkeypatch.setattr(attention_problem, "_largest_magnitudes", spy)
    return scanned


def test_a_large_cache_hands_attention_its_filled_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capacity 10,000, 5 rows filled: attention gets views of 5 rows of the storage; the unfilled
    rows are NaN here, so reading any of them would show in the output."""
    gen = torch.Generator().manual_seed(0)
    m = qkv.MultiHeadAttention(12, 4, num_kv_heads=2).double().eval()
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    cache = m.new_cache(2, max_len=10_000)
    cache.k.fill_(math.nan)
    cache.v.fill_(math.nan)
    handed: list[torch.Tensor] = []
    original = qkv.nn.multihead.attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object, **kwargs: object) -> object:
        handed.extend((k, v))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(qkv.nn.multihead, "attention", spy)
    scanned = record_scans(monkeypatch)
    with torch.no_grad():
        full = m(x, mask=CAUSAL)
        steps = torch.cat([m(x[:, :3], mask=CAUSAL, cache=cache), m(x[:, 3:4], mask=CAUSAL, cache=cache),
                           m(x[:, 4:], mask=CAUSAL, cache=cache)], dim=1)  # fmt: skip
    torch.testing.assert_close(steps, full, rtol=1e-12, atol=1e-12)
    k, v = handed[-2], handed[-1]
    assert k.shape == (2, 2, 5, 3) and v.shape == (2, 2, 5, 3)  # (B, G, filled, E)
    assert k.data_ptr() == cache.k.data_ptr() and v.data_ptr() == cache.v.data_ptr()  # views, no copy
    # the no-cache call scanned q, k, v; the three cached calls scanned their queries only
    assert scanned[3:] == [(2, 4, 3, 3), (2, 4, 1, 3), (2, 4, 1, 3)]


def test_cache_tracks_the_largest_magnitudes_of_what_it_was_given() -> None:
    cache = qkv.KVCache(1, 16, 1, 2)
    cache.update(torch.tensor([[[[1.0, -3.0]]]]), torch.tensor([[[[0.5, 0.25]]]]))
    cache.update(torch.tensor([[[[2.0, 0.0]]]]), torch.tensor([[[[-7.0, 1.0]]]]))
    assert (cache.k_max, cache.v_max) == (3.0, 7.0)
    cache.truncate(1)
    assert (cache.k_max, cache.v_max) == (3.0, 7.0)  # still upper bounds
    cache.update(torch.tensor([[[[math.inf, 0.0]]]]), torch.zeros(1, 1, 1, 2))
    assert cache.k_max == math.inf and cache.v_max == 7.0
    cache.reset()
    assert (cache.k_max, cache.v_max) == (0.0, 0.0)


def step_pair(cache: qkv.KVCache, gen: torch.Generator, bad: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill a cache in two writes; ``bad`` puts a NaN / inf / huge value in k or v of the first."""
    B, G, _, E = cache.k.shape
    k, v = torch.randn(B, G, 6, E, generator=gen), torch.randn(B, G, 6, E, generator=gen)
    if bad == "nan k":
        k[0, 1, 2, 0] = math.nan
    elif bad == "inf v":
        v[1, 0, 4, 1] = -math.inf
    elif bad == "huge k":
        k[0, 0, 3] = 1e30
    cache.update(k, v)
    return cache.update(torch.randn(B, G, 1, E, generator=gen), torch.randn(B, G, 1, E, generator=gen))


@pytest.mark.parametrize("bad", [None, "nan k", "inf v", "huge k"])
@pytest.mark.parametrize("mask", [None, CAUSAL, qkv.masks.sliding_window(2)])
def test_known_bounds_decide_exactly_as_the_full_check(
    monkeypatch: pytest.MonkeyPatch, bad: str | None, mask: qkv.masks.Mask | None
) -> None:
    """Same outputs, same NaN rows, same refusals, with and without the cache's bounds."""
    gen = torch.Generator().manual_seed(3)
    cache = qkv.KVCache(2, 50, 2, 4)
    k, v = step_pair(cache, gen, bad)
    q = torch.randn(2, 6, 3, 4, generator=gen) * (1e10 if bad == "huge k" else 1.0)  # (B, H, L, E), GQA 6/2
    if bad == "huge k":
        with pytest.raises(ValueError, match="overflow") as plain:
            qkv.attention(q, k, v, mask)
        with pytest.raises(ValueError, match="overflow") as known:
            qkv.attention(q, k, v, mask, kv_bounds=cache.bounds)
        assert str(known.value) == str(plain.value)
        return
    plain_out, plain_w = qkv.attention(q, k, v, mask, return_weights=True)
    scanned = record_scans(monkeypatch)
    out, w = qkv.attention(q, k, v, mask, return_weights=True, kv_bounds=cache.bounds)
    assert scanned == [tuple(q.shape)]
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(w, plain_w, rtol=0, atol=0, equal_nan=True)
    assert out.isnan().any().item() == (bad is not None)


def test_bounds_of_other_or_rewritten_tensors_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    cache = qkv.KVCache(1, 8, 1, 4)
    k, v = cache.update(torch.randn(1, 1, 4, 4, generator=gen), torch.randn(1, 1, 4, 4, generator=gen))
    q = torch.randn(1, 2, 1, 4, generator=gen)
    bounds = cache.bounds
    scanned = record_scans(monkeypatch)
    qkv.attention(q, k, v, kv_bounds=bounds)
    assert scanned == [(1, 2, 1, 4)]
    k[0, 0, 1, 2] = math.nan  # written behind the cache's back: the bounds no longer describe k
    out = qkv.attention(q, k, v, kv_bounds=bounds)
    assert scanned[1:] == [(1, 2, 1, 4), (1, 1, 4, 4), (1, 1, 4, 4)]
    assert out.isnan().all()
    qkv.attention(q, k.clone(), v, kv_bounds=bounds)  # another tensor: scanned as well
    assert len(scanned) == 7


def test_a_storage_write_between_steps_is_scanned_before_the_next_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cache.k[...] = x`` between two steps, then ``update`` and ``bounds``: the bounds are made
    after the write, so they must not be the running maxima of what ``update`` saw. The NaN
    key gives the heads that see it NaN, as float64 math does; the others stay finite."""
    gen = torch.Generator().manual_seed(6)
    cache = qkv.KVCache(1, 2048, 2, 16)
    cache.update(torch.randn(1, 2, 1500, 16, generator=gen), torch.randn(1, 2, 1500, 16, generator=gen))
    cache.k[0, 0, 3] = math.nan  # kv head 0, read by query heads 0 and 1
    k, v = cache.update(torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen))
    q = torch.randn(1, 4, 1, 16, generator=gen)
    want = qkv.attention(q.double(), k.double(), v.double(), CAUSAL, backend="math")
    out = qkv.attention(q, k, v, CAUSAL, kv_bounds=cache.bounds)
    assert want[0, :, 0].isnan().any(-1).tolist() == [True, True, False, False]
    assert out[0, :, 0].isnan().any(-1).tolist() == [True, True, False, False]
    torch.testing.assert_close(out[:, 2:], want[:, 2:].float(), rtol=0, atol=1e-5)
    cache.v[0, 1, 7] = -(2.0**100)  # exact in float32; written after the step: the next bounds see it
    assert cache.bounds.v_max == 2.0**100 and math.isinf(cache.bounds.k_max)
    scanned = record_scans(monkeypatch)
    qkv.attention(q, *cache.keys_values(), CAUSAL, kv_bounds=cache.bounds)  # rescanned once, in bounds
    assert scanned == [(1, 4, 1, 16)]


def test_bfloat16_bounds_survive_the_float32_widening(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    cache = qkv.KVCache(1, 64, 2, 8, dtype=torch.bfloat16)
    k, v = cache.update(torch.randn(1, 2, 40, 8, generator=gen).bfloat16(), torch.randn(1, 2, 40, 8, generator=gen).bfloat16())
    q = torch.randn(1, 4, 1, 8, generator=gen).bfloat16()
    plain = qkv.attention(q, k, v, CAUSAL)
    scanned = record_scans(monkeypatch)
    known = qkv.attention(q, k, v, CAUSAL, kv_bounds=cache.bounds)
    assert scanned == [(1, 4, 1, 8)]
    torch.testing.assert_close(known, plain, rtol=0, atol=0)


def test_kv_bounds_must_be_kv_bounds() -> None:
    q = k = v = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match="kv_bounds"):
        qkv.attention(q, k, v, kv_bounds=(1.0, 1.0))  # type: ignore[arg-type]
    assert KVBounds.of(k, v).describes(k, v)


def test_inference_mode_caches_use_their_bounds_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference tensors keep no version counter: the bounds then name the tensors by address,
    shape and strides, and a decode step still scans only its queries."""
    m = qkv.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(1, 9, 16)
    with torch.inference_mode():
        cache = m.new_cache(1, max_len=32)
        m(x[:, :8], mask=CAUSAL, cache=cache)
        scanned = record_scans(monkeypatch)
        step = m(x[:, 8:], mask=CAUSAL, cache=cache)
        full = m(x, mask=CAUSAL)
    assert scanned[0] == (1, 4, 1, 4) and len(scanned) == 4  # the step: q only; the full call: q, k, v
    torch.testing.assert_close(step, full[:, 8:], rtol=1e-5, atol=1e-6)


def test_a_step_that_attention_refuses_leaves_the_bounds_as_they_were() -> None:
    """An overflowing step is undone: length, and the running maxima (else every later step would
    take the tight, cache-reading check)."""
    m = qkv.MultiHeadAttention(8, 2).eval()
    cache = m.new_cache(1, max_len=8)
    with torch.no_grad():
        m(torch.randn(1, 3, 8), mask=CAUSAL, cache=cache)
        before = (cache.length, cache.k_max, cache.v_max)
        with pytest.raises(ValueError, match="overflow"):
            m(torch.full((1, 1, 8), 1e30), mask=CAUSAL, cache=cache)
    assert (cache.length, cache.k_max, cache.v_max) == before
