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


def test_explain_names_the_paths_and_sdpa_refuses() -> None:
    """Small problems take the math path, large ones the block engine; SDPA has no sink logit."""
    q = k = v = torch.randn(1, 2, 4, 8)
    sinks = torch.zeros(2)
    explanation = qkv.explain(q, k, v, CAUSAL, sinks=sinks)
    assert explanation.path == "math" and "sinks: SDPA has no attention-sink logit" in str(explanation)
    with pytest.raises(ValueError, match=r"sinks: backend='fused' \(PyTorch's SDPA\) has no attention-sink logit"):
        qkv.attention(q, k, v, CAUSAL, sinks=sinks, backend="fused")
    assert qkv.attention(q, k, v, sinks=sinks, backend="math").shape == (1, 2, 4, 8)
    out, weights = qkv.attention(q, k, v, sinks=sinks, dropout=0.5, return_weights=True)  # dropout too
    assert out.shape == (1, 2, 4, 8) and bool((weights.sum(-1) < 2).all())
    big = torch.randn(1, 2, 512, 8)
    window = qkv.explain(big, big, big, qkv.masks.sliding_window(64), sinks=sinks)
    assert window.path == "blocks" and "folds each row's sink into its merged lse" in str(window)
    dense_mask = torch.ones(512, 512, dtype=torch.bool).tril()
    assert qkv.explain(big, big, big, dense_mask, sinks=sinks).path == "math"  # the tile paths take no tensor mask
    assert qkv.explain(big, big, big, sinks=sinks, dropout=0.1).path == "math"


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
    from qkv.attention import problem

    def no_scan(tensors: object) -> None:
        raise AssertionError("the data checks ran before sinks were validated")

    monkeypatch.setattr(problem, "_largest_magnitudes", no_scan)
    q = k = v = torch.randn(3, 2, 4, 8)
    with pytest.raises(error, match=match):
        qkv.attention(q, k, v, sinks=sinks)


def test_nan_rule_holds_with_sinks() -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen), torch.randn(1, 2, 4, 4, generator=gen)
    k[0, 1, 2, 0] = math.nan
    out = qkv.attention(q, k, v, CAUSAL, sinks=torch.zeros(2))
    assert out[0, 0].isfinite().all() and out[0, 1, :2].isfinite().all() and out[0, 1, 2:].isnan().all()


# The block engine and FlexAttention fold the sink into each row's merged lse
# (qkv.backends.sinks). Each case: (B, H, G, L, S, E, Ev, mask, score terms); sizes 1, 17 and
# 1,025 cut across the engine's tiles, some rows see no key.
DOCS = qkv.masks.documents(torch.tensor([[0] * 9 + [1] * 8, [0] * 3 + [1] * 14]))
EMPTY_ROWS = qkv.masks.key_padding(torch.tensor([[True] * 17, [False] * 17]))  # batch row 1 sees no key


def _shift(score, b, h, i, j):
    return score + 0.25 * h - 0.125 * b  # exact in float32


ENGINE_CASES = [
    (2, 6, 2, 17, 17, 8, 4, None, {}),
    (1, 6, 2, 1, 17, 8, 8, CAUSAL, {}),  # one query, bottom-right: it sees every key
    (2, 6, 2, 17, 1, 8, 8, CAUSAL, {}),  # one key: only the last row sees it
    (2, 4, 4, 17, 17, 16, 16, EMPTY_ROWS, {}),
    (2, 6, 3, 17, 17, 8, 8, DOCS & CAUSAL, {"softcap": 3.0}),
    (1, 6, 2, 1025, 1025, 8, 8, qkv.masks.sliding_window(40) & CAUSAL, {}),
    (1, 4, 2, 1025, 1025, 8, 8, qkv.masks.sliding_window(30, 20), {"bias": qkv.bias.alibi(qkv.bias.alibi_slopes(4)), "softcap": 5.0}),
    (1, 6, 2, 33, 1025, 8, 8, CAUSAL, {"score_mod": _shift, "bias": qkv.bias.alibi(qkv.bias.alibi_slopes(6))}),
]


def _inputs(case: tuple, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    B, H, G, L, S, E, Ev = case[:7]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, S, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, S, Ev, generator=gen, dtype=torch.float64)
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) * 2
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks


def _reference(case: tuple, q, k, v, sinks):
    B, H, _, L, S, _, _, mask, terms = case
    np_terms = {name: value for name, value in terms.items() if name != "bias"}
    if "bias" in terms:
        np_terms["bias"] = terms["bias"].to_dense(L, S, H=H, dtype=torch.float64).numpy()
    return ref.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), _dense(mask, B, H, L, S),
                         sinks=sinks.double().numpy(), **np_terms)  # fmt: skip


@pytest.mark.parametrize("case", ENGINE_CASES, ids=[f"case{i}" for i in range(len(ENGINE_CASES))])
def test_block_engine_matches_the_reference(case: tuple) -> None:
    """Output, weights and lse of the block engine in float64 against the float64 reference,
    and its gradients (q, k, v, sinks, through the output and the lse) against the math path's."""
    mask, terms = case[7], case[8]
    q, k, v, sinks = _inputs(case, torch.float64, seed=len(str(case)))
    trace = _reference(case, q, k, v, sinks)
    with torch.no_grad():
        out, weights, lse = qkv.attention(q, k, v, mask, sinks=sinks, backend="blocks", return_weights=True, return_lse=True, **terms)
    np.testing.assert_allclose(out.numpy(), trace.output, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), trace.weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), trace.lse, rtol=1e-10, atol=1e-12)
    assert bool((out[~torch.isfinite(lse)] == 0).all())

    grads = []
    for backend in ("blocks", "math"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        o, w, row_lse = qkv.attention(*leaves[:3], mask, sinks=leaves[3], backend=backend, return_weights=True, return_lse=True, **terms)
        if backend == "blocks":  # weights a loss differentiates come from the dense formula, sinks included
            np.testing.assert_allclose(w.detach().numpy(), trace.weights, rtol=1e-10, atol=1e-12)
        loss = (o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum() + torch.where(torch.isfinite(row_lse), row_lse, 0).sum()
        loss = loss + (w * w.detach()).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for engine, formula in zip(*grads, strict=True):
        torch.testing.assert_close(engine, formula, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_block_engine_in_low_precision(dtype: torch.dtype, atol: float) -> None:
    """float32 / bfloat16 inputs with float64 sinks: the sinks stay float64 (their gradient too),
    the state is float32; against the float64 reference and the float64 math path's gradients."""
    case = (1, 6, 2, 300, 300, 64, 64, qkv.masks.sliding_window(40) & CAUSAL, {})
    q, k, v, sinks = _inputs(case, dtype, seed=12)
    trace = _reference(case, q, k, v, sinks)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out = qkv.attention(*leaves[:3], case[7], sinks=leaves[3], backend="blocks")
    assert out.dtype == dtype
    np.testing.assert_allclose(out.detach().double().numpy(), trace.output, rtol=0, atol=atol)
    out.double().pow(2).sum().backward()
    exact = [t.detach().double().requires_grad_(True) for t in (q, k, v, sinks)]
    qkv.attention(*exact[:3], case[7], sinks=exact[3], backend="math").pow(2).sum().backward()
    assert leaves[3].grad is not None and leaves[3].grad.dtype == torch.float64
    for low, high in zip(leaves, exact, strict=True):
        assert low.grad is not None and high.grad is not None
        scale = float(high.grad.abs().max())
        torch.testing.assert_close(low.grad.double(), high.grad, rtol=0, atol=atol * 4 * max(scale, 1.0))


def test_gradcheck_through_the_block_engine() -> None:
    """float64 gradcheck of q, k, v and sinks through the block engine, GQA 4/2, L > S causal
    (rows that see no key), output and lse; and per-batch-row sinks (B, H) with a window."""
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(2, 4, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 5, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def outputs(q, k, v, sinks):
        out, lse = qkv.attention(q, k, v, CAUSAL, sinks=sinks, backend="blocks", return_lse=True)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(outputs, (q, k, v, sinks))
    per_row = torch.randn(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    window = qkv.masks.sliding_window(2)
    assert torch.autograd.gradcheck(lambda s: qkv.attention(q.detach(), k, v, window, sinks=s, backend="blocks", softcap=2.0), (per_row,))


def test_block_engine_gradients_are_bitwise_equal_across_runs() -> None:
    gen = torch.Generator().manual_seed(16)
    base = [torch.randn(2, 6, 700, 16, generator=gen), torch.randn(2, 2, 700, 16, generator=gen),
            torch.randn(2, 2, 700, 8, generator=gen), torch.randn(6, generator=gen)]  # fmt: skip
    for terms in ({}, {"softcap": 4.0}):
        grads = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_(True) for t in base]
            q, k, v, sinks = leaves
            out = qkv.attention(q, k, v, qkv.masks.sliding_window(100) & CAUSAL, sinks=sinks, backend="blocks", **terms)
            out.pow(2).sum().backward()
            grads.append([t.grad for t in leaves])
        for first, second in zip(*grads, strict=True):
            assert first is not None and torch.equal(first, second)


def test_auto_sends_large_problems_with_sinks_to_the_block_engine() -> None:
    """n = 1,024 with a window: 'auto' runs the engine, which matches the float64 math path."""
    case = (1, 4, 2, 1024, 1024, 32, 32, qkv.masks.sliding_window(128), {})
    q, k, v, sinks = _inputs(case, torch.float32, seed=17)
    assert qkv.explain(q, k, v, case[7], sinks=sinks.float()).path == "blocks"
    out, lse = qkv.attention(q, k, v, case[7], sinks=sinks.float(), return_lse=True)
    exact, exact_lse = qkv.attention(q.double(), k.double(), v.double(), case[7], sinks=sinks, backend="math", return_lse=True)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), exact_lse, rtol=0, atol=2e-5)


def test_only_the_sinks_require_grad() -> None:
    case = (2, 4, 2, 17, 17, 8, 8, CAUSAL, {})
    q, k, v, sinks = _inputs(case, torch.float64, seed=18)
    grads = []
    for backend in ("blocks", "math"):
        leaf = sinks.clone().requires_grad_(True)
        qkv.attention(q, k, v, CAUSAL, sinks=leaf, backend=backend).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
def test_flex_folds_the_sink_into_its_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend='flex' with FlexAttention's eager reference on CPU (the compiled CPU kernel takes
    a minute to build; on CUDA the same fold reads the kernel's differentiable lse)."""
    import functools

    from qkv.attention import execute
    from qkv.backends.flex import flex_attention_layout
    monkeypatch.setattr(execute, "flex_attention_layout", functools.partial(flex_attention_layout, compiled=False))
    case = (2, 4, 2, 40, 40, 16, 16, qkv.masks.key_padding(torch.tensor([[True] * 40, [False] * 40])) & CAUSAL, {"softcap": 3.0})
    q, k, v, sinks = _inputs(case, torch.float32, seed=19)
    trace = _reference(case, q, k, v, sinks)
    out, weights, lse = qkv.attention(q, k, v, case[7], sinks=sinks.float(), backend="flex", return_weights=True, return_lse=True, softcap=3.0)
    np.testing.assert_allclose(out.numpy(), trace.output, rtol=0, atol=2e-5)
    np.testing.assert_allclose(weights.numpy(), trace.weights, rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse.numpy(), trace.lse, rtol=0, atol=2e-5)


def test_the_fold_function_by_gradcheck() -> None:
    """SinkFold (the fold for FlexAttention's differentiable lse) in float64, rows with lse = -inf included."""
    from qkv.backends.sinks import SinkFold

    gen = torch.Generator().manual_seed(20)
    out = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    lse[1, 2, 3] = -math.inf
    lse.requires_grad_(True)
    sinks = torch.randn(1, 3, generator=gen, dtype=torch.float64, requires_grad=True)

    def folded(out, lse, sinks):
        o, folded_lse = SinkFold.apply(out, lse, sinks)
        return o, torch.where(torch.isfinite(folded_lse), folded_lse, torch.zeros_like(folded_lse))

    assert torch.autograd.gradcheck(folded, (out, lse, sinks))
    o, folded_lse = SinkFold.apply(out, lse, sinks)
    assert bool((o[1, 2, 3] == 0).all()) and folded_lse[1, 2, 3] == -math.inf
    # by hand: lse' = log(exp(lse) + exp(sink)), O' = O exp(lse - lse')
    expected = torch.logaddexp(lse[0, 0, 0], sinks[0, 0])
    torch.testing.assert_close(folded_lse[0, 0, 0], expected)
    torch.testing.assert_close(o[0, 0, 0], out[0, 0, 0] * torch.exp(lse[0, 0, 0] - expected))


@pytest.mark.parametrize("case", [*ENGINE_CASES[:5], (2, 6, 2, 7, 5, 4, 3, NO_ROW_TWO, {})], ids=[f"case{i}" for i in range(6)])
def test_attention_weights_of_chosen_rows_keep_the_sinks_share(case: tuple) -> None:
    """qkv.attention_weights with sinks: the chosen heads' and rows' weights equal the float64
    reference's (the sink in every denominator), so a row with a visible key sums below 1."""
    B, H, L = case[0], case[1], case[3]
    mask, terms = case[7], case[8]
    q, k, v, sinks = _inputs(case, torch.float64, seed=len(str(case)) + 1)
    trace = _reference(case, q, k, v, sinks)
    heads, rows = [H - 1, 0], sorted({0, L // 2, L - 1})
    weights = qkv.attention_weights(q, k, v, mask, heads=heads, rows=rows, sinks=sinks, **terms)
    expected = trace.weights[:, heads][:, :, rows]  # (B, h, r, S)
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-10, atol=1e-12)
    sums = weights.sum(-1)
    assert bool((sums < 1 - 1e-6).any()) and bool((sums < 1).all())
    assert weights.shape == (B, len(heads), len(rows), k.shape[2])
