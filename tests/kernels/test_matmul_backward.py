"""The bf16 matrix-product backward of the block engine (`qkv.backends.blocks.matmul_backward`).

Expected values come from the float64 reference (`qkv.reference` through the engine tests'
helpers, or float64 autograd of the formula), never from the kernel itself. The bar is
docs/design.md's tolerance rule: gradient error at most 3x that of a naive implementation computed
entirely in bfloat16, plus a floor of 1e-3.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.backends.blocks import matmul_backward
from qkv.backends.blocks.matmul_backward import call_gradients, suits
from tests.kernels.test_blocks import MASKS, _problem, _reference
from tests.kernels.test_blocks_bf16 import _err, _naive, assert_by_the_rule

DTYPE = torch.bfloat16
FLOOR = 1e-3  # the floor of tests/kernels/test_blocks_bf16.py


def _grads(fn, q, k, v, d_out, dtype):  # type: ignore[no-untyped-def]
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, d_out.to(dtype))


@pytest.fixture(autouse=True)
def _any_thread_count(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The suite may run on several threads; these tests are about the products, not that bound,
    nor the fused bf16 backward kernel that interval plans take where it builds
    (tests/kernels/test_interval_bf16_backward.py)."""
    monkeypatch.setattr(matmul_backward, "MAX_THREADS", 1 << 20)
    with qkv.backends.disabled("interval_bf16_backward"):
        yield


class _Spy:
    """Counts the engine calls that take the matrix-product backward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = call_gradients

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr("qkv.backends.blocks.engine.call_gradients", counted)


def test_one_call_against_float64_autograd() -> None:
    # 3 items of 2 heads with a mask per item and head, computed one head of one item at a
    # time (a tiny budget); rows 0 and 5 of item 1 see no key: exact zero gradients there
    gen = torch.Generator().manual_seed(0)
    items, H, q_len, width, D, scale = 3, 2, 7, 11, 5, 0.7
    q, k, v, d_out = (torch.randn(items, H, n, D, generator=gen, dtype=torch.float64)
                      for n in (q_len, width, width, q_len))
    visible = torch.rand(items, H, q_len, width, generator=gen) > 0.5
    visible[1, :, [0, 5]] = False
    bias = torch.zeros(items, H, q_len, width).masked_fill(~visible, float("-inf"))
    empty = ~visible.any(-1)  # (items, H, q_len)
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), visible.numpy(), scale)
    want = R.attention_grads(trace, d_out.numpy())
    # the naive bf16 comparator: empty rows see every key and pass no output gradient, which
    # gives them the reference's zero gradients without a NaN softmax
    seen = visible | empty.unsqueeze(-1)
    kept = d_out * (~empty).unsqueeze(-1)

    def formula(a, b, c):  # type: ignore[no-untyped-def]
        return torch.softmax((scale * a @ b.transpose(-1, -2)).masked_fill(~seen, float("-inf")), -1) @ c

    _, naive = _grads(formula, q, k, v, kept, DTYPE)
    b16 = [t.to(DTYPE) for t in (d_out, q, k, v)]
    got = call_gradients(*b16, bias.to(DTYPE), empty, scale, budget=2 * H * q_len * width)  # chunks of 1 item
    for g, n, w in zip(got, naive, want, strict=True):
        assert g.shape == w.shape and not torch.isnan(g).any()
        assert _err(g, w) <= 3 * _err(n, w) + FLOOR
    assert torch.equal(got[0][1, :, [0, 5]], torch.zeros(H, 2, D))  # dq of the empty rows


# awkward sizes: a single query, L != S both ways, a long odd key length, head dim 59, GQA
SHAPES = {
    "one-query": (2, 4, 2, 1, 97, 16),
    "97x1025-E59": (1, 2, 1, 97, 1025, 59),
    "1025x97": (1, 4, 4, 1025, 97, 8),
    "gqa-200": (2, 6, 2, 200, 200, 32),
}
SHAPE_MASKS = {
    "none": lambda N, S: None,
    "causal": lambda N, S: M.causal(),
    "window": lambda N, S: M.sliding_window(40, 9),
    "key-padding": MASKS["key-padding"],  # batch row 0 has no visible key at all
    "documents": lambda N, S: M.documents(torch.arange(S) // 45),
    "predicate-per-head": MASKS["predicate-per-head"],
}


# pairs whose plans have calls that take this backward (rows whose keys fit in one piece)
CASES = [
    ("one-query", "none"), ("one-query", "window"), ("one-query", "key-padding"), ("one-query", "documents"),
    ("97x1025-E59", "none"), ("97x1025-E59", "window"), ("97x1025-E59", "documents"),
    ("1025x97", "causal"), ("1025x97", "predicate-per-head"), ("1025x97", "documents"),
    ("gqa-200", "causal"), ("gqa-200", "window"), ("gqa-200", "key-padding"), ("gqa-200", "predicate-per-head"),
]


@pytest.mark.parametrize(("shape", "kind"), CASES)
def test_engine_backward_by_the_tolerance_rule(shape: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    N, H, G, L, S, E = SHAPES[shape]
    if kind == "predicate-per-head" and H != 4:
        H, G = 4, 2
    if kind == "documents" and L > S:
        L, S = S, L  # documents(ids) needs L <= S
    mask = SHAPE_MASKS[kind](N, S)
    q, k, v, d_out = _problem(N, H, G, L, S, E, E, seed=7)
    scale = E**-0.5
    dense = torch.ones(L, S, dtype=torch.bool) if mask is None else mask.to_dense(L, S)
    trace, ref_grads = _reference(q, k, v, M.dense(dense) if mask is None else mask, d_out, scale)
    spy = _Spy(monkeypatch)
    out, grads = _grads(lambda a, b, c: qkv.attention(a, b, c, mask, backend="blocks", scale=scale), q, k, v, d_out, DTYPE)
    naive_out, naive_grads = _grads(lambda a, b, c: _naive(a, b, c, dense, scale), q, k, v, d_out, DTYPE)
    # the case reaches the matrix-product backward; a causal mask's rows are causal squares,
    # which stay on the flash kernel (its is_causal needs no q_len x q_len tile)
    assert spy.calls > 0 or kind == "causal"
    assert_by_the_rule(out, grads, naive_out, naive_grads, trace.output, ref_grads)


def test_rows_without_keys_get_zero_gradients() -> None:
    q, k, v, d_out = _problem(2, 2, 2, 50, 60, 8, 8, seed=2)
    mask = M.key_padding(torch.tensor([0, 60]))  # batch row 0 sees nothing
    _, grads = _grads(lambda a, b, c: qkv.attention(a, b, c, mask, backend="blocks"), q, k, v, d_out, DTYPE)
    for g in grads:
        assert torch.equal(g[0].float(), torch.zeros_like(g[0].float()))
        assert g[1].abs().sum() > 0


def test_the_backward_is_deterministic() -> None:
    q, k, v, d_out = _problem(1, 2, 1, 600, 600, 64, 64, seed=4)
    mask = M.sliding_window(150, 150)
    runs = [_grads(lambda a, b, c: qkv.attention(a, b, c, mask), q, k, v, d_out, DTYPE)[1] for _ in range(2)]
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_which_calls_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert suits(torch.bfloat16, merge=False, lse_gradient=False)
    assert not suits(torch.bfloat16, merge=True, lse_gradient=False)  # the piece lacks keys of its rows
    assert not suits(torch.bfloat16, merge=False, lse_gradient=True)
    assert not suits(torch.float32, merge=False, lse_gradient=False)
    assert torch.float16 not in matmul_backward.MATMUL_BACKWARD_DTYPES
    monkeypatch.setattr(matmul_backward, "MAX_THREADS", torch.get_num_threads() - 1)
    assert not suits(torch.bfloat16, merge=False, lse_gradient=False)  # more threads than the bound
