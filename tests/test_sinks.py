"""Attention sinks (gpt-oss): one logit per head in every row's softmax denominator, no value.

Checked by hand, against the float64 reference on awkward sizes, by gradcheck, for determinism,
and for their refusals.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qkv
import qkv.reference as ref

CAUSAL = qkv.masks.causal()


def test_a_hand_computed_row() -> None:
    """Scaled scores [0, ln 3] and a sink ln 2: exponentials 1, 3 and 2; weights 1/6, 3/6; lse ln 6."""
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)  # (B, H, L, E)
    k = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64).view(1, 1, 2, 1)  # (B, G, S, E)
    v = torch.eye(2, dtype=torch.float64).view(1, 1, 2, 2)  # (B, G, S, Ev): one-hot values
    sinks = torch.tensor([math.log(2.0)], dtype=torch.float64)
    out, weights, lse = qkv.attention(q, k, v, scale=1.0, sinks=sinks, return_weights=True, return_lse=True)
    torch.testing.assert_close(weights[0, 0, 0], torch.tensor([1 / 6, 3 / 6], dtype=torch.float64))
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1 / 6, 3 / 6], dtype=torch.float64))
    torch.testing.assert_close(lse[0, 0, 0], torch.tensor(math.log(6.0), dtype=torch.float64))
    trace = ref.attention(q.numpy(), k.numpy(), v.numpy(), scale=1.0, sinks=sinks.numpy())
    np.testing.assert_allclose(trace.weights[0, 0, 0], [1 / 6, 3 / 6], rtol=1e-15)


def _dense(mask: object, B: int, H: int, L: int, S: int) -> np.ndarray | None:
    """The mask as a NumPy bool array broadcastable to (B, H, L, S) for the reference."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask.numpy()
    return mask.to_dense(L, S).numpy()  # type: ignore[attr-defined]


NO_ROW_TWO = torch.ones(1, 1, 7, 5, dtype=torch.bool)
NO_ROW_TWO[..., 2, :] = False  # query 2 sees no key

# (B, H, G, L, S, E, Ev, mask): GQA 6/2, L != S both ways, all-masked rows, windows, E != Ev
CASES = [
    (2, 6, 2, 7, 5, 4, 3, NO_ROW_TWO),
    (1, 6, 2, 9, 4, 5, 5, CAUSAL),  # L > S bottom-right: rows 0..4 see no key
    (2, 4, 4, 3, 17, 8, 2, qkv.masks.sliding_window(3) & CAUSAL),
    (3, 2, 1, 1, 97, 16, 16, None),
    (1, 6, 3, 5, 5, 59, 7, qkv.masks.key_padding(torch.tensor([[True, False, True, False, False]]))),
]


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_math_path_matches_the_reference(case: tuple, per_row: bool) -> None:
    B, H, G, L, S, E, Ev, mask = case
    gen = torch.Generator().manual_seed(L * 100 + S)
    q = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, S, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, S, Ev, generator=gen, dtype=torch.float64)
    sinks = torch.randn(*((B, H) if per_row else (H,)), generator=gen, dtype=torch.float64) * 2
    out, weights, lse = qkv.attention(q, k, v, mask, sinks=sinks, return_weights=True, return_lse=True)
    trace = ref.attention(q.numpy(), k.numpy(), v.numpy(), _dense(mask, B, H, L, S), sinks=sinks.numpy())
    np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), trace.weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), trace.lse, rtol=1e-10, atol=1e-12)
    sums = weights.sum(-1)
    seen = torch.isfinite(lse)
    assert bool((sums[seen] < 1).all()) and bool((sums[~seen] == 0).all()) and bool((out[~seen] == 0).all())
    out32 = qkv.attention(q.float(), k.float(), v.float(), mask, sinks=sinks.float())  # float32 state
    np.testing.assert_allclose(out32.numpy(), trace.output, rtol=1e-4, atol=1e-5)


def test_sinks_combine_with_bias_softcap_and_score_mod() -> None:
    """The sink joins the denominator after every score term: softcap, then bias, then score_mod, then the mask."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    bias = torch.randn(1, 4, 6, 6, generator=gen, dtype=torch.float64)

    def shift(score, b, h, i, j):
        return score + 0.5 * h  # exact in the float32 that integer index tensors promote to

    out, lse = qkv.attention(q, k, v, CAUSAL, bias=bias, softcap=2.0, score_mod=shift, sinks=sinks, return_lse=True)
    trace = ref.attention(q.numpy(), k.numpy(), v.numpy(), _dense(CAUSAL, 1, 4, 6, 6), bias=bias.numpy(), softcap=2.0,
                          score_mod=shift, sinks=sinks.numpy())  # fmt: skip
    np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), trace.lse, rtol=1e-10, atol=1e-12)


def test_float32_inputs_with_float64_sinks_and_bfloat16_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen) for _ in range(3))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    trace = ref.attention(q.numpy(), k.numpy(), v.numpy(), _dense(CAUSAL, 1, 4, 6, 6), sinks=sinks.numpy())
    out = qkv.attention(q, k, v, CAUSAL, sinks=sinks)
    np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-5, atol=1e-6)
    low = qkv.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), CAUSAL, sinks=sinks)
    assert low.dtype == torch.bfloat16
    np.testing.assert_allclose(low.float().numpy(), trace.output, rtol=0, atol=3e-2)


def test_gradcheck_q_k_v_and_sinks() -> None:
    """float64 gradcheck through the sink, GQA 4/2, L > S causal (two rows see no key)."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 3, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def outputs(q, k, v, sinks):
        out, lse = qkv.attention(q, k, v, CAUSAL, sinks=sinks, return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(outputs, (q, k, v, sinks))
    per_row = torch.randn(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, s: qkv.attention(q, k, v, sinks=s), (q, per_row))


def test_gradients_are_bitwise_equal_across_runs() -> None:
    gen = torch.Generator().manual_seed(6)
    base = [torch.randn(2, 6, 33, 16, generator=gen), torch.randn(2, 2, 65, 16, generator=gen),
            torch.randn(2, 2, 65, 8, generator=gen), torch.randn(6, generator=gen)]  # fmt: skip
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_(True) for t in base]
        q, k, v, sinks = leaves
        out = qkv.attention(q, k, v, qkv.masks.sliding_window(7) & CAUSAL, sinks=sinks)
        out.pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for first, second in zip(*grads, strict=True):
        assert first is not None and torch.equal(first, second)


def test_explain_names_the_math_path_and_other_backends_refuse() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    sinks = torch.zeros(2)
    explanation = qkv.explain(q, k, v, CAUSAL, sinks=sinks)
    assert explanation.path == "math" and "sinks: the math path applies them" in str(explanation)
    for backend in ("fused", "blocks", "flex"):
        with pytest.raises(ValueError, match=rf"sinks: backend='{backend}' .* backend='math' or 'auto'"):
            qkv.attention(q, k, v, CAUSAL, sinks=sinks, backend=backend)
    assert qkv.attention(q, k, v, sinks=sinks, backend="math").shape == (1, 2, 4, 8)
    out, weights = qkv.attention(q, k, v, sinks=sinks, dropout=0.5, return_weights=True)  # dropout too
    assert out.shape == (1, 2, 4, 8) and bool((weights.sum(-1) < 2).all())


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        ([0.0, 0.0], TypeError, "sinks must be None or a float tensor"),
        (torch.zeros(2, dtype=torch.bfloat16), TypeError, "float32 or float64"),
        (torch.zeros(2, dtype=torch.int64), TypeError, "float32 or float64"),
        (torch.zeros(3), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
        (torch.zeros(4, 2), ValueError, "broadcastable"),
        (torch.zeros(()), ValueError, "broadcastable"),
        (torch.tensor([0.0, math.inf]), ValueError, "sinks must be finite"),
        (torch.tensor([math.nan, 0.0]), ValueError, "sinks must be finite"),
    ],
)
def test_bad_sinks_are_refused_before_any_work(monkeypatch: pytest.MonkeyPatch, sinks, error, match) -> None:
    from qkv.attention import problem as problem_module

    def no_scan(tensors: object) -> None:
        raise AssertionError("the data checks ran before sinks were validated")

    monkeypatch.setattr(problem_module, "_largest_magnitudes", no_scan)
    q = k = v = torch.randn(3, 2, 4, 8)
    with pytest.raises(error, match=match):
        qkv.attention(q, k, v, sinks=sinks)


def test_nan_rule_holds_with_sinks() -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen)
    k[0, 1, 2, 0] = math.nan
    out = qkv.attention(q, k, v, CAUSAL, sinks=torch.zeros(2))
    assert out[0, 0].isfinite().all() and out[0, 1, :2].isfinite().all() and out[0, 1, 2:].isnan().all()
