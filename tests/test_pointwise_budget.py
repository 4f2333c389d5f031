"""Predicate masks are evaluated point by point; at huge sizes neither `explain` nor `draw`
waits for that (issue 11), and the deferred plan still computes exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
import qkv.masks
from qkv import reference
from qkv.attention import dispatch


def _counting_window(calls: list[int], width: int = 40):
    def near(b, h, q, k):
        calls.append(1)
        return (q - k).abs() <= width

    return near


def _never_called(b, h, q, k):
    raise AssertionError("the predicate was evaluated")


def test_explain_at_100k_tokens_does_not_evaluate_the_predicate():
    mask = qkv.masks.predicate(_never_called)
    q = torch.randn(1, 2, 100_000, 4)
    for backend in ("auto", "blocks"):
        e = qkv.explain(q, q, q, mask, backend=backend)
        assert e.path == "blocks"
        assert e.upper_bound
        assert "10,000,000,000 points" in e.reason
        assert e.tiles is not None and e.tiles.startswith("not evaluated")
        assert e.flops == 4 * 2 * 100_000 * 100_000 * 4  # every pair: an upper bound
        assert "at most" in str(e)


def test_draw_refuses_a_predicate_beyond_the_budget_before_evaluating_it():
    mask = qkv.masks.predicate(_never_called) & qkv.masks.causal()
    with pytest.raises(ValueError, match=r"100000 x 100000 evaluates its function at 10,000,000,000 points"):
        mask.draw(100_000, 100_000)
    # structured masks are drawn from their structure at any size
    assert qkv.masks.causal().draw(100_000, 100_000).count("\n") > 10


def test_draw_within_the_budget_still_evaluates_every_point():
    calls: list[int] = []
    drawing = qkv.masks.predicate(_counting_window(calls, width=1)).draw(6, 6)
    assert calls
    rows = [line.split()[1] for line in drawing.splitlines()[2:8]]
    expected = ["".join("\u2588" if abs(i - j) <= 1 else "\u00b7" for j in range(6)) for i in range(6)]
    assert rows == expected


@pytest.mark.parametrize("backend", ["auto", "blocks"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_a_deferred_plan_equals_the_reference(monkeypatch, backend, softcap):
    # a small budget makes a 300 x 290 predicate "huge": the engine then finds its tiles at run time
    monkeypatch.setattr(dispatch, "POINTWISE_BUDGET", 1000)
    torch.manual_seed(0)
    L, S, E = 300, 290, 8
    q = torch.randn(1, 2, L, E, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, S, E, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, S, E, dtype=torch.float64, requires_grad=True)
    mask = qkv.masks.predicate(lambda b, h, qi, kj: ((qi + kj) % 7 != 0) & ((qi - kj).abs() < 50))
    assert qkv.explain(q, k, v, mask, softcap=softcap, backend=backend).upper_bound
    out = qkv.attention(q, k, v, mask, softcap=softcap, backend=backend)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))

    allowed = mask.to_dense(L, S)[0, 0]
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / E**0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    expected = weights @ vd
    expected_grads = torch.autograd.grad((expected * expected).sum(), (qd, kd, vd))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if softcap is None:  # and the float64 NumPy reference agrees on the forward pass
        head = [t[0, 0].detach().numpy() for t in (q, k, v)]
        trace = reference.attention(*head, mask=allowed.numpy())
        np.testing.assert_allclose(out[0, 0].detach().numpy(), trace.output, rtol=1e-10, atol=1e-10)
