"""The compiled decode kernel's softcap and its reads through a block table (`qkv.native.decode`).

Expected values come from independent sources: torch.tanh in float64 for the kernel's tanh,
backend="math" in float64 (`qkv.attention`) for the attention, and the same kernel on the same
keys in a contiguous cache for paged == contiguous (the kernel reads keys in the same blocks
either way, so the bits must agree). Each numeric test runs the AVX2 build (it runs on any
higher machine) and the build of the tier qkv uses here. Tests of the kernel alone need it
built (they skip only where it cannot run at all: QKV_NO_COMPILED_KERNELS, no compiler, a tier
without AVX2); tests through `qkv.attention`, `PagedKVCache` and `flash_attn_with_kvcache` also
check the PyTorch ops they fall back to there, and a spy says which ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.backends import decode as decode_backend
from qkv.compat import flash_attn_with_kvcache
from qkv.native import build as compiled
from qkv.native import decode as native
from qkv.native.machine import TIER_VARIABLE

BF16 = torch.bfloat16
CPU = torch.device("cpu")
TIER_CASES = ("avx2", "machine")
DTYPES = [torch.float32, BF16]
DTYPE_IDS = ["fp32", "bf16"]


def _tier(tier: str) -> str | None:
    return None if tier == "machine" else tier


def _require_kernel(dtype: torch.dtype, tier: str | None) -> None:
    """Skip where the kernel cannot run at all here (facts of the machine, not of the kernel)."""
    reason = compiled.tier_reason(native.TIERS, dtype, CPU, native.DTYPES, tier)
    if reason is not None:
        pytest.skip(f"the native decode kernel cannot run here: {reason}")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The kernel's runs (its keyword arguments), through `native.forward`; a None result is no run."""
    seen: list[dict[str, Any]] = []
    real = native.forward

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if result is not None:
            seen.append(kwargs)
        return result

    monkeypatch.setattr(native, "forward", recorded)
    return seen


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == BF16 else 2e-5


# ---- the kernel's tanh --------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIER_CASES)
def test_tanh_is_float32_accurate_over_the_whole_range(tier: str) -> None:
    """Within 3 units in the last place of float64 tanh for every float32: a dense sweep of the
    curved part, both signs of every binade from the subnormals to the largest float, the
    polynomial / exponential seam, and the infinities; odd, with tanh(-0) = -0."""
    _require_kernel(torch.float32, _tier(tier))
    magnitudes = torch.logspace(-45.0, 38.5, 40001, dtype=torch.float64).clamp(max=3.4028234e38).float()
    seam = torch.tensor([0.625], dtype=torch.float32)
    near_seam = torch.cat([torch.nextafter(seam, torch.zeros(1)), seam, torch.nextafter(seam, torch.ones(1))])
    x = torch.cat([
        torch.linspace(-12.0, 12.0, 240001), magnitudes, -magnitudes, near_seam, -near_seam,
        torch.tensor([0.0, 1e-45, 1.17549435e-38, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf")]),
    ])  # fmt: skip
    y = native.tanh(x, _tier(tier))
    assert y is not None and y.dtype == torch.float32 and y.shape == x.shape
    want = torch.tanh(x.double())
    ulps = (y.double() - want).abs() / (want.abs().clamp(min=2.0**-149) * 2.0**-24)
    assert float(ulps.max()) <= 3.0, f"{float(ulps.max()):.2f} ulp at x = {float(x[ulps.argmax()])!r}"
    assert torch.equal(y[x.abs() > 10], x[x.abs() > 10].sign())  # saturated: exactly +-1
    assert torch.equal(native.tanh(-x, _tier(tier)), -y)  # odd
    negative_zero = native.tanh(torch.tensor([-0.0]), _tier(tier))
    assert negative_zero is not None and bool(torch.signbit(negative_zero).all())


# ---- softcap -------------------------------------------------------------------------------


def _inputs(N: int, H: int, G: int, L: int, S: int, E: int, Ev: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, L, H, E, generator=gen).mul(2.0).to(dtype).transpose(1, 2)  # (N, H, L, E): scores up to ~10
    k = torch.randn(N, G, S, E, generator=gen).to(dtype)  # (N, G, S, E)
    v = torch.randn(N, G, S, Ev, generator=gen).to(dtype)  # (N, G, S, Ev)
    return q, k, v


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(50)], ids=["none", "causal", "window"])
def test_softcap_matches_float64_math(
    monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]], tier: str, dtype: torch.dtype, mask: M.Mask | None
) -> None:
    """A softcap of 2 (scores reach ~10, so it changes every row) with GQA 6 / 2, three queries,
    sinks, through `qkv.attention` (the decode path, the kernel forward)."""
    if tier != "machine":
        monkeypatch.setenv(TIER_VARIABLE, tier)
    q, k, v = _inputs(2, 6, 2, 3, 2051, 72, 40, dtype, seed=1)
    sinks = torch.tensor([[0.5, -1.0, 2.0, 0.0, 3.0, -3.0]])  # (1, H)
    plan = qkv.explain(q, k, v, mask, softcap=2.0, sinks=sinks)
    assert plan.path == "decode" and "softcap 2" in plan.scores and "softcap" in plan.route
    want, want_lse = qkv.attention(q.double(), k.double(), v.double(), mask, softcap=2.0, sinks=sinks.double(),
                                   backend="math", return_lse=True)  # fmt: skip
    out, lse = qkv.attention(q, k, v, mask, softcap=2.0, sinks=sinks, return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=_tolerance(dtype), rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=_tolerance(dtype), rtol=0)
    runs = native.unavailable_reason(dtype, CPU) is None
    assert (plan.forward_kernel.startswith("the native decode kernel")) == runs
    assert [c["softcap"] for c in calls] == ([2.0] if runs else [])
    # the cap really acts: without it the result is another one
    uncapped = qkv.attention(q.double(), k.double(), v.double(), mask, sinks=sinks.double(), backend="math")
    assert float((uncapped - want).abs().max()) > 0.1


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(50)], ids=["none", "causal", "window"])
def test_alibi_and_softcap_match_float64_math(
    monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]], tier: str, dtype: torch.dtype, mask: M.Mask | None
) -> None:
    """ALiBi (slopes of both signs, so keys before and after the query position count) after
    a softcap, in qkv's order, three queries bottom-right, by the kernel."""
    if tier != "machine":
        monkeypatch.setenv(TIER_VARIABLE, tier)
    q, k, v = _inputs(2, 6, 2, 3, 1500, 32, 32, dtype, seed=2)
    bias = qkv.bias.alibi(torch.tensor([0.01, 0.002, -0.001, 0.5, 0.03, 0.0], dtype=torch.float64))
    want = qkv.attention(q.double(), k.double(), v.double(), mask, softcap=3.0, bias=bias, backend="math")
    out = qkv.attention(q, k, v, mask, softcap=3.0, bias=bias)
    torch.testing.assert_close(out.double(), want, atol=_tolerance(dtype), rtol=0)
    runs = native.unavailable_reason(dtype, CPU) is None
    assert [c["slopes"] is not None for c in calls] == ([True] if runs else [])
    # the bias really acts: without it the result is another one
    plain = qkv.attention(q.double(), k.double(), v.double(), mask, softcap=3.0, backend="math")
    assert float((plain - want).abs().max()) > 0.1


def test_other_biases_take_the_pytorch_ops_in_order() -> None:
    """A T5 relative bias with a softcap: the kernel takes no such bias, the decode path's
    PyTorch ops apply the softcap first, then the bias (qkv's order), as float64 math does."""
    q, k, v = _inputs(1, 4, 2, 2, 1500, 32, 32, torch.float32, seed=2)
    bias = qkv.bias.relative(torch.randn(4, 32, generator=torch.Generator().manual_seed(3)))
    plan = qkv.explain(q, k, v, M.causal(), softcap=3.0, bias=bias)
    assert plan.path == "decode" and plan.forward_kernel.startswith("the split-key decode kernel")
    assert "no other score terms" in plan.forward_kernel
    want = qkv.attention(q.double(), k.double(), v.double(), M.causal(), softcap=3.0, bias=bias, backend="math")
    out = qkv.attention(q, k, v, M.causal(), softcap=3.0, bias=bias)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)


# ---- paged pools ---------------------------------------------------------------------------


def _pool(keys: list[torch.Tensor], values: list[torch.Tensor], P: int, seed: int):
    """Sequences keys[n] (G, S_n, E), values[n] (G, S_n, Ev) cut into blocks of P positions at
    shuffled places of one pool, with spare blocks of NaN in between (never read): pools
    (num_blocks, P, G, E | Ev) and the table (N, most blocks) int64, whose entries past a
    sequence's own blocks name a NaN block."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-k.shape[1] // P) for k in keys]
    total = sum(counts) + 4
    places = torch.randperm(total, generator=gen)
    G, E, Ev = keys[0].shape[0], keys[0].shape[2], values[0].shape[2]
    k_pool = torch.full((total, P, G, E), float("nan"), dtype=keys[0].dtype)
    v_pool = torch.full((total, P, G, Ev), float("nan"), dtype=keys[0].dtype)
    spare = int(places[-1])
    table = torch.full((len(keys), max(counts)), spare, dtype=torch.int64)
    used = 0
    for n, (k, v) in enumerate(zip(keys, values, strict=True)):
        mine = places[used : used + counts[n]]
        used += counts[n]
        table[n, : counts[n]] = mine
        S = k.shape[1]
        rows = (mine[:, None] * P + torch.arange(P)).reshape(-1)[:S]  # (S,): each position's row in the flat pool
        k_pool.view(-1, G, E)[rows] = k.transpose(0, 1)  # (S, G, E)
        v_pool.view(-1, G, Ev)[rows] = v.transpose(0, 1)  # (S, G, Ev)
    assert not torch.equal(table[:, :-1] + 1, table[:, 1:])  # not one run
    return k_pool, v_pool, table


def _bounds(mask: M.Mask | None, L: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row key intervals (N, L) of ``mask`` for rows of their own lengths."""
    los, his = [], []
    for S in lengths:
        if mask is None:
            lo, hi = torch.zeros(1, L, dtype=torch.int64), torch.full((1, L), S - 1, dtype=torch.int64)
        else:
            intervals = mask.row_intervals(L, S)
            assert intervals is not None
            lo, hi = intervals
        los.append(lo.expand(1, L))
        his.append(hi.expand(1, L))
    return torch.cat(los), torch.cat(his)  # (N, L) each


LENGTHS = [1, 40, 517, 1500, 2049]  # five sequences, five lengths


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("P", [1, 16, 17, 256])
@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(7)], ids=["none", "causal", "window7"])
@pytest.mark.parametrize("extras", ["plain", "softcap+sinks"])
def test_a_block_table_gives_the_contiguous_bits_and_float64_math(
    tier: str, dtype: torch.dtype, P: int, mask: M.Mask | None, extras: str
) -> None:
    """Five sequences of different lengths (one shorter than a block, one of a single key) in
    a shuffled pool, GQA 6 / 2, three queries, a window shorter than a block; the kernel through
    the table equals the kernel on the same keys in a contiguous cache bit for bit, and float64
    math per sequence to rounding."""
    _require_kernel(dtype, _tier(tier))
    N, H, G, L, E, Ev = len(LENGTHS), 6, 2, 3, 72, 40
    gen = torch.Generator().manual_seed(P)
    keys = [torch.randn(G, S, E, generator=gen).to(dtype) for S in LENGTHS]
    values = [torch.randn(G, S, Ev, generator=gen).to(dtype) for S in LENGTHS]
    q = torch.randn(N, L, H, E, generator=gen).mul(2.0).to(dtype).transpose(1, 2)  # (N, H, L, E)
    k_pool, v_pool, table = _pool(keys, values, P, seed=P + 1)
    softcap = 2.0 if extras != "plain" else None
    sinks = torch.randn(N, H, generator=gen) if extras != "plain" else None  # (N, H)
    lo, hi = _bounds(mask, L, LENGTHS)
    stop = max(LENGTHS)
    scale = E**-0.5
    paged = native.forward(q, k_pool, v_pool, scale, 0, stop, 3, lo, hi, None, sinks, _tier(tier), softcap, table)
    assert paged is not None
    k_cont = torch.zeros(N, G, stop, E, dtype=dtype)  # (N, G, S, E): each row's keys, zeros after them
    v_cont = torch.zeros(N, G, stop, Ev, dtype=dtype)
    for n, S in enumerate(LENGTHS):
        k_cont[n, :, :S], v_cont[n, :, :S] = keys[n], values[n]
    contiguous = native.forward(q, k_cont, v_cont, scale, 0, stop, 3, lo, hi, None, sinks, _tier(tier), softcap)
    assert contiguous is not None
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    for n in range(N):
        want, want_lse = qkv.attention(
            q[n : n + 1].double(), keys[n][None].double(), values[n][None].double(), mask, scale=scale, softcap=softcap,
            sinks=None if sinks is None else sinks[n : n + 1].double(), backend="math", return_lse=True,
        )  # fmt: skip
        torch.testing.assert_close(paged[0][n : n + 1].double(), want, atol=_tolerance(dtype), rtol=0)
        torch.testing.assert_close(paged[1][n : n + 1].double(), want_lse, atol=_tolerance(dtype), rtol=0)


def test_a_block_outside_the_pool_is_refused_before_the_kernel_runs() -> None:
    """Entries that would be read must name blocks of the pool; entries past a row's reach are
    never read and may hold anything."""
    _require_kernel(torch.float32, None)
    q = torch.zeros(2, 2, 1, 8)  # (N, H, L, E)
    pool = torch.zeros(4, 16, 1, 8)  # (num_blocks, P, G, E)
    lo = torch.zeros(2, 1, dtype=torch.int64)
    hi = torch.tensor([[20], [5]])  # row 0 reads blocks 0 and 1 of its table, row 1 block 0
    fine = torch.tensor([[0, 3, 99], [2, -1, 77]])
    assert native.forward(q, pool, pool, 1.0, 0, 21, 1, lo, hi, table=fine) is not None
    with pytest.raises(ValueError, match=r"block table entry \[0, 1\] = 4 is not a block of the pool"):
        native.forward(q, pool, pool, 1.0, 0, 21, 1, lo, hi, table=torch.tensor([[0, 4, 0], [2, 0, 0]]))
    with pytest.raises(ValueError, match=r"entry \[1, 0\] = -1"):
        native.forward(q, pool, pool, 1.0, 0, 21, 1, lo, hi, table=torch.tensor([[0, 1, 0], [-1, 0, 0]]))
    with pytest.raises(ValueError, match="block table must be int64"):
        native.forward(q, pool, pool, 1.0, 0, 21, 1, lo, hi, table=torch.tensor([[0.0, 1.0, 0.0]] * 2))
    with pytest.raises(ValueError, match="softcap must be positive"):
        native.forward(q, pool, pool, 1.0, 0, 21, 1, lo, hi, softcap=-1.0, table=fine)


def _fragmented_cache(dtype: torch.dtype, P: int, E: int, seed: int):
    """A PagedKVCache whose sequences a and b took blocks in turn (many runs), and contiguous
    KVCaches holding the same keys."""
    G = 2
    gen = torch.Generator().manual_seed(seed)
    paged = qkv.PagedKVCache(num_blocks=4000 // P + 8, block_size=P, num_kv_heads=G, d_k=E, dtype=dtype)
    a, b = paged.allocate(), paged.allocate()
    contiguous = {i: qkv.KVCache(1, 2100, G, E, dtype=dtype) for i in (a, b)}
    for _ in range(34):  # 1,700 keys each, blocks taken in turn
        for i in (a, b):
            n = 50
            k = torch.randn(G, n, E, generator=gen).to(dtype)
            v = torch.randn(G, n, E, generator=gen).to(dtype)
            paged.append([i], [k], [v])
            contiguous[i].update(k[None], v[None])
    assert len(paged.runs(a)) > decode_backend.RUNS_APART
    return paged, contiguous, (a, b)


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("P", [16, 17])
def test_a_fragmented_paged_cache_runs_the_kernel_with_the_contiguous_bits(
    monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]], tier: str, dtype: torch.dtype, P: int
) -> None:
    """`PagedKVCache.attend` on a fragmented pool: one kernel call per sequence through its
    table, equal to a contiguous KVCache's step bit for bit (softcap, sinks, window, GQA 6 / 2)
    and to float64 math; where the kernel cannot run, the PyTorch ops give the same to rounding."""
    if tier != "machine":
        monkeypatch.setenv(TIER_VARIABLE, tier)
    paged, contiguous, ids = _fragmented_cache(dtype, P, 32, seed=P)
    gen = torch.Generator().manual_seed(3)
    sinks = torch.randn(6, generator=gen)  # (H,)
    runs = native.unavailable_reason(dtype, CPU) is None
    for mask, L in ((M.causal(), 1), (M.sliding_window(9), 2), (None, 1)):
        queries = [torch.randn(6, L, 32, generator=gen).mul(2.0).to(dtype) for _ in ids]
        calls.clear()
        with torch.inference_mode():
            outs = paged.attend(list(ids), queries, mask, softcap=2.5, sinks=sinks)
        assert [c["table"] is not None for c in calls] == ([True, True] if runs else [])
        for i, q, out in zip(ids, queries, outs, strict=True):
            kc, vc = contiguous[i].keys_values()  # (1, G, S, E), (1, G, S, Ev)
            want = qkv.attention(q[None].double(), kc.double(), vc.double(), mask, softcap=2.5, sinks=sinks.double(), backend="math")
            torch.testing.assert_close(out.double(), want[0], atol=_tolerance(dtype), rtol=0)
            if runs:
                assert torch.equal(out, qkv.attention(q[None], kc, vc, mask, softcap=2.5, sinks=sinks)[0])


@pytest.mark.parametrize("tier", TIER_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
def test_flash_attn_with_kvcache_block_table_runs_the_kernel(
    monkeypatch: pytest.MonkeyPatch, calls: list[dict[str, Any]], tier: str, dtype: torch.dtype, alibi: bool
) -> None:
    """A batch of five rows of different lengths in a shuffled pool of 17-key blocks with NaN
    spares, causal, softcap, per-row ALiBi slopes: each row through its table by the kernel,
    equal bit for bit to `qkv.attention` on the row's keys in one piece (the kernel there too)
    and to float64 math."""
    if tier != "machine":
        monkeypatch.setenv(TIER_VARIABLE, tier)
    lengths, P, H, G, E = [1030, 1100, 1700, 2000, 1024], 17, 6, 2, 16
    gen = torch.Generator().manual_seed(9)
    keys = [torch.randn(G, S, E, generator=gen).to(dtype) for S in lengths]
    values = [torch.randn(G, S, E, generator=gen).to(dtype) for S in lengths]
    k_pool, v_pool, table = _pool(keys, values, P, seed=10)
    q = torch.randn(5, 1, H, E, generator=gen).mul(2.0).to(dtype)  # (B, L, H, E)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    slopes = torch.rand(5, H, generator=gen) * 0.01 if alibi else None  # (B, H)
    out = flash_attn_with_kvcache(
        q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table.int(), causal=True, softcap=3.0, alibi_slopes=slopes
    )
    runs = native.unavailable_reason(dtype, CPU) is None
    assert len(calls) == (5 if runs else 0) and all(c["table"] is not None for c in calls)
    assert all((c["slopes"] is not None) == alibi for c in calls)
    for b in range(len(lengths)):
        qb = q[b : b + 1].transpose(1, 2)  # (1, H, L, E)
        bias = None if slopes is None else qkv.bias.alibi(slopes[b].double())
        want = qkv.attention(qb.double(), keys[b][None].double(), values[b][None].double(), M.causal(), softcap=3.0,
                             bias=bias, backend="math")  # fmt: skip
        got = out[b : b + 1].transpose(1, 2)  # (1, H, L, Ev)
        torch.testing.assert_close(got.double(), want, atol=_tolerance(dtype), rtol=0)
        if runs:
            bias = None if slopes is None else qkv.bias.alibi(slopes[b])
            assert torch.equal(got, qkv.attention(qb, keys[b][None], values[b][None], M.causal(), softcap=3.0, bias=bias))
