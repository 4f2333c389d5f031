"""`qkv.compat.flash_attn_func`, `flash_attn_varlen_func` and `flash_attn_with_kvcache` against a
float64 re-implementation of FlashAttention's documented rules (flash-attn is not installed).

The rules, from the docstrings of ``flash_attn_interface.py`` (FlashAttention >= 2.1):
query i of L against S keys sits at p = i + S - L (bottom-right); ``causal`` hides keys
j > p; ``window_size=(left, right)`` keeps p - left <= j <= p + right, -1 meaning that side
is unbounded, and with ``causal`` the right side is 0; ``softcap`` > 0 replaces the scaled
score s by softcap * tanh(s / softcap); ``alibi_slopes`` (H,) or (B, H) adds
-slope * |p - j|; a row with no key gives zeros; heads h reads key/value head h // (H // G).
Varlen applies them per sequence at its own lengths; the KV cache per row at n_b keys.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tests.compat._reference import attend


def flash_rules(
    L: int, S: int, causal: bool, window: tuple[int, int], slopes: torch.Tensor | None, H: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """allowed (1, 1, L, S) and the ALiBi bias (B | 1, H, L, S) of one (L, S) problem."""
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    p = i + S - L
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(L, S, dtype=torch.bool)
    if causal:
        allowed &= j <= p
    if left >= 0:
        allowed &= j >= p - left
    if right >= 0:
        allowed &= j <= p + right
    bias = None
    if slopes is not None:
        per_row = slopes.double().reshape(-1, H)  # (B | 1, H)
        bias = -per_row[:, :, None, None] * (p - j).abs().double()  # (B | 1, H, L, S)
    return allowed[None, None], bias


def reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """flash_attn_func's result by the rules: q (B, L, H, E) -> (out (B, L, H, Ev), lse (B, H, L), probs)."""
    L, H, S = q.shape[1], q.shape[2], k.shape[1]
    allowed, bias = flash_rules(L, S, causal, window, slopes, H)
    out, lse, probs = attend(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, bias, scale, softcap or None
    )
    return out.transpose(1, 2), lse, probs


# (B, L, S, H, G, E, Ev): L = S, L < S with head dim 59, L > S (rows with no key under
# causal), a decoding step over 97 keys, Ev != E
SIZES = [
    (2, 7, 7, 4, 2, 8, 8),
    (1, 5, 13, 3, 1, 59, 59),
    (2, 13, 5, 2, 2, 16, 16),
    (1, 1, 97, 4, 4, 32, 32),
    (2, 6, 9, 2, 1, 8, 3),
]
WINDOWS = [(-1, -1), (3, -1), (-1, 2), (2, 1), (0, 0)]


def _tensors(sizes: tuple, seed: int) -> tuple[torch.Tensor, ...]:
    B, L, S, H, G, E, Ev = sizes
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, S, G, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, S, G, Ev, generator=gen, dtype=torch.float64)
    return q, k, v


def _slopes(kind: str, B: int, H: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    shape = (H,) if kind == "per-head" else (B, H)
    return torch.rand(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


@pytest.mark.parametrize("alibi", ["none", "per-head", "per-row"])
@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sizes", SIZES, ids=[f"case{i}" for i in range(len(SIZES))])
def test_flash_attn_func_follows_the_documented_rules(sizes, causal, window, softcap, alibi) -> None:
    q, k, v = _tensors(sizes, seed=sum(sizes))
    slopes = _slopes(alibi, sizes[0], sizes[3])
    kwargs = {"causal": causal, "window_size": window, "softcap": softcap, "alibi_slopes": slopes}
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    want_out, want_lse, want_probs = reference(q, k, v, causal, window, softcap, slopes)
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(probs, want_probs, atol=1e-10, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-10, rtol=0)
    assert out.is_contiguous() and out.shape == (sizes[0], sizes[1], sizes[3], sizes[6])
    plain = flash_attn_func(q, k, v, **kwargs)
    torch.testing.assert_close(plain, out, atol=0, rtol=0)


def test_flash_attn_func_scale_gradients_and_float32() -> None:
    q, k, v = (t.requires_grad_(True) for t in _tensors((2, 6, 9, 4, 2, 8, 8), seed=5))
    out = flash_attn_func(q, k, v, softmax_scale=0.2, causal=True)
    want = reference(q, k, v, causal=True, scale=0.2)[0]
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    want_grads = torch.autograd.grad(want, (q, k, v), d_out)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    out32 = flash_attn_func(q32, k32, v32, causal=True, window_size=(2, -1))
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), reference(q, k, v, True, (2, -1))[0].detach(), atol=1e-5, rtol=0)


def test_flash_attn_func_refusals() -> None:
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"\(batch_size, seqlen, nheads, headdim\)"):
        flash_attn_func(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="window_size left must be -1"):
        flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        flash_attn_func(q, q, q, window_size=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"softcap must be 0\.0"):
        flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attn_func(q, q, q, deterministic=None)  # type: ignore[arg-type]


def test_softcap_accepts_numpy_and_zero_dim_tensors() -> None:
    import numpy as np

    q, k, v = _tensors((1, 4, 4, 2, 2, 8, 8), seed=1)
    want = reference(q, k, v, softcap=2.0)[0]
    for cap in (np.float32(2.0), torch.tensor(2.0)):
        torch.testing.assert_close(flash_attn_func(q, k, v, softcap=cap), want, atol=1e-10, rtol=0)  # type: ignore[arg-type]


# varlen ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("alibi", ["none", "per-head", "per-row"])
@pytest.mark.parametrize("window", [(-1, -1), (2, -1), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_is_each_sequence_on_its_own(causal, window, alibi) -> None:
    q_lens, k_lens, H, G, E = [3, 1, 7, 4], [5, 1, 2, 4], 4, 2, 8  # L < S, L = S = 1, L > S, L = S
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(sum(q_lens), H, E, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(k_lens), G, E, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(k_lens), G, E, generator=gen, dtype=torch.float64)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    slopes = _slopes(alibi, len(q_lens), H)
    out, lse, probs = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, window_size=window, alibi_slopes=slopes,
        softcap=3.0, return_attn_probs=True,
    )
    assert out.shape == (sum(q_lens), H, E) and lse.shape == (H, sum(q_lens))
    assert probs.shape == (len(q_lens), H, max(q_lens), max(k_lens))
    for d in range(len(q_lens)):
        q0, q1, k0, k1 = int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])
        row_slopes = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[d])
        want_out, want_lse, want_probs = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, window, 3.0, row_slopes)
        torch.testing.assert_close(out[q0:q1], want_out[0], atol=1e-10, rtol=0)
        torch.testing.assert_close(probs[d, :, : q1 - q0, : k1 - k0], want_probs[0], atol=1e-10, rtol=0)
        assert torch.equal(torch.isneginf(lse[:, q0:q1]), torch.isneginf(want_lse[0]))
    assert probs.sum() == pytest.approx(float(torch.isfinite(lse).sum()))  # nothing outside the slices


def test_flash_attn_varlen_func_refusals() -> None:
    q = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q=2 is below the longest sequence"):
        flash_attn_varlen_func(q, q, q, cu, cu, 2, 3)
    with pytest.raises(ValueError, match="ends at 5 but the packed tensor holds 4"):
        flash_attn_varlen_func(q[:4], q, q, cu, cu, 3, 3)
    with pytest.raises(ValueError, match=r"\(total_q, nheads, headdim\)"):
        flash_attn_varlen_func(q[None], q, q, cu, cu, 3, 3)


# KV cache --------------------------------------------------------------------------------------


def _cache_case(seed: int, B=3, S_cache=12, L=2, new=2, H=4, G=2, E=8):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(B, S_cache, G, E, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(B, S_cache, G, E, generator=gen, dtype=torch.float64)
    q = torch.randn(B, L, H, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, new, G, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, new, G, E, generator=gen, dtype=torch.float64)
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("alibi", ["none", "per-row"])
@pytest.mark.parametrize("window", [(-1, -1), (3, -1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[0, 4, 9], [10, 1, 5]])
def test_flash_attn_with_kvcache_appends_then_attends(lengths, causal, window, alibi) -> None:
    q, k_cache, v_cache, k, v = _cache_case(seed=len(lengths) + lengths[0])
    before = k_cache.clone()
    B, _, H = q.shape[:3]
    slopes = _slopes(alibi, B, H)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=causal, window_size=window,
        alibi_slopes=slopes, softcap=4.0, return_softmax_lse=True,
    )
    for b, n in enumerate(lengths):
        torch.testing.assert_close(k_cache[b, n : n + 2], k[b], atol=0, rtol=0)  # written in place
        torch.testing.assert_close(k_cache[b, :n], before[b, :n], atol=0, rtol=0)
        keys, values = k_cache[b : b + 1, : n + 2], v_cache[b : b + 1, : n + 2]
        row_slopes = None if slopes is None else slopes[b]
        want_out, want_lse, _ = reference(q[b : b + 1], keys, values, causal, window, 4.0, row_slopes)
        torch.testing.assert_close(out[b : b + 1], want_out, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse[b : b + 1], want_lse, atol=1e-10, rtol=0)


def test_flash_attn_with_kvcache_without_new_keys_and_with_batch_index() -> None:
    q, k_cache, v_cache, _, _ = _cache_case(seed=4)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)  # every row holds S_cache keys
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, causal=True)[0], atol=1e-10, rtol=0)
    rows = torch.tensor([2, 0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q[:2], k_cache, v_cache, cache_seqlens=5, cache_batch_idx=rows)
    want = reference(q[:2], k_cache[[2, 0], :5], v_cache[[2, 0], :5])[0]
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


def _paged(k_cache: torch.Tensor, v_cache: torch.Tensor, P: int, seed: int):
    """The same cache cut into blocks of P positions at shuffled physical places, plus spare
    blocks of garbage: (k_paged, v_paged (num_blocks, P, G, E), block_table (B, S_cache / P) int32)."""
    B, S_cache, G, E = k_cache.shape
    per_row = S_cache // P
    gen = torch.Generator().manual_seed(seed)
    places = torch.randperm(B * per_row + 3, generator=gen)[: B * per_row].reshape(B, per_row)  # (B, blocks)
    k_paged = torch.full((B * per_row + 3, P, G, E), float("nan"), dtype=k_cache.dtype)
    v_paged = torch.full((B * per_row + 3, P, G, v_cache.shape[-1]), float("nan"), dtype=v_cache.dtype)
    k_paged[places] = k_cache.reshape(B, per_row, P, G, E)  # (B, blocks, P, G, E)
    v_paged[places] = v_cache.reshape(B, per_row, P, G, -1)
    return k_paged, v_paged, places.to(torch.int32)


@pytest.mark.parametrize("window", [(-1, -1), (3, -1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[0, 4, 9], [10, 1, 5]])
def test_flash_attn_with_kvcache_paged_equals_contiguous(lengths, causal, window) -> None:
    """block_table: k_cache (num_blocks, block_size, G, E), position t of row b at
    k_cache[block_table[b, t // block_size], t % block_size]; equal to the contiguous cache exactly
    (and so to the float64 rules), the new keys written in their blocks."""
    q, k_cache, v_cache, k, v = _cache_case(seed=len(lengths) + lengths[0] + 20)
    k_paged, v_paged, table = _paged(k_cache, v_cache, P=4, seed=lengths[1])
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    kwargs = {"cache_seqlens": seqlens, "causal": causal, "window_size": window, "return_softmax_lse": True}
    out, lse = flash_attn_with_kvcache(q, k_paged, v_paged, k, v, block_table=table, **kwargs)
    want, want_lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    t = torch.arange(12)
    for b in range(3):
        assert torch.equal(k_paged[table[b].long()[t // 4], t % 4], k_cache[b])  # the new keys in their blocks
        assert torch.equal(v_paged[table[b].long()[t // 4], t % 4], v_cache[b])
        n = lengths[b] + 2
        ref_out, ref_lse, _ = reference(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], causal, window)
        torch.testing.assert_close(out[b : b + 1], ref_out, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse[b : b + 1], ref_lse, atol=1e-10, rtol=0)


@pytest.mark.parametrize("alibi", ["none", "per-row"])
@pytest.mark.parametrize(("L", "causal", "window"), [(1, False, (-1, -1)), (2, True, (-1, -1)), (3, True, (700, -1))])
def test_a_paged_decoding_step_attends_in_place(L, causal, window, alibi, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding step over a long paged cache (decode path) reads the blocks where they lie:
    no contiguous copy is made (the gathering call is forbidden), spare blocks of NaN are never
    read, and out / lse equal the float64 rules and the contiguous cache's."""
    from qkv.compat import _flash_kvcache

    lengths, P, new, H, G, E = [1100, 1500, 1029], 16, 1, 4, 2, 8
    q, k_cache, v_cache, k, v = _cache_case(seed=L, B=3, S_cache=1504, L=L, new=new, H=H, G=G, E=E)
    k_paged, v_paged, table = _paged(k_cache, v_cache, P=P, seed=L)  # shuffled blocks, NaN spares
    slopes = _slopes(alibi, 3, H)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    kwargs = {"cache_seqlens": seqlens, "causal": causal, "window_size": window, "alibi_slopes": slopes, "return_softmax_lse": True}
    want, want_lse = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, **kwargs)  # contiguous
    gathered = []
    monkeypatch.setattr(_flash_kvcache, "attention", lambda *a, **kw: gathered.append(1))
    out, lse = flash_attn_with_kvcache(q, k_paged, v_paged, k, v, block_table=table, **kwargs)
    assert not gathered
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    for b, m in enumerate(lengths):
        t = torch.arange(m + new)
        keys, values = k_paged[table[b].long()[t // P], t % P], v_paged[table[b].long()[t // P], t % P]  # (m + 1, G, E)
        assert torch.equal(keys[m:], k[b]) and torch.equal(values[m:], v[b])  # the new key written in its block
        row_slopes = None if slopes is None else slopes[b]
        ref_out, ref_lse, _ = reference(q[b : b + 1], keys[None], values[None], causal, window, 0.0, row_slopes)
        torch.testing.assert_close(out[b : b + 1], ref_out, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse[b : b + 1], ref_lse, atol=1e-10, rtol=0)


def test_a_short_or_non_finite_paged_cache_is_gathered() -> None:
    """Below the decode path (a short cache) and with a NaN in the keys (the NaN rule reads the
    data), the blocks are gathered and `qkv.attention` decides: the same result as contiguous."""
    q, k_cache, v_cache, k, v = _cache_case(seed=5, B=2, S_cache=1504, L=1, new=1)
    k_cache[1, 3, 0, 0] = float("nan")  # row 1's key head 0 holds a NaN: its query heads 0, 1 give NaN
    k_paged, v_paged, table = _paged(k_cache, v_cache, P=16, seed=2)
    for lengths in ([5, 1100], [1100, 1200]):
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        out = flash_attn_with_kvcache(q, k_paged, v_paged, k, v, cache_seqlens=seqlens, block_table=table)
        want = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0, equal_nan=True)
        assert bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(out[1, :, 2:]).all())
        assert bool(torch.isnan(out[1, :, :2]).all())  # (L, heads of key head 0, Ev)


def test_flash_attn_with_kvcache_reads_a_paged_kv_cache() -> None:
    """qkv.PagedKVCache's storage, block table and lengths go to the drop-in as they are."""
    gen = torch.Generator().manual_seed(8)
    cache = qkv.PagedKVCache(16, 4, 2, 8, dtype=torch.float64)
    ids = [cache.allocate() for _ in range(3)]
    for n in ([5, 1, 9], [2, 7, 0]):
        cache.append(ids, [torch.randn(2, m, 8, generator=gen, dtype=torch.float64) for m in n],
                     [torch.randn(2, m, 8, generator=gen, dtype=torch.float64) for m in n])  # fmt: skip
    q = torch.randn(3, 1, 4, 8, generator=gen, dtype=torch.float64)  # (B, L, H, E)
    out = flash_attn_with_kvcache(
        q, cache.k, cache.v, cache_seqlens=cache.cache_seqlens(ids), block_table=cache.block_table(ids), causal=True
    )
    want = cache.attend(ids, list(q.transpose(1, 2)), qkv.masks.causal())  # B x (H, L, Ev)
    # one padded batch here, one sequence at a time there: equal up to the order of the sums
    torch.testing.assert_close(out, torch.stack(want).transpose(1, 2), rtol=0, atol=1e-12)


def test_flash_attn_with_kvcache_paged_refusals_leave_the_cache_alone() -> None:
    q, k_cache, v_cache, k, v = _cache_case(seed=9)
    k_paged, v_paged, table = _paged(k_cache, v_cache, P=4, seed=1)
    before = (k_paged.clone(), v_paged.clone())
    seqlens = torch.tensor([1, 2, 3], dtype=torch.int32)
    far = table.clone()
    far[1, 1] = 99
    refusals = [
        ({"block_table": table.long()}, TypeError, "block_table must be an int32"),
        ({"block_table": table[:2]}, ValueError, "block_table must have shape"),
        ({"block_table": far, "cache_seqlens": torch.tensor([1, 3, 3], dtype=torch.int32)}, ValueError, r"block_table\[1, 1\] = 99"),
        ({"block_table": table, "cache_batch_idx": torch.arange(3, dtype=torch.int32)}, ValueError, "cache_batch_idx"),
        ({"block_table": table, "cache_seqlens": torch.tensor([1, 11, 3], dtype=torch.int32)}, ValueError, "do not fit"),
    ]
    for kwargs, error, message in refusals:
        kwargs = {"cache_seqlens": seqlens, **kwargs}
        with pytest.raises(error, match=message):
            flash_attn_with_kvcache(q, k_paged, v_paged, k, v, **kwargs)
        torch.testing.assert_close(k_paged, before[0], rtol=0, atol=0, equal_nan=True)  # spare blocks are NaN
        torch.testing.assert_close(v_paged, before[1], rtol=0, atol=0, equal_nan=True)
    far[1, 1] = 99  # an entry a row does not read is never checked nor read
    flash_attn_with_kvcache(q, k_paged, v_paged, k, v, cache_seqlens=seqlens, block_table=far)


def test_flash_attn_with_kvcache_refusals_leave_the_cache_alone() -> None:
    q, k_cache, v_cache, k, v = _cache_case(seed=6)
    before = (k_cache.clone(), v_cache.clone())
    seqlens = torch.tensor([1, 2, 3], dtype=torch.int32)
    refusals = [
        ({"rotary_cos": torch.ones(4, 4), "rotary_sin": torch.ones(4, 4)}, ValueError, "RotaryEmbedding"),
        ({"cache_leftpad": torch.zeros(3, dtype=torch.int32)}, ValueError, "cache_leftpad"),
        ({"cache_seqlens": torch.tensor([1, 11, 3], dtype=torch.int32)}, ValueError, "do not fit"),
        ({"cache_seqlens": None}, ValueError, "cache_seqlens is required"),
        ({"cache_seqlens": seqlens, "softmax_scale": float("nan")}, ValueError, "scale must be a finite number"),
    ]
    for kwargs, error, message in refusals:
        kwargs = {"cache_seqlens": seqlens, **kwargs}
        with pytest.raises(error, match=message):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), kwargs
