"""Numerics at the edges, on every path: mask precision, lse gradients, the NaN rule, overflow.

Expected values come from the float64 reference (`qkv.reference`, with its lse gradient).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from tests._attention_cases import Case

DENSE_BACKENDS = ["auto", "fused", "math"]


def _reference(q, k, v, mask, d_out=None, d_lse=None, scale=None):  # type: ignore[no-untyped-def]
    np_mask = None
    if isinstance(mask, torch.Tensor):
        np_mask = mask.double().numpy() if mask.is_floating_point() else mask.numpy()
    elif mask is not None:
        np_mask = mask.to_dense(q.shape[-2], k.shape[-2]).numpy()
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), np_mask, scale)
    grads = None
    if d_out is not None:
        grads = R.attention_grads(trace, d_out.double().numpy(), None if d_lse is None else d_lse.double().numpy())
    return trace, grads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", DENSE_BACKENDS)
def test_a_float32_mask_keeps_its_precision_with_low_precision_inputs(dtype: torch.dtype, backend: str) -> None:
    q, k, v = Case(B=1, H=2, G=2, L=5, S=6, E=8, Ev=8).tensors(torch.float64, seed=2)
    mask = torch.zeros(1, 1, 5, 6)
    mask[..., 0, 1] = 7e4  # finite in float32, inf in float16
    mask[..., 1, :] = -1e5  # -inf in float16: the row would look empty
    mask[..., 2, :] = -1e9
    mask[..., 3, :] = torch.linspace(-3.3, 2.1, 6)  # digits bfloat16 would round away
    lo = [t.to(dtype) for t in (q, k, v)]
    out, lse = qkv.attention(*lo, mask, backend=backend, return_lse=True)
    trace, _ = _reference(*lo, mask)  # the reference of the rounded inputs: only the mask's digits matter
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(lse.double().numpy(), trace.lse, rtol=1e-5)
    # row 2: float32 holds -1e9 + s only to a multiple of 64, so only its lse is checked, and
    # that it is not the zero row of an "empty" one
    rows = [0, 1, 3, 4]
    np.testing.assert_allclose(out[..., rows, :].double().numpy(), trace.output[..., rows, :], atol=2e-2)
    assert (out[..., 2, :].abs().sum(-1) > 0).all()


CASES = [
    (Case(B=2, H=4, G=2, L=7, S=11, E=6, Ev=6), None),
    (Case(B=1, H=2, G=1, L=9, S=9, E=5, Ev=3), "causal"),  # E != Ev
    (Case(B=2, H=2, G=2, L=6, S=8, E=4, Ev=4), "bool"),
    (Case(B=2, H=2, G=2, L=6, S=8, E=4, Ev=4), "float"),
]


def _mask(kind: str | None, case: Case) -> object:
    gen = torch.Generator().manual_seed(9)
    if kind == "causal":
        return M.causal()
    if kind == "bool":
        m = torch.rand(case.B, 1, case.L, case.S, generator=gen) > 0.4
        m[0, 0, 1] = False  # an empty row: lse -inf, no gradient
        return m
    if kind == "float":
        m = torch.randn(1, case.H, case.L, case.S, generator=gen) * 3
        m[0, 0, 2] = float("-inf")
        return m
    return None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", ["auto", "fused", "math", "blocks"])
@pytest.mark.parametrize(("case", "kind"), CASES)
def test_lse_is_differentiable_on_every_path(case: Case, kind: str | None, backend: str, dtype: torch.dtype) -> None:
    mask = _mask(kind, case)
    if backend == "blocks" and isinstance(mask, torch.Tensor):
        return  # the block engine takes qkv.masks objects; tensors are refused (test_functional)
    q, k, v = (t.requires_grad_(True) for t in case.tensors(dtype, seed=3))
    gen = torch.Generator().manual_seed(4)
    d_out = torch.randn(case.B, case.H, case.L, case.Ev, generator=gen, dtype=dtype)
    d_lse = torch.randn(case.B, case.H, case.L, generator=gen, dtype=dtype)
    out, lse = qkv.attention(q, k, v, mask, backend=backend, return_lse=True)
    assert lse.requires_grad
    grads = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse.to(lse.dtype)), retain_graph=True)
    _, want = _reference(q.detach(), k.detach(), v.detach(), mask, d_out, d_lse)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got.double().numpy(), ref, atol=tol, rtol=tol)
    # the gradient of a loss on lse alone (no output gradient at all)
    only = torch.autograd.grad(lse, (q, k), d_lse.to(lse.dtype))
    _, want_only = _reference(q.detach(), k.detach(), v.detach(), mask, torch.zeros_like(d_out), d_lse)
    for got, ref in zip(only, want_only, strict=False):
        np.testing.assert_allclose(got.double().numpy(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", DENSE_BACKENDS)
def test_a_learned_float_mask_gets_its_gradient_with_return_lse(backend: str) -> None:
    q, k, v = Case(B=1, H=2, G=2, L=4, S=5, E=4, Ev=4).tensors(torch.float64, seed=5)
    bias = torch.randn(1, 2, 4, 5, dtype=torch.float64, requires_grad=True)
    out, lse = qkv.attention(q, k, v, bias, backend=backend, return_lse=True)
    (grad_bias,) = torch.autograd.grad(out.sum() + lse.sum(), bias)
    # d/dbias = dX of the reference (the mask is added to the scaled scores)
    trace, _ = _reference(q, k, v, bias.detach())
    p = trace.weights
    dp = np.ones_like(trace.output) @ np.swapaxes(trace.v, -1, -2)
    dx = p * (dp - (dp * p).sum(-1, keepdims=True)) + p
    np.testing.assert_allclose(grad_bias.numpy(), dx, atol=1e-10)


def _nan_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = Case(B=1, H=2, G=1, L=5, S=6, E=4, Ev=3).tensors(torch.float32, seed=6)
    q[0, 1, 2, 0] = float("nan")  # query row 2 of head 1
    k[0, 0, 4, 1] = float("inf")  # key 4: rows that may see it
    v[0, 0, 0, 2] = float("nan")  # key 0: hidden from every row by the mask below
    visible = torch.ones(5, 6, dtype=torch.bool).tril(diagonal=1)  # row i sees keys 0..i+1
    visible[:, 0] = False
    visible[4, 1:] = False  # row 4 sees no key at all
    return q, k, v, visible


@pytest.mark.parametrize("backend", ["auto", "fused", "math", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_inputs_give_nan_in_exactly_the_rows_that_read_them(backend: str, dtype: torch.dtype) -> None:
    q, k, v, visible = _nan_inputs()
    mask = M.dense(visible) if backend == "blocks" else visible
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = qkv.attention(q, k, v, mask, backend=backend, return_lse=True)
    expected_nan = torch.zeros(1, 2, 5, dtype=torch.bool)
    expected_nan[0, 1, 2] = True  # its query is NaN
    expected_nan[0, :, 3] = True  # rows 3.. see key 4 (row 4 sees nothing)
    assert torch.equal(torch.isnan(out).all(dim=-1), expected_nan)
    assert torch.equal(torch.isnan(out).any(dim=-1), expected_nan)
    assert torch.equal(torch.isnan(lse), expected_nan)
    # the other rows are exactly those of the finite problem
    clean = [torch.nan_to_num(t, nan=0.0, posinf=0.0) for t in (q, k, v)]
    trace, _ = _reference(*clean, visible)
    keep = ~expected_nan
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    np.testing.assert_allclose(out[keep].double().numpy(), trace.output[keep.numpy()], atol=tol)
    assert (out[0, :, 4] == 0).all() and torch.isneginf(lse[0, :, 4]).all()  # the empty row stays empty


def test_nan_rows_pass_no_gradient_and_others_are_exact() -> None:
    q, k, v, visible = _nan_inputs()
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(q, k, v, visible)
    keep = ~torch.isnan(out)
    out.masked_fill(~keep, 0.0).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_masks_holding_nan_or_plus_inf_are_refused(bad: float) -> None:
    q = k = v = torch.randn(1, 1, 3, 4)
    mask = torch.zeros(3, 3)
    mask[1, 2] = bad
    for call in (qkv.attention, qkv.explain):
        with pytest.raises(ValueError, match=r"float mask holds (NaN|\+inf).*\[\[1, 2\]\]"):
            call(q, k, v, mask)
    mha = qkv.MultiHeadAttention(4, 1)
    with pytest.raises(ValueError, match="float mask holds"):
        mha(torch.randn(1, 3, 4), mask=mask)


def test_scores_that_would_overflow_are_refused_and_float64_holds_them() -> None:
    q = torch.full((1, 1, 2, 4), 1e20)
    v = torch.randn(1, 1, 2, 4)
    for backend in ("auto", "fused", "math"):
        with pytest.raises(ValueError, match=r"scaled scores can reach 4e\+78.*float32"):
            qkv.attention(q, q, v, scale=1e38, backend=backend)
    with pytest.raises(ValueError, match="largest mask value 3"):
        qkv.attention(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), v, torch.full((2, 2), 3e38))
    # the same scores fit float64: equal rows, so the output is the mean of the values
    out = qkv.attention(q.double(), q.double(), v.double(), scale=1e-38)
    torch.testing.assert_close(out, v.double().mean(dim=2, keepdim=True).expand(1, 1, 2, 4))


@pytest.mark.parametrize("backend", ["auto", "fused", "math", "blocks"])
@pytest.mark.parametrize("scale", [-1.0, -1e-30, 0.0, -0.0])
@pytest.mark.parametrize(
    "mask", [M.causal(), M.causal(align="top-left"), M.sliding_window(40, 3)], ids=["causal", "top-left", "window"]
)
def test_any_finite_scale_with_a_causal_or_window_mask(backend: str, scale: float, mask: M.Mask) -> None:
    # PyTorch's CPU flash kernel writes the causal -inf before it multiplies by the scale: a
    # scale <= 0 used to make every row but the last NaN on auto, fused and blocks
    q, k, v = Case(B=1, H=4, G=2, L=150, S=150, E=16, Ev=8).tensors(torch.float32, seed=5)
    d_out, d_lse = torch.randn(1, 4, 150, 8, dtype=torch.float64), torch.randn(1, 4, 150, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = qkv.attention(*leaves, mask, scale=scale, backend=backend, return_lse=True)
    ((out.double() * d_out).sum() + (lse.double() * d_lse).sum()).backward()
    trace, grads = _reference(q, k, v, mask, d_out, d_lse, scale=scale)
    np.testing.assert_allclose(out.detach().double().numpy(), trace.output, atol=2e-5)
    np.testing.assert_allclose(lse.detach().double().numpy(), trace.lse, atol=2e-5)
    for leaf, want in zip(leaves, grads, strict=True):
        assert leaf.grad is not None
        np.testing.assert_allclose(leaf.grad.double().numpy(), want, atol=1e-4)


@pytest.mark.parametrize("scale", [-0.7, 0.0])
def test_a_ring_block_on_the_diagonal_takes_any_finite_scale(scale: float) -> None:
    from qkv.distributed import blockwise

    q, k, v = Case(B=1, H=2, G=1, L=70, S=70, E=8, Ev=8).tensors(torch.float32, seed=6)
    out, lse = blockwise.block_forward(q, k, v, scale, diagonal=True)
    trace, _ = _reference(q, k, v, M.causal(), scale=scale)
    np.testing.assert_allclose(out.double().numpy(), trace.output, atol=2e-5)
    np.testing.assert_allclose(lse.double().numpy(), trace.lse, atol=2e-5)
    d_out = torch.randn(1, 2, 70, 8)
    delta = (d_out * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    blockwise.block_backward(q, k, v, out, d_out, lse, delta, scale, True, dq, dk, dv)
    _, grads = _reference(q, k, v, M.causal(), d_out, scale=scale)
    for got, want in zip((dq, dk, dv), grads, strict=True):
        np.testing.assert_allclose(got.double().numpy(), want, atol=1e-4)


@pytest.mark.parametrize("backend", ["auto", "math", "blocks", "fused"])
def test_finite_score_terms_that_would_overflow_are_refused(backend: str) -> None:
    # each used to give NaN rows: the cap rounds to inf in float32 (s / inf * inf), a slope of
    # -1e38 adds +1e38 per step of distance, two biases of 3e38 add to inf
    q, k, v = Case(B=1, H=2, G=2, L=300, S=300, E=8, Ev=8).tensors(torch.float32, seed=7)
    if backend != "fused":
        with pytest.raises(ValueError, match=r"softcap=1e\+39 is beyond the largest float32"):
            qkv.attention(q, k, v, M.causal(), softcap=1e39, backend=backend)
    with pytest.raises(ValueError, match=r"scaled scores can reach 3e\+40 .*largest bias value 3e\+40"):
        qkv.attention(q, k, v, M.causal(), bias=qkv.bias.alibi(torch.tensor([-1e38, 0.5])), backend=backend)
    both = qkv.bias.dense(torch.full((300, 300), 3e38)) + qkv.bias.relative(torch.full((2, 32), 3e38))
    with pytest.raises(ValueError, match=r"largest bias value 6e\+38"):
        qkv.attention(q, k, v, M.causal(), bias=both, backend=backend)


def test_a_huge_softcap_and_bias_fit_float64() -> None:
    q, k, v = Case(B=1, H=2, G=2, L=6, S=6, E=4, Ev=4).tensors(torch.float64, seed=8)
    bias = torch.full((6, 6), 3e38)
    out = qkv.attention(q, k, v, softcap=1e39, bias=bias, backend="math")
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), softcap=1e39, bias=bias.double().numpy())
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-12)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["dense", "alibi", "relative"])
def test_biases_holding_nan_or_plus_inf_are_refused(bad: float, kind: str) -> None:
    q = k = v = torch.randn(1, 2, 3, 4)
    if kind == "dense":
        values = torch.zeros(3, 3)
        values[1, 2] = bad
        bias: qkv.bias.Bias = qkv.bias.dense(values)
        match = r"bias tensor holds (NaN|\+inf) \(first at indices \[\[0, 0, 1, 2\]\]\)"
    elif kind == "alibi":
        bias = qkv.bias.alibi(torch.tensor([0.5, bad]))
        match = r"alibi slopes tensor holds (NaN|\+inf) \(first at indices \[\[1\]\]\)"
    else:
        table = torch.zeros(2, 32)
        table[1, 5] = bad
        bias = qkv.bias.relative(table)
        match = r"relative bias table holds (NaN|\+inf) \(first at indices \[\[1, 5\]\]\)"
    for call in (qkv.attention, qkv.explain):
        with pytest.raises(ValueError, match=match):
            call(q, k, v, bias=bias)


@pytest.mark.parametrize("backend", ["auto", "math", "fused"])
def test_minus_inf_in_a_dense_bias_or_table_hides_pairs_as_in_a_float_mask(backend: str) -> None:
    q, k, v = Case(B=1, H=2, G=2, L=5, S=5, E=4, Ev=4).tensors(torch.float64, seed=9)
    hide = torch.zeros(5, 5, dtype=torch.float64)
    hide[:, 3] = float("-inf")
    hide[4, :] = float("-inf")  # a whole row: zeros, as a float mask gives
    out = qkv.attention(q, k, v, bias=hide, backend=backend)
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), hide.numpy())
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-12)
    assert (out[..., 4, :] == 0).all()
    table = torch.zeros(2, 8, dtype=torch.float64)
    table[:, 0] = float("-inf")  # bucket 0: the key at the query's own position
    out = qkv.attention(q, k, v, bias=qkv.bias.relative(table, num_buckets=8, max_distance=4), backend=backend)
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), ~np.eye(5, dtype=bool))
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-12)
