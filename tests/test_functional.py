"""qkv.attention against the float64 reference and against PyTorch's own SDPA.

Every backend, forward and gradients, on awkward sizes (1, 7, 97, 1025, head dim 1 and 59),
L != S, E != Ev, GQA, every tensor mask kind, fully masked rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from tests._attention_cases import Case, reference_forward_backward

BACKENDS = ("auto", "fused", "math")


def _random_mask(kind: str, case: Case, gen: torch.Generator) -> object:
    L, S = case.L, case.S
    if kind == "none":
        return None
    if kind == "bool":
        m = torch.rand(case.B, 1, L, S, generator=gen) > 0.3
        m[..., 0, :] = False  # a fully masked row in every batch
        return m
    if kind == "bool-per-head":
        return torch.rand(case.B, case.H, L, S, generator=gen) > 0.5
    if kind == "float":
        m = torch.randn(1, case.H, L, S, generator=gen, dtype=torch.float64)
        m[..., -1, :] = float("-inf")  # a fully masked row, as an additive mask
        return m
    if kind == "causal":
        return qkv.masks.causal()
    if kind == "causal-top-left":
        return qkv.masks.causal(align="top-left")
    raise AssertionError(kind)


MASK_KINDS = ("none", "bool", "bool-per-head", "float", "causal", "causal-top-left")


def _check_against_reference(case: Case, mask_kind: str, backend: str, seed: int = 0) -> None:
    q, k, v = case.tensors(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = _random_mask(mask_kind, case, gen)
    d_out = torch.randn(case.B, case.H, case.L, case.Ev, generator=gen, dtype=torch.float64)
    trace, (dq_ref, dk_ref, dv_ref) = reference_forward_backward(q, k, v, mask, d_out)

    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, weights, lse = qkv.attention(q, k, v, mask, return_weights=True, return_lse=True, backend=backend)
    (out * d_out).sum().backward()

    np.testing.assert_allclose(out.detach().numpy(), trace.output, atol=1e-10, rtol=1e-10)
    np.testing.assert_allclose(weights.detach().numpy(), trace.weights, atol=1e-10, rtol=1e-10)
    np.testing.assert_array_equal(np.isneginf(lse.detach().numpy()), np.isneginf(trace.lse))
    finite = np.isfinite(trace.lse)
    np.testing.assert_allclose(lse.detach().numpy()[finite], trace.lse[finite], atol=1e-10, rtol=1e-10)
    for grad, ref in ((q.grad, dq_ref), (k.grad, dk_ref), (v.grad, dv_ref)):
        assert grad is not None and not torch.isnan(grad).any()
        np.testing.assert_allclose(grad.numpy(), ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize(
    "case",
    [
        Case(B=2, H=4, G=2, L=7, S=7, E=59, Ev=3),  # GQA, head dim 59, E != Ev
        Case(B=1, H=3, G=3, L=1, S=97, E=8, Ev=8),  # one query (a decoding step)
        Case(B=1, H=2, G=1, L=97, S=1, E=1, Ev=5),  # one key, head dim 1, MQA
        Case(B=1, H=2, G=2, L=33, S=97, E=16, Ev=16),  # L < S
        Case(B=1, H=2, G=2, L=97, S=7, E=16, Ev=4),  # L > S: bottom-right causal leaves empty rows
    ],
    ids=lambda c: f"H{c.H}G{c.G}L{c.L}S{c.S}E{c.E}Ev{c.Ev}" if isinstance(c, Case) else str(c),
)
def test_every_backend_matches_the_reference(case: Case, mask_kind: str, backend: str) -> None:
    _check_against_reference(case, mask_kind, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_awkward_sequence(backend: str) -> None:
    _check_against_reference(Case(B=1, H=2, G=1, L=1025, S=1025, E=8, Ev=6), "causal", backend)


@given(
    H_over_G=st.integers(1, 3),
    G=st.integers(1, 2),
    L=st.integers(1, 20),
    S=st.integers(1, 20),
    E=st.integers(1, 9),
    Ev=st.integers(1, 9),
    mask_kind=st.sampled_from(MASK_KINDS),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_the_reference(
    H_over_G: int, G: int, L: int, S: int, E: int, Ev: int, mask_kind: str, backend: str, seed: int
) -> None:
    _check_against_reference(Case(B=2, H=G * H_over_G, G=G, L=L, S=S, E=E, Ev=Ev), mask_kind, backend, seed)


def test_all_rows_masked_gives_zeros_and_no_nan_anywhere() -> None:
    q, k, v = Case(B=1, H=2, G=2, L=5, S=6, E=4, Ev=4).tensors()
    mask = torch.zeros(1, 1, 5, 6, dtype=torch.bool)
    for backend in BACKENDS:
        q_, k_, v_ = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, weights, lse = qkv.attention(q_, k_, v_, mask, return_weights=True, return_lse=True, backend=backend)
        out.sum().backward()
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(weights, torch.zeros_like(weights))
        assert torch.isneginf(lse).all()
        for t in (q_, k_, v_):
            assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t.grad))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend: str) -> None:
    q, k, v = (t.requires_grad_(True) for t in Case(B=1, H=2, G=1, L=4, S=5, E=3, Ev=2).tensors())
    mask = torch.tensor([[True, True, False, True, False]] * 3 + [[False] * 5])

    def fn(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q_, k_, v_, mask, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_leading_batch_dims_are_carried() -> None:
    q = torch.randn(2, 3, 4, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 2, 6, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 2, 6, 3, dtype=torch.float64)
    mask = torch.rand(3, 1, 5, 6) > 0.2  # broadcasts over the first batch dim and heads
    out = qkv.attention(q, k, v, mask)
    assert out.shape == (2, 3, 4, 5, 3)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(
                out[i, j].numpy(), qkv.attention(q[i, j], k[i, j], v[i, j], mask[j]).numpy(), atol=1e-12
            )


def test_custom_scale() -> None:
    q, k, v = Case(B=1, H=2, G=2, L=5, S=6, E=4, Ev=4).tensors()
    trace, _ = reference_forward_backward(q, k, v, None, torch.zeros(1, 2, 5, 4), scale=0.3)
    for backend in BACKENDS:
        np.testing.assert_allclose(qkv.attention(q, k, v, scale=0.3, backend=backend).numpy(), trace.output, atol=1e-12)


# PyTorch's own kernels, on the cases they support ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("L", "S"), [(16, 16), (9, 23), (23, 9)])
def test_matches_sdpa(L: int, S: int, backend: str, dtype: torch.dtype) -> None:
    q, k, v = Case(B=2, H=4, G=4, L=L, S=S, E=32, Ev=32).tensors(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-12}
    bool_mask = torch.rand(2, 1, L, S) > 0.3
    bool_mask[..., 0] = True  # SDPA returns NaN for fully masked rows; keep every row alive here
    float_mask = torch.randn(2, 4, L, S, dtype=dtype)
    cases = [
        (None, {}),
        (bool_mask, {"attn_mask": bool_mask}),
        (float_mask, {"attn_mask": float_mask}),
        # SDPA's is_causal is top-left aligned; qkv's default is bottom-right
        (qkv.masks.causal(align="top-left"), {"is_causal": True}),
        (qkv.masks.causal(), {"attn_mask": torch.ones(L, S, dtype=torch.bool).tril(S - L)}),
    ]
    for ours, theirs in cases:
        if L > S and ours is not None and not isinstance(ours, torch.Tensor) and "attn_mask" in theirs:
            continue  # bottom-right causal with L > S has empty rows, which SDPA turns into NaN
        expected = F.scaled_dot_product_attention(q, k, v, **theirs)
        torch.testing.assert_close(qkv.attention(q, k, v, ours, backend=backend), expected, **tol)


def test_gqa_matches_sdpa_enable_gqa() -> None:
    q, k, v = Case(B=2, H=8, G=2, L=11, S=13, E=16, Ev=16).tensors(torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for backend in BACKENDS:
        torch.testing.assert_close(qkv.attention(q, k, v, backend=backend), expected, atol=1e-5, rtol=1e-5)


# dropout -----------------------------------------------------------------------------------------


def test_math_dropout_output_is_made_from_the_returned_weights() -> None:
    q, k, v = Case(B=1, H=2, G=2, L=6, S=9, E=4, Ev=3).tensors()
    out, weights = qkv.attention(q, k, v, dropout=0.5, return_weights=True)
    dropped = (weights == 0).double().mean().item()
    assert 0.2 < dropped < 0.8  # about half the weights were dropped
    torch.testing.assert_close(out, weights @ v)


@pytest.mark.parametrize("backend", ["fused", "math"])
def test_dropout_is_unbiased(backend: str) -> None:
    # E[dropout(P) / (1 - p)] = P, so the mean over many draws approaches the dropout-free output
    q, k, v = Case(B=1, H=1, G=1, L=4, S=5, E=4, Ev=2).tensors()
    expected = qkv.attention(q, k, v)
    draws = torch.stack([qkv.attention(q, k, v, dropout=0.3, backend=backend) for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0), expected, atol=0.04, rtol=0.0)
    assert not torch.allclose(draws[0], draws[1])


# explain ---------------------------------------------------------------------------------------


def test_explain_names_the_path_and_counts_flops_by_hand() -> None:
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 6)
    e = qkv.explain(q, k, v)
    assert e.path == "fused"
    assert e.flops == (2 * 4 * 10 * 12) * 2 * (8 + 6)  # (B * H * L * S) * 2 * (E + Ev)
    assert qkv.explain(q, k, v, backend="math").path == "math"
    weights_with_dropout = qkv.explain(q, k, v, dropout=0.1, return_weights=True)
    assert weights_with_dropout.path == "math" and "dropout" in weights_with_dropout.reason
    text = str(qkv.explain(q, k, v, qkv.masks.causal()))
    assert "path:" in text and "GFLOP" in text


class _NoAttentionKernels(TorchDispatchMode):
    """Raises on any PyTorch op that computes scores, a softmax or attention (mask and plan
    work, comparisons and index arithmetic, stays allowed)."""

    FORBIDDEN = frozenset({
        "mm", "bmm", "addmm", "baddbmm", "matmul", "einsum", "dot", "linear",  # products
        "_softmax", "softmax", "_log_softmax", "exp", "exp_", "tanh",  # softmax and softcap
    })

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__  # "aten.bmm.default" -> "bmm"
        if op in self.FORBIDDEN or "scaled_dot_product" in op or "flex" in op:
            raise AssertionError(f"explain ran {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("mask", "kwargs", "path"),
    [
        (None, {}, "fused"),
        (None, {"backend": "math"}, "math"),
        ("window", {}, "blocks"),
        ("window", {"return_weights": True, "return_lse": True}, "blocks"),
        ("documents", {"softcap": 30.0}, "blocks"),
        ("window", {"bias": "alibi"}, "blocks"),
    ],
    ids=["dense", "math", "window", "window-weights-lse", "documents-softcap", "window-alibi"],
)
def test_explain_does_not_run_attention(mask: str | None, kwargs: dict, path: str) -> None:
    n = 2048  # big enough for the block engine on a sparse mask
    q = torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(0))
    masks = {"window": qkv.masks.sliding_window(64), "documents": qkv.masks.documents(torch.arange(n) // 300)}
    mask_object = None if mask is None else masks[mask]
    if kwargs.get("bias") == "alibi":
        kwargs = {**kwargs, "bias": qkv.bias.alibi()}
    with _NoAttentionKernels():
        explanation = qkv.explain(q, q, q, mask_object, **kwargs)
    assert explanation.path == path
    assert explanation.flops > 0
    # the guard is live: attention itself, on the same inputs, is stopped at its first kernel
    with pytest.raises(AssertionError, match="explain ran"), _NoAttentionKernels():
        qkv.attention(q, q, q, mask_object, **kwargs)


def test_a_decoding_step_builds_no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # L = 1 with bottom-right causal alignment sees the whole cache: no L x S mask is needed
    q, k, v = Case(B=2, H=4, G=2, L=1, S=50, E=8, Ev=8).tensors(torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def no_dense_mask(*args: object, **kwargs: object) -> None:
        raise AssertionError("a dense causal mask was built for a decoding step")

    monkeypatch.setattr(qkv.masks.Causal, "to_dense", no_dense_mask)
    torch.testing.assert_close(qkv.attention(q, k, v, qkv.masks.causal()), expected)
    assert "hides no key" in qkv.explain(q, k, v, qkv.masks.causal()).reason


def test_backend_flex_says_why_this_pytorch_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch 2.5 (below qkv's range, which an install may ignore) has FlexAttention, but its
    BlockMask has no sequence lengths: backend='flex' ended in a TypeError from inside
    ``from_kv_blocks``. Now a ValueError names the release it needs, before any work. The test
    gives ``from_kv_blocks`` 2.5's parameters."""
    from torch.nn.attention import flex_attention as fa

    from qkv.attention.problem import describe_problem
    from qkv.backends import flex
    from qkv.backends.protocol import BACKENDS

    if flex.flex_available():
        def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,  # type: ignore[no-untyped-def]
                           BLOCK_SIZE=128, mask_mod=None):
            raise AssertionError("qkv built a BlockMask after saying this PyTorch cannot take it")

        monkeypatch.setattr(fa.BlockMask, "from_kv_blocks", classmethod(from_kv_blocks))
    assert not flex.flex_available()
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match=r"^backend='flex': .*seq_lengths.*\(PyTorch >= 2\.6\); use backend='blocks' or 'auto'$"):
        qkv.attention(q, q, q, qkv.masks.causal(), backend="flex")
    words = BACKENDS["flex"].describe(describe_problem(q, q, q, qkv.masks.causal(), None, 0.0))
    assert words.endswith("(it does not run: " + flex.FLEX_NEEDS + ")")
    # 'auto' keeps to its other paths, with and without gradients
    out = qkv.attention(q, q, q, qkv.masks.causal())
    expected = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_backend_flex_on_a_cpu_without_avx2_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's CPU FlexAttention kernel needs AVX2 vector code (PyTorch refuses it where its
    CPU capability is DEFAULT): backend='flex' says so before any work instead of failing in a
    compile, and 'auto' keeps to its other paths."""
    import dataclasses

    from qkv.attention.problem import describe_problem
    from qkv.backends import flex
    from qkv.backends.protocol import BACKENDS

    plain = dataclasses.replace(flex.cpu_features(), capability="DEFAULT")
    monkeypatch.setattr(flex, "cpu_features", lambda: plain)
    monkeypatch.setattr(flex, "_compiled_flex", lambda: pytest.fail("qkv compiled FlexAttention after saying it cannot run"))
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match=r"^backend='flex' on the CPU runs Inductor's FlexAttention kernel: .*needs AVX2 vector code; "
                                         r"PyTorch's CPU capability is DEFAULT; use backend='blocks' or 'auto'$"):
        qkv.attention(q, q, q, qkv.masks.causal(), backend="flex")
    assert "needs AVX2" in BACKENDS["flex"].describe(describe_problem(q, q, q, qkv.masks.causal(), None, 0.0))
    torch.testing.assert_close(qkv.attention(q, q, q, qkv.masks.causal()), F.scaled_dot_product_attention(q, q, q, is_causal=True))


@pytest.mark.parametrize("name", ["no mask", "causal", "sliding window"])
def test_torch_compile_with_graph_breaks_allowed_traces_on_every_supported_release(name: str) -> None:
    """torch.compile's default (graph breaks allowed) follows qkv.attention on every PyTorch
    that qkv installs with, forward and backward: on the oldest releases Dynamo breaks the
    graph where it cannot follow qkv's Python, and must never fail there (PyTorch 2.6 has no
    ``torch.compiler.is_exporting``). One graph is checked by tests/test_compile_modes.py.
    Expected: PyTorch's SDPA with the same mask written out."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 200, 16, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 200, 16, generator=gen)
    position = torch.arange(200)
    seen = position[None, :] <= position[:, None]  # (L, S) causal
    mask, dense = {
        "no mask": (None, None),
        "causal": (qkv.masks.causal(), seen),
        "sliding window": (qkv.masks.sliding_window(32), seen & (position[None, :] >= position[:, None] - 32)),
    }[name]
    torch._dynamo.reset()
    try:
        out = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask), backend="eager")(q, k, v)
        got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    finally:
        torch._dynamo.reset()
    expected_out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    expected = (expected_out, *torch.autograd.grad(expected_out, (q, k, v), grad))
    for result, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(result, reference, rtol=1e-4, atol=1e-5)
