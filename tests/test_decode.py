"""The decode kernel (`qkv.backends.decode`, backend="decode"): a few queries against many keys,
split into chunks and merged by lse. Against the float64 reference on awkward sizes, a decode
step against the full causal forward (forward and backward), determinism, routing and refusals."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

import qkv
import qkv.reference as ref
from qkv.backends.decode import decode_attention, default_splits
from qkv.native.machine import compute_dtype

CAUSAL = qkv.masks.causal()


def _inputs(B: int, H: int, G: int, L: int, S: int, E: int, Ev: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 7 * S + L)
    q = torch.randn(B, H, L, E, generator=gen, dtype=dtype)  # (B, H, L, E)
    k = torch.randn(B, G, S, E, generator=gen, dtype=dtype)  # (B, G, S, E)
    v = torch.randn(B, G, S, Ev, generator=gen, dtype=dtype)  # (B, G, S, Ev)
    return q, k, v


def _dense(mask: object, L: int, S: int) -> np.ndarray | None:
    return None if mask is None else mask.to_dense(L, S).numpy()  # type: ignore[attr-defined]


PADDING = torch.ones(2, 1025, dtype=torch.bool)
PADDING[0, 300:700] = False  # holes in row 0
PADDING[1, :] = False  # row 1 sees no key at all

# (B, H, G, L, S, mask)
CASES = [
    (1, 6, 2, 1, 1, None),
    (2, 6, 2, 3, 17, CAUSAL),
    (1, 6, 2, 16, 1025, CAUSAL),
    (2, 4, 4, 5, 4097, qkv.masks.sliding_window(40)),  # a window shorter than a chunk
    (2, 6, 2, 2, 1025, qkv.masks.key_padding(PADDING)),  # all-masked rows
    (1, 6, 3, 4, 1025, qkv.masks.causal(align="top-left")),  # queries 0..3 see 1..4 keys
    (1, 2, 1, 1, 4097, None),
]


@pytest.mark.parametrize("Ev", [5, 8])  # 8 = E: the keys every query sees go to the fused kernel
@pytest.mark.parametrize("splits", [None, 3, 7])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[f"S{c[4]}-{i}" for i, c in enumerate(CASES)])
def test_decode_matches_the_reference(case: tuple, with_sinks: bool, splits: int | None, Ev: int) -> None:
    B, H, G, L, S, mask = case
    q, k, v = _inputs(B, H, G, L, S, 8, Ev)
    sinks = torch.linspace(-2.0, 3.0, H, dtype=torch.float64) if with_sinks else None
    out, lse = decode_attention(q, k, v, 0.35, mask, sinks=None if sinks is None else sinks[None], splits=splits)
    trace = ref.attention(q.numpy(), k.numpy(), v.numpy(), _dense(mask, L, S), scale=0.35,
                          sinks=None if sinks is None else sinks.numpy())  # fmt: skip
    np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), trace.lse, rtol=1e-10, atol=1e-12)
    if mask is not None and isinstance(mask, qkv.masks.KeyPadding):
        assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all())


def _spy_fused(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the key shapes the fused kernel (PyTorch's flash attention for CPU) is given."""
    import qkv.backends.decode as decode

    seen: list[tuple[int, ...]] = []
    real = decode.cpu_flash_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(tuple(k.shape))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(decode, "cpu_flash_attention", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("mask", "fused_keys"), [(CAUSAL, 4097 - 4), (qkv.masks.sliding_window(1000), 1001 - 4), (None, 4097)])
def test_keys_every_query_sees_go_to_the_fused_kernel(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, mask: object, fused_keys: int
) -> None:
    """Without gradients the keys all L queries see go to the fused kernel, in chunks of strided
    views (no copy), the edges to the masked chunks; the merge equals the float64 reference."""
    seen = _spy_fused(monkeypatch)
    B, H, G, L, S = 2, 6, 2, 5, 4097
    q, k, v = _inputs(B, H, G, L, S, 16, 16, dtype=dtype)
    sinks = torch.linspace(-1.0, 2.0, H, dtype=torch.float64)
    for splits in (None, 5):
        seen.clear()
        out, lse = decode_attention(q, k, v, 0.3, mask, sinks=sinks[None].to(dtype), splits=splits)
        # one call of k (B, G, n, E), or one per batch row of k (chunks, G, C, E)
        assert sum(shape[0] * shape[2] for shape in seen) == B * fused_keys
        trace = ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), _dense(mask, L, S),
                              scale=0.3, sinks=sinks.numpy())  # fmt: skip
        tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
        np.testing.assert_allclose(out.double().numpy(), trace.output, **tol)
        np.testing.assert_allclose(lse.double().numpy(), trace.lse, **tol)


def test_keys_in_runs_equal_the_keys_in_one_piece() -> None:
    """`decode_runs` over the cache cut into runs of uneven lengths, given out of order and as
    strided views of a block pool, equals the float64 reference."""
    from qkv.backends.decode import decode_runs

    B, H, G, L, S, E = 1, 6, 2, 3, 2000, 8
    q, k, v = _inputs(B, H, G, L, S, E, E)
    cuts = [0, 300, 301, 1024, 1900, S]
    runs = []
    for a, b in itertools.pairwise(cuts):
        pool_k = torch.zeros(b - a, G, E, dtype=k.dtype)  # (n, G, E): the paged layout
        pool_k.copy_(k[0, :, a:b].transpose(0, 1))
        pool_v = v[0, :, a:b].transpose(0, 1).contiguous()  # (n, G, Ev)
        runs.append((a, pool_k.transpose(0, 1)[None], pool_v.transpose(0, 1)[None]))  # (1, G, n, E) views
    for mask in (CAUSAL, qkv.masks.sliding_window(700), None):
        out, lse = decode_runs(q, runs[::-1], S, 0.35, mask)
        trace = ref.attention(q.numpy(), k.numpy(), v.numpy(), _dense(mask, L, S), scale=0.35)
        np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse.numpy(), trace.lse, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_through_attention_with_gqa_bias_and_sinks(dtype: torch.dtype) -> None:
    """backend='decode' through qkv.attention: GQA 6/2, ALiBi, sinks, a window; float32 state."""
    B, H, G, L, S = 2, 6, 2, 3, 1025
    q, k, v = _inputs(B, H, G, L, S, 16, 16)
    sinks = torch.linspace(-1.0, 1.0, H, dtype=torch.float64)
    bias = qkv.bias.alibi()
    mask = qkv.masks.sliding_window(500)
    out, lse = qkv.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, bias=bias, sinks=sinks.float(),
                             backend="decode", return_lse=True)  # fmt: skip
    q, k, v = q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double()  # the inputs as rounded
    expected, expected_lse = qkv.attention(q, k, v, mask, bias=bias, sinks=sinks, backend="math", return_lse=True)
    # bf16: products in bf16 where the CPU has them natively (or QKV_KEEP_EMULATED_DTYPES keeps
    # them), so the scores, and with them the lse, carry bf16 rounding; float32 elsewhere
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tol)
    torch.testing.assert_close(lse.double(), expected_lse, **(tol if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-4}))


def test_a_decode_step_is_the_last_row_of_the_causal_forward() -> None:
    """One new token against its cache equals the last row of the full causal forward: output
    and the gradients of q (its row), k and v."""
    B, H, G, S, E = 1, 6, 2, 1100, 16
    q, k, v = _inputs(B, H, G, S, S, E, E, dtype=torch.float32)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    full = qkv.attention(q, k, v, CAUSAL, backend="math")  # (B, H, S, E)
    grad = torch.randn(B, H, 1, E, generator=torch.Generator().manual_seed(3))
    dq_full, dk_full, dv_full = torch.autograd.grad(full[:, :, -1:], (q, k, v), grad)
    last = q[:, :, -1:].detach().requires_grad_(True)
    step = qkv.attention(last, k, v, CAUSAL, backend="decode")  # (B, H, 1, E)
    torch.testing.assert_close(step, full[:, :, -1:].detach(), rtol=1e-5, atol=1e-6)
    dq, dk, dv = torch.autograd.grad(step, (last, k, v), grad)
    torch.testing.assert_close(dq, dq_full[:, :, -1:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dk, dk_full, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv, dv_full, rtol=1e-4, atol=1e-5)
    assert qkv.explain(last, k, v, CAUSAL).path == "decode"  # auto takes it with gradients too


def test_sink_gradient_matches_the_math_path() -> None:
    q, k, v = _inputs(1, 4, 2, 2, 1030, 8, 8)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    out = qkv.attention(q, k, v, CAUSAL, sinks=sinks, backend="decode")
    expected = qkv.attention(q, k, v, CAUSAL, sinks=sinks, backend="math")
    (got,) = torch.autograd.grad(out.sum(), sinks)
    (want,) = torch.autograd.grad(expected.sum(), sinks)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_two_runs_are_bitwise_equal() -> None:
    q, k, v = _inputs(1, 8, 2, 4, 4097, 32, 32, dtype=torch.float32)
    k.requires_grad_(True)
    first = qkv.attention(q, k, v, CAUSAL, backend="decode")
    second = qkv.attention(q, k, v, CAUSAL, backend="decode")
    assert torch.equal(first, second)
    (g1,) = torch.autograd.grad(first.sum(), k)
    (g2,) = torch.autograd.grad(second.sum(), k)
    assert torch.equal(g1, g2)
    with torch.inference_mode():  # the fused path, chunked (splits=6) and in one piece
        for splits in (6, None):
            once = decode_attention(q, k, v, 0.2, CAUSAL, splits=splits)
            again = decode_attention(q, k, v, 0.2, CAUSAL, splits=splits)
            assert torch.equal(once[0], again[0]) and torch.equal(once[1], again[1])


def test_auto_routes_decode_steps_only() -> None:
    q, k, v = _inputs(1, 8, 2, 1, 2048, 16, 16, dtype=torch.float32)
    plan = qkv.explain(q, k, v, CAUSAL)
    assert plan.path == "decode" and "decode step" in plan.reason and "chunk" in plan.route
    assert qkv.explain(q, k[:, :, :1], v[:, :, :1], CAUSAL).path != "decode"  # S = 1
    assert qkv.explain(q, k[:, :, :1023], v[:, :, :1023]).path != "decode"
    long_q = torch.randn(1, 8, 17, 16)
    assert qkv.explain(long_q, k, v, CAUSAL).path != "decode"
    assert qkv.explain(q, k, v, CAUSAL, softcap=30.0).path == "decode"  # the kernel applies a softcap
    assert qkv.explain(q, k, v, CAUSAL, score_mod=lambda s, b, h, i, j: s).path != "decode"
    assert qkv.explain(q, k, v, CAUSAL, return_weights=True).path != "decode"


def test_default_splits_give_every_thread_work() -> None:
    assert default_splits(32768, threads=4) == 32
    assert default_splits(4096, threads=8) == 16
    assert default_splits(100, threads=4) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"score_mod": lambda s, b, h, i, j: s}, "softcap and a bias only"),
        ({"return_weights": True}, "no weights"),
        ({"mask": torch.ones(1, 1, 1, 64, dtype=torch.bool)}, "got bool"),
        ({"mask": qkv.masks.prefix_lm(3)}, "causal"),
        ({"dropout": 0.1}, "dropout"),
    ],
)
def test_refusals_name_the_argument(kwargs: dict, message: str) -> None:
    q, k, v = _inputs(1, 2, 1, 1, 64, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        qkv.attention(q, k, v, backend="decode", **kwargs)


def test_too_many_queries_are_refused() -> None:
    q, k, v = _inputs(1, 2, 1, 17, 64, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="at most 16 queries, got L=17"):
        qkv.attention(q, k, v, backend="decode")


def test_bfloat16_is_widened_wave_by_wave_not_copied_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine that emulates bf16 products, attention hands the decode kernel the bf16 cache
    (it widens one wave at a time); the result equals the float32 computation on the rounded inputs."""
    import qkv.backends.decode as decode

    seen: list[torch.dtype] = []
    real = decode.decode_attention

    def spy(q: torch.Tensor, k: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(k.dtype)
        return real(q, k, *args, **kwargs)

    from qkv.attention import execute as execute_module

    monkeypatch.setattr(execute_module, "decode_attention", spy)
    monkeypatch.setattr(decode, "WIDEN_WAVE", 700)  # several waves, a partial last one
    q, k, v = (t.bfloat16() for t in _inputs(1, 6, 2, 2, 2049, 16, 16, dtype=torch.float32))
    out = qkv.attention(q, k, v, CAUSAL)
    expected = qkv.attention(q.float(), k.float(), v.float(), CAUSAL, backend="math")
    assert len(seen) == 1
    if compute_dtype(torch.bfloat16, q.device) == torch.float32:
        assert seen == [torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def _visible_by_hand(kind: str, left: int, right: int, align: str, L: int, S: int) -> np.ndarray:
    """(L, S) bool, written from the masks' documented rules: query i sits at p = i + S - L
    (bottom-right) or p = i (top-left); causal sees keys 0..p, a window p - left..p + right."""
    p = np.arange(L)[:, None] + (S - L if align == "bottom-right" else 0)
    j = np.arange(S)[None, :]
    return (j <= p) if kind == "causal" else (j >= p - left) & (j <= p + right)


def test_key_range_from_the_end_rows_equals_the_rows_bounds() -> None:
    """`_key_range` finds a step's key range from its first and last queries in Python integers
    (the masks' bounds taken on an int); it must give the keys some query sees, and per-query
    bounds exactly when some query sees fewer, by the masks' rules written out by hand. Causal
    and sliding windows, both alignments, L above and below S, windows wider than the cache
    and rows that see no key."""
    from qkv.backends.decode import _key_range

    cases = [
        ("causal", 0, 0, "bottom-right"), ("causal", 0, 0, "top-left"), ("window", 0, 0, "bottom-right"),
        ("window", 3, 0, "bottom-right"), ("window", 5, 2, "bottom-right"), ("window", 40, 40, "bottom-right"),
        ("window", 2, 0, "top-left"), ("window", 10**12, 0, "bottom-right"),
    ]
    for (kind, left, right, align), L, S in itertools.product(cases, (1, 2, 5, 16), (1, 3, 7, 17, 64)):
        mask = qkv.masks.causal(align=align) if kind == "causal" else qkv.masks.sliding_window(left, right, align=align)
        visible = _visible_by_hand(kind, left, right, align, L, S)  # (L, S)
        start, stop, lo, hi, valid = _key_range(mask, 1, L, S, torch.device("cpu"))
        assert valid is None
        seen = visible.any(axis=0)  # keys some query sees
        if not seen.any():
            assert (start, stop) == (0, 0), (mask, L, S)
            continue
        keys = np.flatnonzero(seen)
        assert (start, stop) == (int(keys[0]), int(keys[-1]) + 1), (mask, L, S)
        every_row_sees_all = bool(visible[:, start:stop].all())
        assert (lo is None) == every_row_sees_all, (mask, L, S)
        if lo is not None and hi is not None:
            rows = visible.any(axis=1)  # rows with a visible key: their bounds are the first and last
            assert np.array_equal(lo[0].numpy()[rows], visible[rows].argmax(axis=1))
            assert np.array_equal(hi[0].numpy()[rows], S - 1 - visible[rows][:, ::-1].argmax(axis=1))
