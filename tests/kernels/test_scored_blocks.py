"""The block engine with score terms: bias pieces cut to the call budget, bias tiles reused
within a problem, and the bf16 flash path (bias alone), against the float64 reference.

Expected values come from `qkv.reference` given the mask as a dense array and the ALiBi bias
computed here by hand (-slope_h * |p_i - j|, positions bottom-right or per document); slope
gradients from `reference.logit_grads` summed over the pairs each slope touches.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.attention import dispatch
from qkv.backends.blocks import calls as block_calls
from qkv.backends.blocks.planner import (
    _TILE_SHARE,
    BlockConfig,
    BlockSizes,
    Piece,
    _narrow,
    plan_intervals,
)
from qkv.backends.blocks.scored import _owned
from tests.kernels.test_blocks import _problem
from tests.kernels.test_blocks_bf16 import _err

# a budget small enough that documents of a few hundred keys are cut into several pieces
SMALL = BlockConfig(block_q=32, block_k=8, masked_span=64, min_rows=4, call_bytes=64 * 2**10)


def _positions(mask: M.Mask, L: int, S: int) -> np.ndarray:
    """(L,) query positions in key coordinates, by hand: each document's own for varlen."""
    if isinstance(mask, M.Varlen):
        out: list[int] = []
        k0 = 0
        for ql, kl in zip(mask.q_lengths.tolist(), mask.k_lengths.tolist(), strict=True):
            out += [k0 + i + kl - ql for i in range(ql)]
            k0 += kl
        return np.array(out)
    return np.arange(L) + S - L


def _alibi_reference(q, k, v, mask: M.Mask, slopes: torch.Tensor, d_out: torch.Tensor, scale: float):
    """Output, lse and the gradients of q, k, v and the slopes from the float64 reference."""
    L, S = q.shape[-2], k.shape[-2]
    distance = np.abs(_positions(mask, L, S)[:, None] - np.arange(S)[None, :])  # (L, S)
    bias = -slopes.detach().double().numpy()[None, :, None, None] * distance  # (1, H, L, S)
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask.to_dense(L, S).numpy(), scale,
                        bias=bias)
    dq, dk, dv = R.attention_grads(trace, d_out.numpy())
    d_slopes = -(R.logit_grads(trace, d_out.numpy()) * distance).sum(axis=(0, 2, 3))
    return trace, (dq, dk, dv, d_slopes)


def _engine(q, k, v, mask, slopes, d_out, scale):  # type: ignore[no-untyped-def]
    q, k, v, slopes = (t.detach().clone().requires_grad_(True) for t in (q, k, v, slopes))
    out = qkv.attention(q, k, v, mask, bias=qkv.bias.alibi(slopes), scale=scale, backend="blocks")
    grads = torch.autograd.grad(out, (q, k, v, slopes), d_out.to(out.dtype))
    return out.detach(), grads


def test_wide_pieces_with_score_terms_are_cut_to_the_budget() -> None:
    sizes = BlockSizes(N=1, H=8, L=64, S=4000, Ep=16, itemsize=2, mask_heads=8, score_terms=True)
    cfg = BlockConfig()
    wide = [Piece(0, 192, 0, 3000, masked=False), Piece(0, 192, 3000, 3192, masked=True), Piece(192, 200, 0, 3000, masked=False)]
    pieces = _narrow(wide, sizes, cfg)
    # each tile (8 heads x rows x width, float32 + a mask byte) fits its share of call_bytes
    for p in pieces:
        assert 8 * (p.q1 - p.q0) * (p.k1 - p.k0) * 5 <= cfg.call_bytes // _TILE_SHARE
    # the keys of every row group are covered exactly once, in pieces of near-equal width
    for rows, keys in (((0, 192), (0, 3192)), ((192, 200), (0, 3000))):
        parts = sorted((p.k0, p.k1) for p in pieces if (p.q0, p.q1) == rows)
        assert parts[0][0] == keys[0] and parts[-1][1] == keys[1]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    assert sum(1 for p in pieces if (p.q0, p.q1) == (0, 192)) > 2  # the wide full piece was cut
    assert [p for p in pieces if (p.q0, p.q1) == (192, 200)] == [wide[2]]  # 8 rows: it fits whole
    # without score terms nothing changes, even with a mask that varies over heads
    assert _narrow(wide, BlockSizes(N=1, H=8, L=64, S=4000, Ep=16, itemsize=2), cfg) == wide
    assert _narrow(wide, BlockSizes(N=1, H=8, L=64, S=4000, Ep=16, itemsize=2, mask_heads=8), cfg) == wide
    # one head with a bias: its tiles are cut too (192 rows x 12,000 keys x 5 bytes > call_bytes / 4)
    one_head = BlockSizes(N=1, H=1, L=192, S=12000, Ep=16, itemsize=2, mask_heads=1, score_terms=True)
    assert len(_narrow([Piece(0, 192, 0, 12000, masked=False)], one_head, cfg)) == 2


def test_planned_calls_with_a_bias_stay_within_the_budget() -> None:
    mask = M.varlen(torch.tensor([300, 17, 500]), causal=True)
    lo, hi = mask.row_intervals(817, 817)  # type: ignore[misc]
    sizes = BlockSizes(N=1, H=4, L=817, S=817, Ep=16, itemsize=8, mask_heads=4, score_terms=True)
    plan = plan_intervals(lo, hi, sizes, SMALL)
    assert any(c.merge and not c.masked for c in plan.calls)  # full pieces were cut and merge
    per_key = 4 * 9  # float64 tile values and a mask byte, per row and head
    assert max(c.width * c.q_len * per_key for c in plan.calls) <= max(SMALL.call_bytes // _TILE_SHARE, SMALL.block_k * 32 * per_key)


@pytest.mark.parametrize("kind", ["varlen", "window"])
def test_cut_bias_pieces_match_the_reference_and_the_whole_pieces(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kind == "varlen":
        mask: M.Mask = M.varlen(torch.tensor([300, 17, 250]), torch.tensor([260, 30, 310]), causal=True)
        L, S = 567, 600
    else:
        mask = M.sliding_window(200, 30) & M.causal()
        L, S = 290, 333
    q, k, v, d_out = _problem(1, 4, 2, L, S, 12, 12, seed=5)
    slopes = torch.tensor([0.5, 0.02, 0.11, 0.003], dtype=torch.float64)
    whole = _engine(q, k, v, mask, slopes, d_out, 0.3)
    monkeypatch.setattr(dispatch, "BLOCKS", SMALL)
    cut = _engine(q, k, v, mask, slopes, d_out, 0.3)
    trace, want = _alibi_reference(q, k, v, mask, slopes, d_out, 0.3)
    for got in (whole, cut):
        np.testing.assert_allclose(got[0].numpy(), trace.output, atol=1e-10)
        for g, w in zip(got[1], want, strict=True):
            np.testing.assert_allclose(g.numpy(), w, atol=1e-8)
    torch.testing.assert_close(cut[0], whole[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize(("L", "S", "slopes"), [(700, 1000, (0.9, 0.01)), (1000, 700, (0.05, 0.3)), (640, 640, (0.25, 0.25))])
def test_reused_bias_tiles_belong_to_their_own_diagonal(L: int, S: int, slopes: tuple[float, ...]) -> None:
    """Many row groups share tiles (one per diagonal and shape): each problem, L != S (bottom-right
    positions), its own slopes and heads, matches the reference row by row."""
    mask = M.sliding_window(150, 10) & M.causal()
    q, k, v, d_out = _problem(1, 2, 1, L, S, 8, 8, seed=L + S)
    slope = torch.tensor(slopes, dtype=torch.float64)
    out, grads = _engine(q, k, v, mask, slope, d_out, 0.4)
    trace, want = _alibi_reference(q, k, v, mask, slope, d_out, 0.4)
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-10)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-8)


@pytest.mark.parametrize("window", [60, 1100])  # rows of one piece each; rows of merged pieces
@pytest.mark.parametrize("learned", [False, True])
def test_bf16_alibi_on_the_flash_kernel_by_the_tolerance_rule(window: int, learned: bool) -> None:
    """Bias alone: the flash kernel with float32 bias tiles; without merges the output stays in
    bf16 (the kernel's own rounding), with merges it is merged in float32; learned slopes take
    the float32 backward of their own. Error at most 2x (output) / 3x (gradients) a naive bf16
    implementation's, bias in bf16 too, plus a floor."""
    n, H = 1300, 4
    mask = M.sliding_window(window) & M.causal()
    q, k, v, d_out = _problem(1, H, H, n, n, 16, 16, seed=9)
    slopes = qkv.bias.alibi_slopes(H)
    trace, want = _alibi_reference(q, k, v, mask, slopes, d_out, 0.25)
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert qkv.explain(*low, mask, bias=qkv.bias.alibi()).path == "blocks"
    if learned:
        got_out, got = _engine(*low, mask, slopes.float(), d_out, 0.25)
    else:
        ql, kl, vl = (t.clone().requires_grad_(True) for t in low)
        got_out = qkv.attention(ql, kl, vl, mask, bias=qkv.bias.alibi(), scale=0.25, backend="blocks")
        got = torch.autograd.grad(got_out, (ql, kl, vl), d_out.to(torch.bfloat16))
    assert got_out.dtype == torch.bfloat16
    # the naive implementation: every step in bf16, the bias rounded to bf16
    qn, kn, vn, sn = (t.clone().requires_grad_(True) for t in (*low, slopes.to(torch.bfloat16)))
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().to(torch.bfloat16)  # (n, n)
    scores = qn @ kn.transpose(-1, -2) * 0.25 - sn[:, None, None] * distance
    naive_out = torch.softmax(scores.masked_fill(~mask.to_dense(n, n), float("-inf")), dim=-1) @ vn
    naive = torch.autograd.grad(naive_out, (qn, kn, vn, sn) if learned else (qn, kn, vn), d_out.to(torch.bfloat16))
    assert _err(got_out, trace.output) <= 2 * _err(naive_out, trace.output) + 1e-4
    for g, nv, w in zip(got, naive, want, strict=False):
        assert not torch.isnan(g).any()
        assert _err(g, w) <= 3 * _err(nv, w) + 1e-4


@pytest.mark.parametrize(
    ("n", "window", "wide"),
    [(1300, 60, None), (1300, 1100, False), (3000, 3000, True)],  # no merges; 276 of 1300 rows merge; 1976 of 3000
)
def test_rounded_outputs_merge_in_float32_and_round_once(n: int, window: int, wide: bool | None) -> None:
    # rows beyond masked_span (1024) keys merge pieces. With rounded=True the output stays
    # bf16 and the merging rows are merged in float32 buffers of their own, unless most rows
    # merge: either way the result must equal the all-float32 run rounded once, bit for bit
    mask = M.sliding_window(window) & M.causal()
    lo, hi = mask.row_intervals(n, n)  # type: ignore[misc]
    plan = plan_intervals(lo, hi, BlockSizes(N=1, H=2, L=n, S=n, Ep=8, itemsize=2, mask_heads=2, score_terms=True), BlockConfig())
    assert any(c.merge for c in plan.calls) == (wide is not None)
    gen = torch.Generator().manual_seed(n + window)
    results = {id(c): (torch.randn(c.items, 2, c.q_len, 8, generator=gen).to(torch.bfloat16),
                       torch.randn(c.items, 2, c.q_len, generator=gen)) for c in plan.calls}  # fmt: skip
    # the expected merge, in float64 from the pieces: out = sum_p e^lse_p o_p / sum_p e^lse_p
    num, den = torch.zeros(2, n, 8, dtype=torch.float64), torch.zeros(2, n, dtype=torch.float64)
    for c in plan.calls:
        o, lse_o = results[id(c)]
        for j in range(c.items):
            rows = slice(c.q0 + j * c.q_len, c.q0 + (j + 1) * c.q_len)
            weight = lse_o[j].double().exp()  # (2, q_len)
            num[:, rows] += weight[..., None] * o[j].double()
            den[:, rows] += weight
    want_out, want_lse = num / den[..., None], den.log()  # every row has a piece here
    q = torch.zeros(1, 2, n, 8, dtype=torch.bfloat16)
    out, lse = block_calls.run_calls(q, plan, lambda call: results[id(call)], rounded=True)
    assert out.dtype == (torch.float32 if wide else torch.bfloat16)
    # one rounding to bf16 at most: within half an ulp (2^-8 relative), plus float32's merge error
    assert ((out[0].double() - want_out).abs() <= want_out.abs() * 2**-8 + 1e-5).all()
    torch.testing.assert_close(lse[0].double(), want_lse, atol=1e-5, rtol=0)
    # and bit for bit what the all-float32 route gives once rounded (no second rounding)
    wide_out, wide_lse = block_calls.run_calls(q, plan, lambda call: results[id(call)])
    assert torch.equal(out.to(torch.bfloat16), wide_out.to(torch.bfloat16)) and torch.equal(lse, wide_lse)


def test_a_tile_is_written_in_place_only_when_it_is_its_own() -> None:
    table = torch.randn(4, 6)
    bias = qkv.bias.dense(table)
    assert _owned(table[:, :3].clone(), bias)
    assert not _owned(table, bias)  # the bias's own tensor
    assert not _owned(table[1:], bias)  # a view of it
    assert not _owned(torch.zeros(1, 3).expand(4, 3), bias)  # broadcast: one value, many places


def test_gradient_accumulators_are_rounded_one_at_a_time() -> None:
    accumulators = [torch.full((1, 2, 3, 5), float(i) + 1 / 3) for i in range(3)]
    kept = list(accumulators)
    out = block_calls.rounded_in_turn(accumulators, 4, (torch.bfloat16, torch.float32, torch.float16))
    assert accumulators == []  # emptied: the engine drops each float32 accumulator once rounded
    assert [t.dtype for t in out] == [torch.bfloat16, torch.float32, torch.float16]
    for got, acc in zip(out, kept, strict=True):
        assert got.shape == (1, 2, 3, 4)
        torch.testing.assert_close(got, acc[..., :4].to(got.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("hide", [float("-inf"), torch.finfo(torch.float32).min, -1e20])
@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(150)], ids=["none", "causal", "window"])
@pytest.mark.parametrize(("softcap", "backend"), [(None, "auto"), (20.0, "blocks")])  # flash and own tile kernels
def test_a_bias_that_hides_rows_and_runs_of_keys_is_exact(
    hide: float, mask: M.Mask | None, softcap: float | None, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Additive padding: every piece of a row hidden by the bias used to keep an lse of 0 (-inf)
    or one rounded to the offset alone (-1e20, finfo.min), so the merge summed the pieces of
    such a row or shrank its neighbours'; the backward's exp(s - lse) was wrong the same way."""
    monkeypatch.setattr(dispatch, "BLOCKS", SMALL)  # rows cut into many pieces
    L = S = 256
    q, k, v, d_out = _problem(2, 1, 1, L, S, 8, 8, seed=9)
    q, k, v, d_out = (t.float() for t in (q, k, v, d_out))
    bias = torch.zeros(2, 1, L, S)
    bias[0, :, :, 40:] = hide  # padding keys: batch row 0 sees its first 40 keys only
    bias[1, :, :, 100:180] = hide  # a long run of hidden keys
    bias[1, :, 200, :] = hide  # a whole row
    d_lse = torch.randn(2, 1, L)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out, lse = qkv.attention(*leaves[:3], mask, bias=leaves[3], softcap=softcap, backend=backend, return_lse=True)
    assert backend == "blocks" or qkv.explain(q, k, v, mask, bias=bias, softcap=softcap).path == "blocks"
    ((out * d_out).sum() + (lse.nan_to_num(neginf=0.0) * d_lse).sum()).backward()

    visible = None if mask is None else mask.to_dense(L, S).numpy()
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), visible,
                        bias=bias.double().numpy(), softcap=softcap)
    np.testing.assert_allclose(out.detach().double().numpy(), trace.output, atol=2e-6)
    assert torch.equal(torch.isneginf(lse), torch.from_numpy(np.isneginf(trace.lse)))
    finite = np.isfinite(trace.lse)
    assert np.isneginf(trace.lse[1, :, 200]).all() == (hide == float("-inf"))
    np.testing.assert_allclose(lse.detach().double().numpy()[finite], trace.lse[finite], rtol=1e-6, atol=2e-6)
    d_lse64 = np.where(finite, d_lse.double().numpy(), 0.0)
    dq, dk, dv = R.attention_grads(trace, d_out.double().numpy(), d_lse64)
    # the bias is added after the softcap: its gradient is the logits'
    dx = R.logit_grads(trace, d_out.double().numpy()) + trace.weights * d_lse64[..., None]  # (B, H, L, S)
    for leaf, want in zip(leaves, (dq, dk, dv, dx), strict=True):
        assert leaf.grad is not None
        np.testing.assert_allclose(leaf.grad.double().numpy(), want, atol=2e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("mask", [M.causal(), M.sliding_window(100)], ids=["causal", "window"])
@pytest.mark.parametrize("backend", ["auto", "blocks"])
def test_masked_pairs_are_overwritten_whatever_score_mod_returns_there(value: float, mask: M.Mask, backend: str) -> None:
    """A score_mod may return anything on pairs the mask removes (NaN + -inf used to be NaN rows)."""
    L = S = 256
    q, k, v, d_out = _problem(1, 2, 2, L, S, 8, 8, seed=4)

    def only_where_masked(s, b, h, i, j):  # type: ignore[no-untyped-def]
        return torch.where(j > i, torch.full_like(s, value), s)  # identity on every visible pair

    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = qkv.attention(*leaves, mask, score_mod=only_where_masked, backend=backend)
    out.backward(d_out)
    # on visible pairs the score_mod is the identity: the reference without it is the answer
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), mask.to_dense(L, S).numpy())
    np.testing.assert_allclose(out.detach().numpy(), trace.output, atol=1e-10)
    for leaf, want in zip(leaves, R.attention_grads(trace, d_out.numpy()), strict=True):
        assert leaf.grad is not None
        np.testing.assert_allclose(leaf.grad.numpy(), want, atol=1e-9)
