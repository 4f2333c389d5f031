"""Score terms on the fused bf16 interval kernels (`qkv.native.interval_bf16` and its backward).

With a softcap and a bias that depends on the head and the distance to the key only (ALiBi,
relative buckets; `qkv.backends.blocks.diagonals`), and no score_mod, a bf16 call on the
block engine runs the fused kernels, which apply the terms before their softmax: each score
becomes cap * tanh(scale q.k / cap) + bias, and the backward multiplies dS by the cap's slope
1 - tanh^2. The expected values are the float64 NumPy reference (`qkv.reference`, which
applies the softcap and a dense bias in its own code) and its gradients; the bf16 results
must be within the tolerance rule of docs/design.md against the naive bf16 formula. Spies
count the kernels' calls, so a test fails if they stop running where they can; where they
cannot, the same tests check the scored engine that stands in for them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.attention.dispatch import BLOCKS
from qkv.backends.blocks.diagonals import diagonal_table
from qkv.backends.blocks.engine import block_attention
from qkv.backends.blocks.planner import BlockSizes, plan_intervals
from qkv.bias import Bias
from qkv.native import interval_bf16, interval_bf16_backward
from qkv.scores import ScoreTerms
from tests.kernels._spy import CallSpy
from tests.kernels.test_blocks import _problem
from tests.kernels.test_blocks_bf16 import DTYPE, _err, assert_by_the_rule

CPU = torch.device("cpu")
FUSED = ("interval_bf16", "interval_bf16_backward")


def _scored(kernels: tuple[str, str]) -> bool:
    """Whether the plan's kernels are the scored engine's (a bias alone on the flash kernel's tiles)."""
    return kernels[0] in ("score_tiles", "bias_tiles") and kernels[1] == "scored_per_call"


def _can_run() -> bool:
    return interval_bf16.unavailable_reason(DTYPE, CPU) is None and interval_bf16_backward.unavailable_reason(DTYPE, CPU) is None


def _dense_bias(bias: Bias | None, H: int, L: int, S: int) -> torch.Tensor:
    """The bias (1, H, L, S) float64 with bottom-right positions (zeros without one)."""
    if bias is None:
        return torch.zeros(1, 1, L, S, dtype=torch.float64)
    return bias.to_dense(L, S, H=H, dtype=torch.float64)


def _naive(q, k, v, dense: torch.Tensor, scale: float, softcap: float | None, bias: torch.Tensor):  # type: ignore[no-untyped-def]
    """The formula with the terms, every op in q's dtype; GQA by repeating kv heads."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = (scores + bias.to(q.dtype)).masked_fill(~dense, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0) @ v


def _reference(q, k, v, dense: torch.Tensor, d_out, scale: float, softcap: float | None, bias: torch.Tensor):  # type: ignore[no-untyped-def]
    trace = R.attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), dense.numpy(), scale, softcap=softcap, bias=bias.numpy()
    )
    return trace, R.attention_grads(trace, d_out.numpy())


def _relative(H: int, seed: int) -> Bias:
    return qkv.bias.relative(torch.randn(H, 32, generator=torch.Generator().manual_seed(seed)))


# (N, H, G, L, S, E, Ev, mask, q scaled by, scale sign, softcap, bias): awkward sizes, caps that
# bend scores of about +-3 (0.7), saturate scores of about +-90 (5), leave them as they are
# (3e38: scale / cap is a float32 denormal) or flatten them to +-1e-3, and biases by diagonal
CASES = {
    "window-1025x97-E59-bent": (1, 2, 2, 1025, 97, 59, 59, M.sliding_window(30, 5), 1.0, 1.0, 0.7, None),
    "causal-300-E128-Ev64-negative-scale": (2, 2, 1, 300, 300, 128, 64, M.causal(), 1.0, -1.0, 0.7, None),
    "gqa-6-2-window-saturated": (1, 6, 2, 200, 200, 64, 128, M.sliding_window(40, 0), 30.0, 1.0, 5.0, None),
    "key-padding-empty-rows": (2, 2, 2, 70, 150, 64, 40, M.key_padding(torch.tensor([0, 77])), 1.0, 1.0, 2.0, None),
    "no-mask-long-span-online-huge-cap": (1, 1, 1, 70, 2100, 64, 48, None, 1.0, 1.0, 3e38, None),
    "causal-long-diagonals-tiny-cap": (1, 1, 1, 1300, 1300, 96, 96, M.causal(), 1.0, 1.0, 1e-3, None),
    "alibi-gqa-6-2-causal": (1, 6, 2, 300, 300, 64, 64, M.causal(), 1.0, 1.0, None, qkv.bias.alibi()),
    "alibi-softcap-window-1025x97-E59": (1, 2, 2, 1025, 97, 59, 59, M.sliding_window(30, 5), 1.0, 1.0, 0.7, qkv.bias.alibi()),
    "relative-window-L<S-negative-scale": (2, 4, 4, 200, 333, 64, 64, M.sliding_window(40, 40), 1.0, -1.0, None, _relative(4, 1)),
    # documents start mid-group: positions still consecutive, rows of other documents hidden
    "alibi+relative-varlen": (1, 4, 4, 500, 500, 64, 64, M.varlen([100, 37, 300, 63], causal=True), 1.0, 1.0, None,
                              qkv.bias.alibi() + _relative(4, 2)),
    "alibi-no-mask-long-span-online": (1, 2, 2, 70, 2100, 64, 48, None, 1.0, 1.0, None, qkv.bias.alibi()),
}


@pytest.mark.parametrize("case", CASES)
def test_terms_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    N, H, G, L, S, E, Ev, mask, size, sign, softcap, bias = CASES[case]
    q, k, v, d_out = _problem(N, H, G, L, S, E, Ev, seed=7)
    q = q * size
    dense = (mask if mask is not None else M.dense(torch.ones(1, 1, L, S, dtype=torch.bool))).to_dense(L, S)
    dense_bias = _dense_bias(bias, H, L, S)
    scale = sign * E**-0.5
    ql, kl, vl = (t.to(DTYPE) for t in (q, k, v))
    # against the bf16-rounded inputs: the kernels' own error, not the inputs' rounding
    trace, ref_grads = _reference(ql, kl, vl, dense, d_out, scale, softcap, dense_bias)
    forward, backward = CallSpy(monkeypatch, interval_bf16, "forward"), CallSpy(monkeypatch, interval_bf16_backward, "backward")
    results = {}
    for name, fn in {
        "blocks": lambda a, b, c: qkv.attention(a, b, c, mask, backend="blocks", scale=scale, softcap=softcap, bias=bias),
        "naive": lambda a, b, c: _naive(a, b, c, dense, scale, softcap, dense_bias),
    }.items():
        leaves = tuple(t.clone().requires_grad_(True) for t in (ql, kl, vl))
        out = fn(*leaves)
        results[name] = out, torch.autograd.grad(out, leaves, d_out.to(DTYPE))
    assert_by_the_rule(*results["blocks"], *results["naive"], trace.output, ref_grads)
    assert (forward.calls, backward.calls) == ((1, 1) if _can_run() else (0, 0))


def test_softcap_lse_matches_float64() -> None:
    # the lse of capped scores: float32 rounding alone, and -inf for a row that sees nothing
    N, H, L, S, E = 1, 2, 300, 300, 64
    q, k, v, _ = _problem(N, H, H, L, S, E, E, seed=8)
    q, k, v = (t.to(DTYPE) for t in (q * 4, k, v))
    mask = M.sliding_window(20, 0) & M.key_padding(torch.tensor([250]))
    with torch.no_grad():
        out, lse = qkv.attention(q, k, v, mask, backend="blocks", softcap=1.5, return_lse=True)
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask.to_dense(L, S).numpy(), E**-0.5, softcap=1.5)
    assert np.array_equal(np.isneginf(lse.numpy()), np.isneginf(trace.lse))
    assert np.isneginf(trace.lse).any()  # rows past the padding see no key
    finite = np.isfinite(trace.lse)
    assert np.abs(lse.double().numpy()[finite] - trace.lse[finite]).max() < 1e-4
    assert _err(out, trace.output) < 1e-2


def test_the_plan_names_the_fused_kernels_for_terms_they_apply() -> None:
    q = torch.randn(1, 4, 3000, 64).to(DTYPE).requires_grad_(True)
    mask = M.sliding_window(100, 100)
    for terms in ({"softcap": 30.0}, {"bias": qkv.bias.alibi()}, {"softcap": 30.0, "bias": qkv.bias.alibi() + _relative(4, 3)}):
        explained = qkv.explain(q, q, q, mask, **terms)
        assert explained.kernels == FUSED if _can_run() else _scored(explained.kernels), terms
        if _can_run():
            assert explained.forward_kernel.startswith(f"the {interval_bf16.KERNEL_NAME}")
            assert "the score terms are applied inside the fused kernel" in str(explained)
    # terms they do not apply: a score_mod, a bias that is not by diagonal, one that learns
    # (under gradients), one whose entries reach 2^14 or hide pairs (the scored engine keeps
    # the lse in two parts there)
    slopes = torch.full((4,), 0.5, requires_grad=True)
    others = (
        {"score_mod": lambda s, b, h, i, j: s * 0.5}, {"bias": qkv.bias.dense(torch.randn(1, 1, 3000, 3000))},
        {"bias": qkv.bias.alibi(slopes)}, {"bias": qkv.bias.relative(torch.full((4, 32), -2.0**14))},
        {"bias": qkv.bias.relative(torch.full((4, 32), float("-inf")))},
    )  # fmt: skip
    for terms in others:
        assert _scored(qkv.explain(q, q, q, mask, **terms).kernels), terms
    with torch.no_grad():  # no gradient: learnable slopes are only read
        read_only = qkv.explain(q, q, q, mask, bias=qkv.bias.alibi(slopes)).kernels
    assert read_only[0] == "interval_bf16" if _can_run() else _scored(read_only)
    # switched off: the scored engine
    with qkv.backends.disabled("interval_bf16"):
        assert _scored(qkv.explain(q, q, q, mask, softcap=30.0).kernels)
    # no gradient wanted: the forward kernel alone decides
    with qkv.backends.disabled("interval_bf16_backward"):
        inference = qkv.explain(q.detach(), q.detach(), q.detach(), mask, softcap=30.0).kernels
        training = qkv.explain(q, q, q, mask, softcap=30.0).kernels
    assert inference[0] == "interval_bf16" if _can_run() else _scored(inference)
    assert _scored(training)


def test_the_diagonal_table_holds_the_bias_of_every_pair() -> None:
    # entry p_i - j + offset of head h is the bias of (h, i, j) for every pair: ALiBi plus
    # relative buckets against `Bias.to_dense` (bottom-right positions, checked in test_bias)
    H, L, S = 3, 45, 70
    bias = (qkv.bias.alibi() + qkv.bias.relative(torch.randn(H, 16), num_buckets=16, max_distance=20)).bind((1,), H, L, S)
    every_key = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1))  # (1, L) each
    table = diagonal_table(ScoreTerms(L, S, bias=bias), H, every_key)
    assert table is not None
    entry = table.positions[0].view(L, 1) - torch.arange(S).view(1, S) + table.offset  # (L, S)
    assert torch.equal(table.table[:, entry], bias.to_dense(L, S, H=H, dtype=torch.float64)[0].to(torch.float32))


def test_the_diagonal_table_follows_each_rows_own_position() -> None:
    # positions given per batch row (two packed documents, and a row of its own): ALiBi by
    # hand, -slope_h |p_i - j|, and the reads of padded rows (positions continued past the
    # last) and of every key inside the table
    H, L, S = 2, 45, 70
    slopes = torch.tensor([0.5, 0.125])
    positions = torch.tensor([[*range(10, 30), *range(40, 65)], [*range(25, 70)]])  # (N, L)
    every_key = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1))  # (1, L) each
    table = diagonal_table(ScoreTerms(L, S, bias=qkv.bias.alibi(slopes), positions=positions), H, every_key)
    assert table is not None and torch.equal(table.positions, positions)
    for n in range(2):
        entry = positions[n].view(L, 1) - torch.arange(S).view(1, S) + table.offset  # (L, S)
        by_hand = -slopes.view(H, 1, 1) * (positions[n].view(1, L, 1) - torch.arange(S).view(1, 1, S)).abs()  # (H, L, S)
        assert torch.equal(table.table[:, entry], by_hand)
        assert int(positions[n].min()) - (S - 1) + table.offset >= 0
        assert int(positions[n].max()) + 63 + table.offset < table.table.shape[1]


def test_the_engine_hands_the_terms_to_the_scored_kernels_when_the_fused_ones_return_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # a build or self-check that fails at the first call: the plan named the fused kernels,
    # which return None; the portable kernels apply no score terms, so the scored engine's do
    # (on every machine, whatever it can build)
    monkeypatch.setattr(interval_bf16, "forward", lambda *args, **kwargs: None)
    monkeypatch.setattr(interval_bf16_backward, "backward", lambda *args, **kwargs: None)
    N, H, L, S, E = 1, 2, 260, 260, 64
    q, k, v, d_out = _problem(N, H, H, L, S, E, E, seed=9)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    mask = M.causal()
    intervals = mask.row_intervals(L, S)
    assert intervals is not None
    plan = plan_intervals(*intervals, BlockSizes(N=N, H=H, L=L, S=S, Ep=E, itemsize=2), BLOCKS)
    bias = qkv.bias.alibi().bind((N,), H, L, S)
    terms = ScoreTerms(L, S, softcap=2.0, bias=bias)
    out, lse = block_attention(ql, kl, vl, mask, plan, E**-0.5, None, "interval_bf16", "interval_bf16_backward", terms=terms)
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    trace, ref_grads = _reference(ql.detach(), kl.detach(), vl.detach(), mask.to_dense(L, S), d_out, E**-0.5, 2.0, _dense_bias(bias, H, L, S))
    assert _err(out, trace.output) < 1e-2
    np.testing.assert_allclose(lse.detach().double().numpy(), trace.lse, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        assert _err(got, want) < 2e-2 * max(float(np.abs(want).max()), 1.0)


def test_two_runs_with_terms_are_bitwise_equal() -> None:
    q, k, v, d_out = _problem(1, 4, 2, 700, 700, 64, 64, seed=10)
    results = []
    for _ in range(2):
        leaves = tuple(t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
        out = qkv.attention(*leaves, mask=M.causal(), softcap=3.0, bias=qkv.bias.alibi(), backend="blocks")
        results.append((out, *torch.autograd.grad(out, leaves, d_out.to(DTYPE))))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_the_protocols_blocks_entry_runs_the_plans_kernels_with_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    # `qkv.backends.protocol`'s forward of "blocks" with the Plan's kernel names: the fused
    # kernels where they were named (the table built on the way), the scored ones otherwise;
    # against the float64 reference with the bias rendered dense
    from qkv.attention.dispatch import choose_path
    from qkv.attention.problem import describe_problem
    from qkv.backends.protocol import BACKENDS

    H, L, E = 4, 600, 64
    q, k, v, d_out = _problem(1, H, H, L, L, E, E, seed=11)
    q, k, v = (t.to(DTYPE) for t in (q, k, v))
    mask, bias = M.sliding_window(50), qkv.bias.alibi()
    problem = describe_problem(q, k, v, mask, bias=bias, softcap=20.0)
    plan = choose_path(problem, "blocks", False, True)
    assert plan.tiles is not None
    spy = CallSpy(monkeypatch, interval_bf16, "forward")
    with torch.no_grad():
        out, _ = BACKENDS["blocks"].forward(
            q, k, v, mask, plan.tiles, problem.scale, problem.terms, plan.forward_kernel, plan.backward_kernel
        )
    assert spy.calls == (1 if _can_run() else 0)
    trace, _ = _reference(q, k, v, mask.to_dense(L, L), d_out, E**-0.5, 20.0, _dense_bias(bias, H, L, L))
    assert _err(out, trace.output) < 2e-2


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_terms_give_eagers_results(backend: str, sinks: bool) -> None:
    # the block engine's operators with score terms the fused kernels apply: every bias tensor
    # gets its (empty) gradient slot, and outputs and gradients are eager's, bit for bit, with
    # gradients and without (the inference output rounded once, after the sinks' fold)
    q, k, v, d_out = _problem(2, 2, 2, 70, 80, 64, 64, seed=12)
    mask = M.padded(torch.tensor([70, 20]), torch.tensor([80, 10]), causal=True)
    bias = qkv.bias.alibi(torch.tensor([0.3, 0.05]))
    sink = torch.tensor([0.5, -1.0]) if sinks else None

    def run(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return qkv.attention(a, b, c, mask, bias=bias, softcap=2.0, sinks=sink, backend="blocks")

    results, inference = [], []
    for fn in (run, torch.compile(run, backend=backend, fullgraph=True)):
        leaves = tuple(t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, d_out.to(DTYPE))))
        with torch.no_grad():
            inference.append(fn(*(t.detach() for t in leaves)))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert torch.equal(*inference)


def _shifted_everywhere(q, k, v, d_out, run) -> None:  # type: ignore[no-untyped-def]
    """``run`` (attention of bf16 q, k, v with a bias of -1e9 on every pair) against a hand
    calculation of what float32 can give there: each score rounds to -1e9 itself (its ulp is
    64), so P is uniform, 1 / S, and the gradients are the formula's with that P (dS = P (dP -
    rowsum(dO O)), dq = dS k scale, dk = dS^T q scale, dv = P^T dO). A backward that reads the
    lse as one float32 number gets exp(s - lse) off by up to e^32 (log S lost in its rounding)."""
    scale = q.shape[3] ** -0.5
    leaves = tuple(t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, d_out.to(DTYPE))
    q64, k64, v64, g64 = (t.detach().double() for t in (*leaves, d_out))
    p = torch.full((*q.shape[:3], k.shape[2]), 1.0 / k.shape[2], dtype=torch.float64)  # (N, H, L, S)
    want = p @ v64  # (N, H, L, Ev)
    ds = p * (g64 @ v64.transpose(-1, -2) - (g64 * want).sum(-1, keepdim=True))  # (N, H, L, S)
    wanted = (ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, p.transpose(-1, -2) @ g64)
    assert float((out.detach().double() - want).abs().max()) < 1e-2
    for got, expected in zip(grads, wanted, strict=True):
        assert float((got.double() - expected).abs().max()) <= 2e-2 * float(expected.abs().max()) + 1e-3


def test_compiled_huge_bias_offsets_keep_the_lse_in_two_parts() -> None:
    # traced, the fused kernels are named before the bias's values are known; a table of -1e9
    # is then refused when the graph runs and the scored engine stands in, its lse in two parts
    H, L, E = 2, 64, 32
    q, k, v, d_out = _problem(1, H, H, L, L, E, E, seed=13)
    table = torch.full((H, 32), -1e9)

    def run(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return qkv.attention(a, b, c, bias=qkv.bias.relative(table), backend="blocks")

    _shifted_everywhere(q, k, v, d_out, run)
    _shifted_everywhere(q, k, v, d_out, torch.compile(run, backend="aot_eager", fullgraph=True))


def test_explain_says_why_terms_stay_on_the_scored_kernels() -> None:
    q = torch.randn(1, 4, 3000, 64).to(DTYPE).requires_grad_(True)
    mask = M.sliding_window(100)
    reasons = {
        "it applies no score_mod": {"score_mod": lambda s, b, h, i, j: s * 0.5},
        "it gives the bias's tensors no gradient": {"bias": qkv.bias.alibi(torch.ones(4, requires_grad=True))},
        "reads the bias from a table of diagonals, which this bias does not fit": {"bias": qkv.bias.relative(torch.full((4, 32), -1e5))},
    }
    for reason, terms in reasons.items():
        line = qkv.explain(q, q, q, mask, **terms).forward_kernel
        if _can_run():
            assert f"(the {interval_bf16.KERNEL_NAME} does not run: " in line and reason in line, line
        else:
            assert f"(the {interval_bf16.KERNEL_NAME} does not run: " in line, line
    # float32: the bf16 kernels are no candidates, nothing is said
    assert qkv.explain(q.float(), q.float(), q.float(), mask, softcap=5.0).forward_kernel == ""
    # a long window with the paper's slopes: the far keys' bias (-0.5 x 33,000) is never a row's offset
    long = torch.zeros(1, 8, 33000, 64).to(DTYPE)
    kernels = qkv.explain(long, long, long, M.sliding_window(128), bias=qkv.bias.alibi()).kernels
    assert kernels == FUSED if _can_run() else _scored(kernels)


def test_bf16_alibi_slopes_keep_their_distances_exact() -> None:
    # slopes stored in bf16 (a bf16 module's buffer): the table is evaluated in float64, so
    # the distances are not rounded to bf16 (at 2,001 keys that moved a score by 0.5 x 1)
    L = S = 2001
    slopes = torch.tensor([0.5, 0.0625]).to(DTYPE)
    bias = qkv.bias.alibi(slopes).bind((1,), 2, L, S)
    every_key = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1))  # (1, L) each
    table = diagonal_table(ScoreTerms(L, S, bias=bias), 2, every_key)
    assert table is not None
    distance = torch.arange(table.table.shape[1], dtype=torch.float64) - table.offset  # p - j of each entry
    want = (-slopes.double().view(2, 1) * distance.abs().view(1, -1)).to(torch.float32)  # (H, D)
    assert torch.equal(table.table, want)


def test_the_eager_engine_keeps_the_scored_lse_in_two_parts() -> None:
    # the fused kernels named, the table refused when the call runs (a bias of -1e9: only a
    # caller that skips dispatch gets there): the scored engine stands in, and its backward
    # reads the lse in the two parts its forward kept
    N, H, L, E = 1, 2, 64, 32
    q, k, v, d_out = _problem(N, H, H, L, L, E, E, seed=15)
    intervals = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), L - 1))  # (1, L) each: no mask
    plan = plan_intervals(*intervals, BlockSizes(N=N, H=H, L=L, S=L, Ep=E, itemsize=2), BLOCKS)
    terms = ScoreTerms(L, L, bias=qkv.bias.relative(torch.full((H, 32), -1e9)))

    def run(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return block_attention(a, b, c, None, plan, E**-0.5, None, "interval_bf16", "interval_bf16_backward", terms=terms)[0]

    _shifted_everywhere(q, k, v, d_out, run)


def test_block_attention_refuses_terms_the_fused_kernels_cannot_apply() -> None:
    q = torch.randn(1, 2, 64, 32).to(DTYPE)
    intervals = (torch.zeros(1, 64, dtype=torch.long), torch.full((1, 64), 63))
    plan = plan_intervals(*intervals, BlockSizes(N=1, H=2, L=64, S=64, Ep=32, itemsize=2), BLOCKS)
    terms = ScoreTerms(64, 64, score_mod=lambda s, b, h, i, j: s * 0.5)
    with pytest.raises(ValueError, match="it applies no score_mod"):
        block_attention(q, q, q, None, plan, 0.1, None, "interval_bf16", "interval_bf16_backward", terms=terms)


def test_a_tiny_softcap_flattens_the_scores_without_nan() -> None:
    # scale / cap near the float32 limit: u / cap overflows to inf, tanh gives +-1
    q, k, v, _ = _problem(1, 2, 2, 300, 300, 64, 64, seed=16)
    ql, kl, vl = (t.to(DTYPE) * 100 for t in (q, k, v))
    with torch.no_grad():
        out = qkv.attention(ql, kl, vl, M.causal(), softcap=1e-37, backend="blocks")
    uniform = torch.cumsum(vl.double(), dim=2) / torch.arange(1, 301, dtype=torch.float64).view(1, 1, 300, 1)  # causal means
    assert torch.isfinite(out).all()
    assert float((out.double() - uniform).abs().max()) < 1.0  # bf16 rounding of values of size 100
