"""The fused bf16 interval backward kernel (`qkv.native.interval_bf16_backward`) and its fallback.

Every gradient goes through the whole engine (`qkv.attention(..., backend="blocks")` and
autograd), against the float64 reference by docs/design.md's tolerance rule (`assert_by_the_rule`:
within 3x the error of a naive bf16 implementation). A spy counts the kernel's calls, so a
test fails if the kernel silently stops running on a machine that can run it; on a machine
that cannot (no AVX-512 BF16, no compiler), the same tests check the engine's other backward and
that a reason is given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.native import build as compiled
from qkv.native import interval_bf16_backward
from tests.kernels._compiler import REASON as FAILED_BUILD
from tests.kernels._compiler import forget_builds, use_failing_compiler
from tests.kernels._spy import CallSpy
from tests.kernels.test_blocks import _problem, _reference
from tests.kernels.test_blocks_bf16 import DTYPE, FLOOR, _err, _naive, assert_by_the_rule
from tests.kernels.test_interval_bf16 import _ids

CPU = torch.device("cpu")


def _can_run() -> bool:
    return interval_bf16_backward.unavailable_reason(DTYPE, CPU) is None


def _spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    """Counts the kernel's calls that returned a result."""
    return CallSpy(monkeypatch, interval_bf16_backward, "backward")


# (N, H, G, L, S, E, Ev, mask): awkward sizes, every mask kind with row intervals
CASES = {
    "window-97x1025": (1, 2, 2, 97, 1025, 64, 64, lambda: M.sliding_window(256, 256)),
    "window-1025x97-E59": (1, 2, 2, 1025, 97, 59, 59, lambda: M.sliding_window(30, 5)),
    "causal-300-E128-Ev64-gqa": (2, 2, 1, 300, 300, 128, 64, lambda: M.causal()),
    "causal-one-query": (1, 4, 2, 1, 700, 64, 64, lambda: M.causal()),
    "gqa-6-2-window-E64-Ev128": (1, 6, 2, 200, 200, 64, 128, lambda: M.sliding_window(40, 0)),
    "documents&causal": (1, 2, 2, 260, 260, 32, 32, lambda: M.documents(_ids([1, 100, 64, 95])) & M.causal()),
    "key-padding-empty-rows": (2, 2, 2, 70, 150, 64, 40, lambda: M.key_padding(torch.tensor([0, 77]))),
    "prefix&window-no-keys-for-some": (1, 1, 1, 130, 130, 64, 64, lambda: M.prefix_lm(3) & M.sliding_window(0, 5)),
    "varlen-causal": (1, 2, 2, 190, 190, 32, 48, lambda: M.varlen(torch.tensor([70, 1, 119]), causal=True)),
    "no-mask": (1, 2, 2, 65, 129, 64, 64, lambda: None),
}


@pytest.mark.parametrize("case", CASES)
def test_gradients_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    N, H, G, L, S, E, Ev, make = CASES[case]
    q, k, v, d_out = _problem(N, H, G, L, S, E, Ev, seed=7)
    mask = make()
    dense_mask = mask if mask is not None else M.dense(torch.ones(1, 1, L, S, dtype=torch.bool))
    scale = E**-0.5
    trace, ref_grads = _reference(q, k, v, dense_mask, d_out, scale)
    spy = _spy(monkeypatch)
    results = {}
    for name, fn in {
        "blocks": lambda a, b, c: qkv.attention(a, b, c, mask, backend="blocks", scale=scale),
        "naive": lambda a, b, c: _naive(a, b, c, dense_mask.to_dense(L, S), scale),
    }.items():
        ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
        out = fn(ql, kl, vl)
        results[name] = out, torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert_by_the_rule(*results["blocks"], *results["naive"], trace.output, ref_grads)
    assert spy.calls == (1 if _can_run() else 0)


def test_the_lse_gradient_by_the_tolerance_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    # a loss that reads lse: its gradient enters the kernel's row term D = rowsum(dO * O) - dlse
    N, H, L, S, E = 1, 2, 150, 230, 64
    q, k, v, d_out = _problem(N, H, H, L, S, E, E, seed=8)
    d_lse = torch.randn(N, H, L, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    mask = M.sliding_window(60, 90)
    scale = 0.125
    trace, ref_grads = _reference(q, k, v, mask, d_out, scale, d_lse)
    spy = _spy(monkeypatch)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    out, lse = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=scale, return_lse=True)
    grads = torch.autograd.grad((out, lse), (ql, kl, vl), (d_out.to(DTYPE), d_lse.float()))
    assert spy.calls == (1 if _can_run() else 0)
    nl, nk, nv = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    scores = (nl @ nk.transpose(-1, -2) * scale).masked_fill(~mask.to_dense(L, S), float("-inf"))
    naive_out, naive_lse = torch.softmax(scores, dim=-1) @ nv, torch.logsumexp(scores, dim=-1)
    naive_grads = torch.autograd.grad((naive_out, naive_lse), (nl, nk, nv), (d_out.to(DTYPE), d_lse.to(DTYPE)))
    assert_by_the_rule(out, grads, naive_out, naive_grads, trace.output, ref_grads)


def test_extreme_scores_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # scores of magnitude ~ 10^3 after scaling: P = exp(s - lse) must stay within [0, 1]
    L = S = 300
    q, k, v, d_out = _problem(1, 2, 2, L, S, 64, 64, seed=9)
    q, k = q * 12, k * 12
    mask = M.sliding_window(70, 70)
    trace, ref_grads = _reference(q, k, v, mask, d_out, 0.125)
    naive_in = [t.to(DTYPE).requires_grad_(True) for t in (q, k, v)]
    naive = _naive(*naive_in, mask.to_dense(L, S), 0.125)
    naive_grads = torch.autograd.grad(naive, naive_in, d_out.to(DTYPE))
    spy = _spy(monkeypatch)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=0.125)
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert all(torch.isfinite(g).all() for g in grads)
    assert_by_the_rule(out, grads, naive, naive_grads, trace.output, ref_grads)
    assert spy.calls == (1 if _can_run() else 0)


def test_empty_rows_and_unseen_keys_get_zero_gradients() -> None:
    # batch row 0 sees no key at all; in row 1 keys 77.. are padding, and with L > S the window
    # (bottom-right aligned: query i sits at position i - 60) leaves queries 0..59 and 142..
    # without a key
    N, H, L, S, E = 2, 2, 150, 90, 64
    q, k, v, d_out = _problem(N, H, H, L, S, E, E, seed=10)
    mask = M.key_padding(torch.tensor([0, 77])) & M.sliding_window(5, 0)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(ql, kl, vl, mask, backend="blocks")
    dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert not any(torch.isnan(g).any() for g in (dq, dk, dv))
    assert bool((dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all())
    assert bool((dk[1, :, 77:] == 0).all() and (dv[1, :, 77:] == 0).all())
    assert bool((dq[1, :, :60] == 0).all() and (dq[1, :, 142:] == 0).all())
    # queries 60 and 141 see one key each (0, 76): a softmax of one score has no gradient
    # (here only rounding, P = 1 and dP = D up to float32 sums in different orders)
    assert float(dq[1, :, [60, 141]].abs().max()) < 1e-3 * float(dq[1].abs().max())
    assert bool((dq[1, :, 61:141] != 0).any(dim=-1).all())


def test_two_runs_are_bitwise_equal() -> None:
    # the compiled kernel: one task per (batch row, head), each gradient element written by one
    # thread in a fixed order, so the same inputs give the same bits whatever the thread count.
    # Without it (no AVX-512 BF16, or switched off) the fallback promises the same bits at the same
    # thread count only: PyTorch's flash backward and matrix products split work by threads.
    q, k, v, d_out = _problem(2, 4, 2, 333, 400, 64, 64, seed=12)
    mask = M.sliding_window(100, 50)
    threads = torch.get_num_threads()
    counts = (2, 2, 1) if _can_run() else (2, 2)
    runs = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
            out = qkv.attention(ql, kl, vl, mask, backend="blocks")
            runs.append(torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE)))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_fallback_gives_gradients_by_the_same_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    L = S = 400
    q, k, v, d_out = _problem(1, 2, 2, L, S, 64, 64, seed=13)
    mask = M.sliding_window(100, 100)
    trace, ref_grads = _reference(q, k, v, mask, d_out, 0.125)
    naive_in = [t.to(DTYPE).requires_grad_(True) for t in (q, k, v)]
    naive = _naive(*naive_in, mask.to_dense(L, S), 0.125)
    naive_grads = torch.autograd.grad(naive, naive_in, d_out.to(DTYPE))
    grads = {}
    for enabled in (True, False):
        spy = _spy(monkeypatch)
        ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
        with qkv.backends.disabled(*(() if enabled else ("interval_bf16_backward",))):
            out = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=0.125)
        # the Plan made inside the block decides the backward, wherever it runs
        grads[enabled] = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
        assert spy.calls == (1 if enabled and _can_run() else 0)
        assert_by_the_rule(out, grads[enabled], naive, naive_grads, trace.output, ref_grads)
    with qkv.backends.disabled("interval_bf16_backward"):
        # the engine's own fallback, as run above ('auto' may estimate SDPA faster at this size
        # where the forward kernel cannot run either)
        explained = qkv.explain(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), mask, backend="blocks")
    assert 'switched off (qkv.backends.disabled("interval_bf16_backward"))' in explained.backward_kernel
    for fused, other in zip(grads[True], grads[False], strict=True):  # two bf16 answers of one problem
        assert _err(fused, other.double().numpy()) < 4 * FLOOR + 0.05


def test_explain_names_the_backward_kernel_or_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 2, 3000, 64).to(DTYPE)
    mask = M.sliding_window(100, 100)
    text = str(qkv.explain(q, q, q, mask))
    if _can_run():
        assert f"backward kernel: the {interval_bf16_backward.KERNEL_NAME}" in text
    else:
        assert "backward kernel: the engine's backward per call" in text
    assert text.index("forward kernel:") < text.index("backward kernel:")
    assert qkv.explain(q.float(), q.float(), q.float(), mask).backward_kernel == ""  # float32: nothing to say
    per_head = M.predicate(lambda b, h, i, j: (i - j).abs() < 50, heads=2)
    with monkeypatch.context() as able:  # as on a machine that could run it (explain builds nothing)
        able.setattr(compiled, "static_reason", lambda *args, **kwargs: None)
        assert "one key interval per query" in qkv.explain(q, q, q, per_head, backend="blocks").backward_kernel
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)  # its own reason would come first
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")  # as on an AVX2 machine, whatever this one is
    assert "this CPU's tier is avx2" in qkv.explain(q, q, q, mask).backward_kernel


def test_no_compiled_kernels_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert interval_bf16_backward.unavailable_reason(DTYPE, CPU) == "QKV_NO_COMPILED_KERNELS is set"
    x = torch.randn(1, 1, 64, 32).to(DTYPE)
    rows = torch.zeros(1, 64, dtype=torch.long)
    assert interval_bf16_backward.backward(x, x, x, x, x.float(), torch.zeros(1, 1, 64), rows, rows, 1.0) is None


def test_a_failed_build_is_a_reason_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_failing_compiler(monkeypatch, tmp_path)
    forget_builds(monkeypatch, interval_bf16_backward)
    monkeypatch.setattr(compiled, "static_reason", lambda *args, **kwargs: None)  # as on a machine that could run it
    L = S = 300
    q, k, v, d_out = _problem(1, 2, 2, L, S, 64, 64, seed=4)
    mask = M.sliding_window(64, 64)
    _, ref_grads = _reference(q, k, v, mask, d_out, 0.125)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=0.125)
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))  # the engine's other backward
    for got, want in zip(grads, ref_grads, strict=True):
        assert _err(got, want) < 0.1
    reason = interval_bf16_backward.unavailable_reason(DTYPE, CPU)
    assert reason == FAILED_BUILD
    assert reason in qkv.explain(q.to(DTYPE), k.to(DTYPE), v.to(DTYPE), mask, backend="blocks").backward_kernel


def test_the_kernel_builds_where_nothing_is_missing() -> None:
    # on a machine with AVX-512 BF16 (tier avx512 or amx) and a compiler the kernel must build and
    # pass its self-check (float64 autograd): otherwise every test above would quietly test the fallback
    static = compiled.interval_reason(DTYPE, CPU)
    if static is not None:
        assert interval_bf16_backward.unavailable_reason(DTYPE, CPU) == static
        return
    L = S = 64
    q, k, v, d_out = (t.to(DTYPE) for t in _problem(1, 1, 1, L, S, 32, 32, seed=14))
    lo, hi = torch.zeros(1, L, dtype=torch.long), torch.arange(L).view(1, L)  # causal
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2)).masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    out64, lse64 = torch.softmax(scores, dim=-1) @ v64, torch.logsumexp(scores, dim=-1)
    want = torch.autograd.grad(out64, (q64, k64, v64), d_out.double())
    result = interval_bf16_backward.backward(d_out, q, k, v, out64.detach().float(), lse64.detach().float(), lo, hi, 1.0)
    assert interval_bf16_backward.unavailable_reason(DTYPE, CPU) is None
    assert result is not None
    assert result[0].shape == (1, 1, L, 32) and result[1].shape == result[2].shape == (1, 1, S, 32)
    for got, w in zip(result, want, strict=True):  # bf16 results of float32 sums: a few bf16 ulps
        assert float((got.double() - w).abs().max()) < 2e-2 * float(w.abs().max())
