"""PagedKVCache: equal to contiguous caches bit for bit, to the float64 reference, and atomic on errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
import qkv.reference as ref

CAUSAL = qkv.masks.causal()
G, H, E, EV = 2, 6, 5, 3  # GQA 6/2, E != Ev


def test_random_appends_for_five_sequences_equal_contiguous_caches_and_the_reference() -> None:
    """Five sequences grow by random amounts (0 to 9 positions, some rounds skip a sequence); after
    each round every sequence's new queries attend, causal bottom-right. The paged cache equals one
    contiguous KVCache per sequence exactly, and the float64 reference closely."""
    gen = torch.Generator().manual_seed(11)
    paged = qkv.PagedKVCache(num_blocks=40, block_size=4, num_kv_heads=G, d_k=E, d_v=EV, dtype=torch.float64)
    ids = [paged.allocate() for _ in range(5)]
    contiguous = {i: qkv.KVCache(1, 64, G, E, EV, dtype=torch.float64) for i in ids}
    for _ in range(6):
        chosen = [i for i in ids if torch.rand((), generator=gen) < 0.8] or ids[:1]
        lengths = [int(torch.randint(1 if paged.length(i) == 0 else 0, 10, (), generator=gen)) for i in chosen]
        keys = [torch.randn(G, n, E, generator=gen, dtype=torch.float64) for n in lengths]
        values = [torch.randn(G, n, EV, generator=gen, dtype=torch.float64) for n in lengths]
        paged.append(chosen, keys, values)
        queries = [torch.randn(H, max(n, 1), E, generator=gen, dtype=torch.float64) for n in lengths]
        outs = paged.attend(chosen, queries, CAUSAL)
        for i, k, v, q, out in zip(chosen, keys, values, queries, outs, strict=True):
            kc, vc = contiguous[i].update(k[None], v[None])  # (1, G, S, E), (1, G, S, Ev)
            expected = qkv.attention(q[None], kc, vc, CAUSAL, kv_bounds=contiguous[i].bounds)[0]  # (H, L, Ev)
            assert torch.equal(out, expected)
            S = kc.shape[2]
            visible = np.tril(np.ones((q.shape[1], S), dtype=bool), k=S - q.shape[1])  # bottom-right causal
            trace = ref.attention(q.numpy(), kc[0].numpy(), vc[0].numpy(), visible)
            np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-10, atol=1e-10)
    assert [paged.length(i) for i in ids] == [contiguous[i].length for i in ids]
    table, seqlens = paged.block_table(ids), paged.cache_seqlens(ids)
    assert table.dtype == seqlens.dtype == torch.int32 and table.shape[0] == 5
    for row, i in enumerate(ids):  # position t lives at k[table[b, t // block_size], t % block_size]
        k_gathered, _ = paged.keys_values(i)
        t = torch.arange(int(seqlens[row]))
        stored = paged.k[table[row].long()[t // 4], t % 4]  # (S, G, E)
        assert torch.equal(stored.transpose(0, 1), k_gathered)
        assert torch.equal(k_gathered, contiguous[i].keys_values()[0][0])


def test_freed_blocks_are_reused_and_sequences_interleave() -> None:
    cache = qkv.PagedKVCache(4, 2, 1, 2)
    a, b = cache.allocate(), cache.allocate()
    one = [torch.ones(1, 1, 2)]
    for _ in range(3):  # a and b take blocks in turn: a gets 0 and 2, b gets 1 and 3
        cache.append([a, b], one * 2, one * 2)
    assert cache.block_table([a, b]).tolist() == [[0, 2], [1, 3]] and cache.free_blocks == 0
    cache.free(a)
    assert cache.free_blocks == 2
    c = cache.allocate()
    cache.append([c], [torch.full((1, 3, 2), 2.0)], [torch.zeros(1, 3, 2)])
    assert cache.block_table([c]).tolist() == [[0, 2]] and cache.length(c) == 3
    assert torch.equal(cache.keys_values(c)[0], torch.full((1, 3, 2), 2.0))
    with pytest.raises(ValueError, match="unknown sequence id 0"):
        cache.length(a)


def snapshot(cache: qkv.PagedKVCache, ids: list[int]) -> tuple[object, ...]:
    return (cache.k.clone(), cache.v.clone(), cache.free_blocks, [cache.length(i) for i in ids], cache.block_table(ids))


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c, a, b: c.append([a, b], [torch.ones(2, 7, 5)] * 2, [torch.ones(2, 7, 3)] * 2), ValueError, "out of blocks"),
        (lambda c, a, b: c.append([a, 99], [torch.ones(2, 1, 5)] * 2, [torch.ones(2, 1, 3)] * 2), ValueError, "unknown sequence id 99"),
        (lambda c, a, b: c.append([a, a], [torch.ones(2, 1, 5)] * 2, [torch.ones(2, 1, 3)] * 2), ValueError, "repeats"),
        (lambda c, a, b: c.append([a, b], [torch.ones(2, 1, 5), torch.ones(2, 1, 4)], [torch.ones(2, 1, 3)] * 2), ValueError, r"keys\[1\] must have shape \(2, L, 5\)"),
        (lambda c, a, b: c.append([a, b], [torch.ones(2, 1, 5)] * 2, [torch.ones(2, 1, 3), torch.ones(2, 1, 3).double()]), TypeError, r"values\[1\] is torch.float64"),
        (lambda c, a, b: c.append([a, b], [torch.ones(2, 1, 5)] * 2, [torch.ones(2, 2, 3)] * 2), ValueError, "lengths 1 and 2"),
        (lambda c, a, b: c.append([a, b], [torch.ones(2, 1, 5)], [torch.ones(2, 1, 3)] * 2), ValueError, "as many keys"),
        (lambda c, a, b: c.append(a, [torch.ones(2, 1, 5)], [torch.ones(2, 1, 3)]), TypeError, "seq_ids"),
        (lambda c, a, b: c.free(7), ValueError, "unknown sequence id 7"),
        (lambda c, a, b: c.attend([a], [torch.ones(3, 1, 5)]), ValueError, r"queries\[0\] must have shape \(H, L, 5\)"),
        (lambda c, a, b: c.attend([a], [torch.ones(2, 1, 5).double()]), TypeError, "float64"),
        (lambda c, a, b: c.attend([a], [torch.ones(2, 1, 5)], mask=torch.ones(1, 1, dtype=torch.bool)), TypeError, "mask"),
    ],
)
def test_errors_change_nothing(call, error, match) -> None:
    cache = qkv.PagedKVCache(5, 4, 2, 5, 3)
    a, b = cache.allocate(), cache.allocate()
    cache.append([a, b], [torch.randn(2, 5, 5), torch.randn(2, 2, 5)], [torch.randn(2, 5, 3), torch.randn(2, 2, 3)])
    before = snapshot(cache, [a, b])
    with pytest.raises(error, match=match):
        call(cache, a, b)
    assert same(snapshot(cache, [a, b]), before)


@pytest.mark.parametrize("S", [100, 1500])  # the gathered path, the in-place one (decode)
def test_attend_reads_no_cache_for_the_checks(monkeypatch: pytest.MonkeyPatch, S: int) -> None:
    from qkv.attention import problem as attention_problem

    scanned: list[tuple[int, ...]] = []
    original = attention_problem._largest_magnitudes
    monkeypatch.setattr(attention_problem, "_largest_magnitudes", lambda ts: scanned.extend(t.shape for t in ts) or original(ts))
    cache = qkv.PagedKVCache(S // 16 + 1, 16, 1, 4)
    a = cache.allocate()
    cache.append([a], [torch.randn(1, S, 4)], [torch.randn(1, S, 4)])
    cache.attend([a], [torch.randn(2, 1, 4)], CAUSAL)
    assert scanned == [(1, 2, 1, 4)]


@pytest.mark.parametrize("S", [100, 1500])  # the gathered path, the in-place one (decode)
def test_a_pool_written_by_other_means_is_bounded_again(S: int) -> None:
    """``cache.k[block, ...] = nan`` between two steps: the running maxima never saw it, so the
    next attend bounds the sequences from their blocks. The sequence holding the NaN key gives
    NaN where float64 math does (the NaN rule); the other sequence is unaffected."""
    gen = torch.Generator().manual_seed(3)
    cache = qkv.PagedKVCache(2 * (S // 16 + 1), 16, 1, 4)
    a, b = cache.allocate(), cache.allocate()
    cache.append([a, b], [torch.randn(1, S, 4, generator=gen)] * 2, [torch.randn(1, S, 4, generator=gen)] * 2)
    block = cache.block_table([a])[0, 1].item()
    cache.k[block, 3] = float("nan")  # position 19 of sequence a
    q = torch.randn(2, 1, 4, generator=gen)
    out_a, out_b = cache.attend([a, b], [q, q], CAUSAL)
    for seq, out in ((a, out_a), (b, out_b)):
        k, v = cache.keys_values(seq)  # (1, S, 4)
        want = qkv.attention(q[None].double(), k[None].double(), v[None].double(), CAUSAL, backend="math")[0]
        assert torch.equal(out.isnan(), want.isnan())
        torch.testing.assert_close(out.nan_to_num(), want.nan_to_num().float(), rtol=0, atol=1e-5)
    assert out_a.isnan().all() and not out_b.isnan().any()


def _largest_allocation(call) -> int:
    """The most bytes one operator allocated while ``call`` ran (PyTorch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    return max(event.cpu_memory_usage for event in prof.events())


@pytest.mark.parametrize("runs_apart", [1000, 2])  # runs one by one; whole blocks in spans of the pool
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decode_steps_attend_over_the_blocks_in_place(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, runs_apart: int) -> None:
    """Decode steps (L <= 16 queries, S >= 1,024 keys) run the decode kernel over each
    sequence's runs of consecutive blocks: nothing gathered (keys_values is never called and no
    operator allocates as many bytes as one sequence's keys), equal to a contiguous KVCache (bit for
    bit for a sequence in one run, which the contiguous decode path computes the same way) and
    to the float64 reference, with GQA, sinks and a sliding window. The PyTorch ops' paths: the
    compiled kernel (which reads the blocks through the table) is kept out here and tested in
    tests/test_native_paged_decode.py."""
    from qkv.backends import decode

    monkeypatch.setattr(decode, "native_reason", lambda *args: "kept out of this test")
    monkeypatch.setattr(decode, "RUNS_APART", runs_apart)
    seen = []
    real = decode._block_states
    monkeypatch.setattr(decode, "_block_states", lambda *args: seen.append(len(args[3])) or real(*args))
    masked = []
    fused = decode.cpu_flash_attention
    monkeypatch.setattr(decode, "cpu_flash_attention", lambda *args, **kw: masked.append(kw.get("attn_mask") is not None) or fused(*args, **kw))
    gen = torch.Generator().manual_seed(5)
    E = EV = 8
    paged = qkv.PagedKVCache(num_blocks=400, block_size=16, num_kv_heads=G, d_k=E, dtype=dtype)
    single, a, b = paged.allocate(), paged.allocate(), paged.allocate()
    contiguous = {i: qkv.KVCache(1, 2000, G, E, dtype=dtype) for i in (single, a, b)}

    def append(ids: list[int], n: int) -> None:
        keys = [torch.randn(G, n, E, generator=gen, dtype=dtype) for _ in ids]
        values = [torch.randn(G, n, EV, generator=gen, dtype=dtype) for _ in ids]
        paged.append(ids, keys, values)
        for i, k, v in zip(ids, keys, values, strict=True):
            contiguous[i].update(k[None], v[None])

    append([single], 1500)  # blocks 0..93, one run
    for _ in range(38):  # a and b take 2 or 3 blocks in turn: many runs, spans with the other's blocks
        append([a, b], 40)
    assert len(paged.runs(single)) == 1 and len(paged.runs(a)) > 10
    monkeypatch.setattr(qkv.PagedKVCache, "keys_values", lambda *args: pytest.fail("the step gathered its blocks"))
    sinks = torch.linspace(-1.0, 1.0, H, dtype=dtype)
    for mask, L in ((CAUSAL, 1), (CAUSAL, 3), (qkv.masks.sliding_window(600), 2), (None, 1)):
        queries = [torch.randn(H, L, E, generator=gen, dtype=dtype) for _ in range(3)]
        with torch.inference_mode():
            outs = paged.attend([single, a, b], queries, mask, sinks=sinks)
            biggest = _largest_allocation(lambda: paged.attend([single, a, b], queries, mask, sinks=sinks))  # noqa: B023
        assert biggest < 1500 * G * E * paged.k.element_size()  # a gather allocates all of one
        for i, q, out in zip((single, a, b), queries, outs, strict=True):
            kc, vc = contiguous[i].keys_values()  # (1, G, S, E), (1, G, S, Ev)
            assert qkv.explain(q[None], kc, vc, mask, sinks=sinks).path == "decode"
            expected = qkv.attention(q[None], kc, vc, mask, sinks=sinks, kv_bounds=contiguous[i].bounds)[0]  # (H, L, Ev)
            if i == single:
                assert torch.equal(out, expected)
            tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
            torch.testing.assert_close(out, expected, **tol)
            S = kc.shape[2]
            dense = None if mask is None else mask.to_dense(L, S).numpy()
            trace = ref.attention(q.double().numpy(), kc[0].double().numpy(), vc[0].double().numpy(), dense,
                                  sinks=sinks.double().numpy())  # fmt: skip
            np.testing.assert_allclose(out.double().numpy(), trace.output.reshape(out.shape), **tol)
    assert bool(seen) == (runs_apart == 2) == any(masked)  # spans serve a and b, masking the other's blocks


@pytest.mark.parametrize("bad", ["nan", "inf", "overflow", "freed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_sequence_s_bad_values_never_reach_another(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bad: str) -> None:
    """The fallback's spans read blocks of other sequences under a -inf mask. A NaN or inf
    value there, or a key whose score overflows, survives a zero weight (NaN * 0, inf - inf):
    sequence b must still get what its own keys give (float64 math), also after the bad
    sequence is freed (its blocks keep their values). Kernel kept out, spans on (RUNS_APART 2)."""
    from qkv.backends import decode

    monkeypatch.setattr(decode, "native_reason", lambda *args: "kept out of this test")
    monkeypatch.setattr(decode, "RUNS_APART", 2)
    gen = torch.Generator().manual_seed(9)
    E = EV = 8
    paged = qkv.PagedKVCache(num_blocks=200, block_size=16, num_kv_heads=G, d_k=E, dtype=dtype)
    a, b = paged.allocate(), paged.allocate()
    b_keys, b_values = [], []
    for step in range(30):  # a and b take blocks in turn: b's blocks are many runs with a's between
        k_a, v_a = torch.randn(G, 40, E, generator=gen, dtype=dtype), torch.randn(G, 40, EV, generator=gen, dtype=dtype)
        if step == 12:
            if bad == "overflow":
                k_a[:, 5] = 3e38 if dtype == torch.float32 else 1e308  # q . k overflows in the kernel's dtype
            else:
                v_a[:, 5] = float("inf") if bad == "inf" else float("nan")
        k_b, v_b = torch.randn(G, 40, E, generator=gen, dtype=dtype), torch.randn(G, 40, EV, generator=gen, dtype=dtype)
        paged.append([a, b], [k_a, k_b], [v_a, v_b])
        b_keys.append(k_b)
        b_values.append(v_b)
    assert len(paged.runs(b)) > 10
    if bad == "freed":
        paged.free(a)
    q = torch.randn(H, 1, E, generator=gen, dtype=dtype)
    with torch.inference_mode():
        (out,) = paged.attend([b], [q], CAUSAL)
    k, v = torch.cat(b_keys, 1), torch.cat(b_values, 1)  # (G, S, E), (G, S, Ev): b's own keys
    trace = ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), CAUSAL.to_dense(1, k.shape[1]).numpy())
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    np.testing.assert_allclose(out.double().numpy(), trace.output.reshape(out.shape), **tol)


def test_attend_passes_scale_softcap_and_sinks() -> None:
    gen = torch.Generator().manual_seed(12)
    cache = qkv.PagedKVCache(8, 4, G, E, EV, dtype=torch.float64)
    a = cache.allocate()
    k, v = torch.randn(G, 10, E, generator=gen, dtype=torch.float64), torch.randn(G, 10, EV, generator=gen, dtype=torch.float64)
    cache.append([a], [k], [v])
    q = torch.randn(H, 2, E, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    (out,) = cache.attend([a], [q], CAUSAL, scale=0.3, softcap=5.0, sinks=sinks)
    want = qkv.attention(q[None], k[None], v[None], CAUSAL, scale=0.3, softcap=5.0, sinks=sinks)[0]
    assert torch.equal(out, want)
