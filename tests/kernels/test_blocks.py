"""The CPU block engine against the float64 NumPy reference on the dense mask, forward and backward.

Expected values come from `qkv.reference` (NumPy, float64) given ``mask.to_dense(L, S)``,
independently of the engine's tiles, plans and merges. Tile sizes cover 1 x 1, 16 x 16, a
non-square 16 x 8, the default, and tiles larger than the whole problem; ``masked_span`` is
also made tiny so that long runs are split and merged through their log-sum-exp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.attention import dispatch
from qkv.backends.blocks.engine import block_attention, block_weights
from qkv.backends.blocks.planner import (
    BlockConfig,
    BlockPlan,
    BlockSizes,
    TileStore,
    plan_intervals,
    plan_layout,
)
from qkv.masks._layout import states_from_dense

CONFIGS = {
    "1x1": BlockConfig(block_q=1, block_k=1),
    "16x16": BlockConfig(block_q=16, block_k=16),
    "16x8-split": BlockConfig(block_q=16, block_k=8, masked_span=8, min_rows=1),  # runs split, pieces merged
    "default": BlockConfig(),
    "larger-than-n": BlockConfig(block_q=256, block_k=256),
}


def _ids(S: int) -> torch.Tensor:
    """Packed documents with several one-token documents."""
    lengths = [1, 7, 1, 1, 12, 3, 1, 20, 5, 1, 40] * (1 + S // 92)  # 92 positions per round
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]


MASKS = {
    "causal": lambda N, S: M.causal(),
    "causal-top-left": lambda N, S: M.causal(align="top-left"),
    "window": lambda N, S: M.sliding_window(5, 2),
    "window-self-only": lambda N, S: M.sliding_window(0),
    "prefix": lambda N, S: M.prefix_lm(6),
    "documents": lambda N, S: M.documents(_ids(S)),
    "documents-per-batch": lambda N, S: M.documents(torch.stack([_ids(S), _ids(S) // 3])[:N]),
    "documents-unsorted": lambda N, S: M.documents(_ids(S) % 3),  # documents in several places
    "key-padding": lambda N, S: M.key_padding(torch.tensor([0, S - 9])[:N]),  # batch row 0: every row empty
    "predicate-per-head": lambda N, S: M.predicate(lambda b, h, q, k: (q * 3 + k + h) % 4 == 0, heads=4),
    "dense": lambda N, S: M.dense(torch.rand(N, 1, 1, S, generator=torch.Generator().manual_seed(3)) > 0.4),
    "documents&causal": lambda N, S: M.documents(_ids(S)) & M.causal(),
    "window|prefix": lambda N, S: M.sliding_window(3) | M.prefix_lm(2),
    "window&padding": lambda N, S: M.sliding_window(4, 4) & M.key_padding(torch.tensor([S, S - 10])[:N]),
}
# documents(ids) needs L <= S (queries on the last L positions)
SIZES = {"L<S": (29, 41), "L>S": (41, 23)}


def _problem(N: int, H: int, G: int, L: int, S: int, E: int, Ev: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, H, L, E, generator=gen, dtype=torch.float64)
    k = torch.randn(N, G, S, E, generator=gen, dtype=torch.float64)
    v = torch.randn(N, G, S, Ev, generator=gen, dtype=torch.float64)
    d_out = torch.randn(N, H, L, Ev, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), d_out


def _reference(q, k, v, mask: M.Mask, d_out, scale: float, d_lse=None):
    L, S = q.shape[-2], k.shape[-2]
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask.to_dense(L, S).numpy(), scale)
    return trace, R.attention_grads(trace, d_out.numpy(), None if d_lse is None else d_lse.numpy())


def _assert_matches(out, lse, grads, trace, ref_grads, tol: float) -> None:
    np.testing.assert_allclose(out.detach().double().numpy(), trace.output, atol=tol, rtol=tol)
    lse = lse.detach().double().numpy()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(trace.lse))
    finite = np.isfinite(trace.lse)
    np.testing.assert_allclose(lse[finite], trace.lse[finite], atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        assert not torch.isnan(got).any()
        np.testing.assert_allclose(got.double().numpy(), want, atol=tol, rtol=tol)


def _plan(planner: str, mask: M.Mask, N: int, H: int, L: int, S: int, Ep: int, cfg: BlockConfig) -> BlockPlan:
    if planner == "layout":
        sizes = BlockSizes(N=N, H=H, L=L, S=S, Ep=Ep, itemsize=8, mask_heads=mask.heads or 1)
        return plan_layout(mask.layout(L, S, cfg.block_q, cfg.block_k), sizes, cfg)
    intervals = mask.row_intervals(L, S)
    assert intervals is not None
    return plan_intervals(*intervals, BlockSizes(N=N, H=H, L=L, S=S, Ep=Ep, itemsize=8), cfg)


# masks whose queries each see one interval of keys, so that both planners apply
INTERVAL_KINDS = ["causal", "causal-top-left", "window", "window-self-only", "prefix", "documents",
                  "documents-per-batch", "key-padding", "documents&causal", "window|prefix", "window&padding"]
PLANNERS = [("layout", kind) for kind in MASKS] + [("intervals", kind) for kind in INTERVAL_KINDS]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("planner", "kind"), PLANNERS)
def test_engine_matches_the_reference(planner: str, kind: str, config: str, size: str) -> None:
    L, S = SIZES[size]
    if kind.startswith("documents") and L > S:
        L, S = S, L  # documents(ids) places the queries on the last positions: keep L <= S
    N, H, G, E, Ev, scale = 2, 4, 2, 8, 5, 0.3
    mask = MASKS[kind](N, S)
    tiles = _plan(planner, mask, N, H, L, S, max(E, Ev), CONFIGS[config])
    check_engine(mask, tiles, _problem(N, H, G, L, S, E, Ev), scale, heads=[3, 0], rows=[L - 1, 0, L // 2])


def check_engine(mask: M.Mask, plan: BlockPlan, problem, scale: float, heads: list[int], rows: list[int]) -> None:
    """The engine on ``plan`` against the reference: output, lse, gradients, chosen weights."""
    q, k, v, d_out = problem
    N, H, L = q.shape[0], q.shape[1], q.shape[2]
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, lse = block_attention(q, k, v, mask, plan, scale)
    # a loss that reads the output and the lse: both gradients flow back (d lse_i / d s_ij = p_ij)
    d_lse = torch.randn(N, H, L, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse))
    trace, ref_grads = _reference(q.detach(), k.detach(), v.detach(), mask, d_out, scale, d_lse)
    _assert_matches(out, lse, grads, trace, ref_grads, 1e-10)
    # exact probabilities of chosen heads and rows, block by block, from the saved lse
    weights = block_weights(q.detach(), k.detach(), mask, plan, scale, torch.tensor(heads), torch.tensor(rows), lse.detach())
    np.testing.assert_allclose(weights.numpy(), trace.weights[:, heads][:, :, rows], atol=1e-12)


@pytest.mark.parametrize("kind", MASKS)
def test_public_api_blocks_backend(kind: str) -> None:
    N, H, G, L, S, E, Ev = 2, 4, 4, 37, 37, 6, 6
    mask = MASKS[kind](N, S)
    q, k, v, d_out = _problem(N, H, G, L, S, E, Ev, seed=1)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, weights, lse = qkv.attention(q, k, v, mask, backend="blocks", return_weights=True, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    trace, ref_grads = _reference(q.detach(), k.detach(), v.detach(), mask, d_out, E**-0.5)
    _assert_matches(out, lse, grads, trace, ref_grads, 1e-10)
    np.testing.assert_allclose(weights.detach().numpy(), trace.weights, atol=1e-12)


def test_fully_masked_rows_give_zeros_and_no_nan() -> None:
    # batch row 0 has no valid key at all; in row 1 the window of the first queries is empty (L > S)
    mask = M.sliding_window(2) & M.key_padding(torch.tensor([0, 5]))
    q, k, v, d_out = _problem(2, 2, 2, 12, 5, 4, 4, dtype=torch.float32)
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    out, weights, lse = qkv.attention(q, k, v, mask, backend="blocks", return_weights=True, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out.float())
    empty = ~mask.to_dense(12, 5).any(-1)  # (2, 1, 12)
    assert bool(empty[0].all()) and bool(empty[1, 0, :7].all()) and not bool(empty[1, 0, 7:].any())
    assert torch.equal(out[empty.expand(2, 2, 12)], torch.zeros(2 * 12 + 2 * 7, 4))
    assert torch.isneginf(lse[empty.expand(2, 2, 12)]).all() and torch.isfinite(lse[~empty.expand(2, 2, 12)]).all()
    assert not weights[0].any()
    assert not dq[empty.expand(2, 2, 12)].any() and not dk[0].any() and not dv[0].any()
    for t in (out, weights, dq, dk, dv):
        assert not torch.isnan(t).any()


def test_grouped_heads_head_dims_and_batch_dims() -> None:
    # GQA (H = 6, G = 2), E != Ev both ways, two batch dims, a per-head predicate
    mask = M.sliding_window(7, 1) & M.predicate(lambda b, h, q, k: (k + h) % 5 != 0, heads=6)
    for E, Ev in [(12, 3), (3, 12)]:
        gen = torch.Generator().manual_seed(E)
        q = torch.randn(2, 3, 6, 50, E, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 3, 2, 50, E, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 3, 2, 50, Ev, generator=gen, dtype=torch.float64, requires_grad=True)
        d_out = torch.randn(2, 3, 6, 50, Ev, generator=gen, dtype=torch.float64)
        out = qkv.attention(q, k, v, mask, backend="blocks")
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        trace = R.attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), mask.to_dense(50, 50).numpy())
        np.testing.assert_allclose(out.detach().numpy(), trace.output, atol=1e-10)
        for got, want in zip(grads, R.attention_grads(trace, d_out.numpy()), strict=True):
            np.testing.assert_allclose(got.numpy(), want, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_error_is_at_most_twice_the_naive_error(dtype: torch.dtype) -> None:
    mask = M.documents(_ids(96)) & M.causal()
    q, k, v, d_out = _problem(1, 4, 4, 96, 96, 16, 16, seed=2)
    trace, ref_grads = _reference(q, k, v, mask, d_out, 0.25)
    ql, kl, vl = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    out = qkv.attention(ql, kl, vl, mask, backend="blocks", scale=0.25)
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(dtype))
    # the naive implementation: every step in the low-precision dtype
    qn, kn, vn = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    scores = (qn @ kn.transpose(-1, -2) * 0.25).masked_fill(~mask.to_dense(96, 96), float("-inf"))
    naive = torch.softmax(scores, dim=-1) @ vn
    naive_grads = torch.autograd.grad(naive, (qn, kn, vn), d_out.to(dtype))
    floor = 1e-6 if dtype == torch.float32 else 1e-3

    def err(a: torch.Tensor, b: np.ndarray) -> float:
        return float(np.abs(a.detach().double().numpy() - b).max())

    assert err(out, trace.output) <= 2 * err(naive, trace.output) + floor
    for got, naive_g, want in zip(grads, naive_grads, ref_grads, strict=True):
        assert err(got, want) <= 3 * err(naive_g, want) + floor


def test_attention_weights_of_chosen_heads_and_rows() -> None:
    q, k, v, _ = _problem(2, 4, 2, 300, 300, 8, 8, seed=4)
    mask = M.sliding_window(20, 5) | M.prefix_lm(3)
    dense = mask.to_dense(300, 300).numpy()
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), dense)
    w = qkv.attention_weights(q, k, v, mask, heads=[3, 1], rows=range(250, 300, 7))
    np.testing.assert_allclose(w.numpy(), trace.weights[:, [3, 1]][:, :, 250::7], atol=1e-12)
    # every head and row by default; slices; a tensor mask takes the dense route on the chosen rows
    np.testing.assert_allclose(qkv.attention_weights(q, k, v, mask, rows=slice(0, 2)).numpy(),
                               trace.weights[:, :, :2], atol=1e-12)
    tensor_mask = torch.from_numpy(dense)
    np.testing.assert_allclose(qkv.attention_weights(q, k, v, tensor_mask, heads=torch.tensor([2]), rows=[9]).numpy(),
                               trace.weights[:, [2]][:, :, [9]], atol=1e-12)
    assert qkv.attention_weights(q, k, v, None, heads=[0], rows=[5]).shape == (2, 1, 1, 300)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"heads": [4]}, ValueError, r"heads must lie in \[0, 4\), got \[4\]"),
        ({"rows": [-1, 3]}, ValueError, r"rows must lie in \[0, 30\), got \[-1\]"),
        ({"rows": [1.5]}, TypeError, "rows must be integers"),
        ({"heads": []}, ValueError, "heads selects nothing"),
        ({"rows": torch.tensor([[1]])}, TypeError, "1-D integer tensor"),
    ],
)
def test_attention_weights_rejects_bad_indices(kwargs: dict, error: type[Exception], words: str) -> None:
    q = torch.randn(1, 4, 30, 8)
    with pytest.raises(error, match=words):
        qkv.attention_weights(q, q, q, M.causal(), **kwargs)


def test_interval_masks_know_their_intervals_and_the_others_do_not() -> None:
    for kind in MASKS:
        mask = MASKS[kind](2, 41)
        intervals = mask.row_intervals(29, 41)
        assert (intervals is not None) == (kind in INTERVAL_KINDS), kind
        if intervals is not None:
            lo, hi = intervals
            positions = torch.arange(41)
            from_intervals = (positions >= lo[..., None]) & (positions <= hi[..., None])  # (B | 1, L, S)
            want = mask.to_dense(29, 41)[:, 0]
            torch.testing.assert_close(from_intervals.expand_as(want), want)
    # unsorted documents and key padding with holes are not intervals
    assert M.documents(torch.tensor([0, 1, 0, 1])).row_intervals(4, 4) is None
    assert M.key_padding(torch.tensor([[True, False, True]])).row_intervals(2, 3) is None
    assert (M.sliding_window(1) | M.key_padding(torch.tensor([2]))).row_intervals(9, 9) is None  # apart at the end


def test_interval_plan_follows_documents() -> None:
    # one row group per document (documents longer than min_rows), each fully visible: no mask
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([40, 17, 100, 30]))
    sizes = BlockSizes(N=1, H=2, L=187, S=187, Ep=8, itemsize=4)
    plan = plan_intervals(*M.documents(ids).row_intervals(187, 187), sizes, BlockConfig())
    assert [(p.q0, p.q1, p.k0, p.k1, p.masked) for p in plan.pieces[0]] == [
        (0, 40, 0, 40, False), (40, 57, 40, 57, False), (57, 157, 57, 157, False), (157, 187, 157, 187, False),
    ]
    assert plan.computed_pairs() == 40**2 + 17**2 + 100**2 + 30**2


def test_dispatch_and_explain() -> None:
    q = k = v = torch.randn(1, 4, 1024, 16)  # H = 4: with 2 heads SDPA is estimated faster at this size
    window = M.sliding_window(256)
    e = qkv.explain(q, k, v, window)
    assert e.path == "blocks" and "sliding_window(left=256, right=0)" in e.reason
    # rows 0..256 see keys 0..r: one causal square (its lower triangle); then row groups of
    # block_q (< 256) rows [r0, r1), each the keys r0 - 256 .. r0 - 1 (masked) and a causal square
    bq = dispatch.BLOCKS.block_q
    pairs = 257 * 258 // 2 + sum((r1 - r0) * 256 + (r1 - r0) * (r1 - r0 + 1) // 2
                                 for r0, r1 in ((r, min(1024, r + bq)) for r in range(257, 1024, bq)))
    assert e.flops == 2 * (16 + 16) * pairs * 4
    assert e.visited_fraction == pytest.approx(pairs / 1024**2)
    tiles = states_from_dense(window.to_dense(1024, 1024), bq, dispatch.BLOCKS.block_k)
    assert e.blocks_visited == pytest.approx(float((tiles != 0).double().mean()))
    assert f"tiles: {bq}x{dispatch.BLOCKS.block_k}" in str(e)
    # what SDPA does best stays with SDPA
    assert qkv.explain(q, k, v, M.causal()).path == "fused"
    assert qkv.explain(q, k, v, M.sliding_window(900, 900)).path == "fused"  # most tiles visible
    small = torch.randn(1, 2, 64, 16)
    assert qkv.explain(small, small, small, window).path == "fused"  # too small to pay for tiles
    assert qkv.explain(q, k, v, window, dropout=0.1).path == "fused"  # the engine has no dropout
    assert qkv.explain(q, k, v, window, backend="math").path == "math"
    # auto on a big sparse problem gives the same numbers as SDPA on the dense mask
    torch.testing.assert_close(qkv.attention(q, k, v, window), qkv.attention(q, k, v, window, backend="fused"),
                               atol=1e-5, rtol=1e-5)


def test_blocks_backend_refuses_what_it_cannot_run() -> None:
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"qkv\.masks\.dense"):
        qkv.attention(q, q, q, torch.ones(8, 8, dtype=torch.bool), backend="blocks")
    with pytest.raises(ValueError, match="no dropout"):
        qkv.attention(q, q, q, M.causal(), backend="blocks", dropout=0.1)
    with pytest.raises(ValueError, match="'blocks'"):
        qkv.attention(q, q, q, backend="tiles")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        qkv.attention(q.requires_grad_(True), q, q, M.causal(), backend="flex")
    # no mask at all: every tile full, still exact
    torch.testing.assert_close(qkv.attention(q, q, q, backend="blocks"), qkv.attention(q, q, q, backend="math"))


def test_no_allocation_grows_with_n_squared() -> None:
    n = 4096
    q, k, v = (torch.randn(1, 1, n, 8) for _ in range(3))
    mask = M.sliding_window(64) & M.documents(torch.arange(n) // 700)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        qkv.attention(q, k, v, mask, backend="blocks")
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= n * 1024  # O(n x block): one bool n x n mask alone would be 16 MiB
    assert largest >= n * 8 * 4  # the output itself was seen: the measurement is live


@pytest.mark.parametrize("grad", [False, True])
def test_tiles_of_unsorted_documents_are_not_kept(grad: bool) -> None:
    """Memory stays O(n x block): tiles that never repeat (no shift invariance) are rebuilt
    when needed, not kept for the whole call; shift-invariant ones are kept within call_bytes."""
    from qkv.backends.blocks.calls import BlockRun
    from qkv.backends.blocks.engine import _forward

    N, H, L, D = 1, 2, 700, 8
    ids = torch.randperm(12, generator=torch.Generator().manual_seed(0))[torch.arange(L) // 61]
    cfg = BlockConfig(block_q=64, block_k=32, call_bytes=64 * 2**10)
    q, k, v, _ = _problem(N, H, H, L, L, D, D)
    for mask, kept in ((M.documents(ids), False), (M.sliding_window(100), True)):
        tiles = _plan("layout", mask, N, H, L, L, D, cfg)
        assert any(c.masked for c in tiles.calls)
        run = BlockRun(tiles, mask, 0.5)
        _forward(q, k, v, run)
        assert bool(run.store.tiles) == kept
        assert run.store.bytes <= cfg.call_bytes
        # and the result is still exact, forward and backward (tiles rebuilt in the backward)
        qg, kg, vg = (t.clone().requires_grad_(grad) for t in (q, k, v))
        out, _ = block_attention(qg, kg, vg, mask, tiles, 0.5)
        trace, ref_grads = _reference(q, k, v, mask, torch.ones(N, H, L, D, dtype=torch.float64), 0.5)
        np.testing.assert_allclose(out.detach().numpy(), trace.output, atol=1e-10)
        if grad:
            grads = torch.autograd.grad(out.sum(), (qg, kg, vg))
            for got, want in zip(grads, ref_grads, strict=True):
                np.testing.assert_allclose(got.numpy(), want, atol=1e-10)


def _window_call(q: torch.Tensor, mask: M.Mask) -> tuple[torch.Tensor, TileStore | None]:
    """qkv.attention on the engine, and the tile store of the plan 'auto' made for it."""
    from qkv.attention.functional import describe_problem

    plan = dispatch.choose_path(describe_problem(q, q, q, mask, None, 0.0), "blocks", False, False)
    assert plan.tiles is not None
    return qkv.attention(q, q, q, mask, backend="blocks"), plan.tiles.tile_store


def test_a_mask_given_by_its_parameters_shares_plan_and_tiles_across_calls() -> None:
    """A sliding window has no tensors: its plan is made once per size and kept, with the mask
    tiles every run of it builds; a second call builds none, and both equal float64's."""
    q = torch.randn(1, 2, 1000, 16, generator=torch.Generator().manual_seed(3))
    mask = M.sliding_window(75)
    expected = qkv.attention(q.double(), q.double(), q.double(), mask, backend="math")
    first, store = _window_call(q, mask)
    assert store is not None and store.tiles and 0 < store.bytes <= store.limit
    held = dict(store.tiles)
    second, again = _window_call(q, mask)
    # the same tensors, nothing built
    assert again is store and store.tiles.keys() == held.keys() and all(store.tiles[key] is tile for key, tile in held.items())
    for out in (first, second):
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    # documents carry tensors: no shared store, each run keeps its own tiles
    _, documents_store = _window_call(q, M.documents(torch.arange(1000) // 300))
    assert documents_store is None


def test_a_shared_tile_store_keeps_to_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from qkv.backends.blocks import ops

    monkeypatch.setattr(ops, "_SHARED_TILE_BYTES", 100_000)  # under two f32 tiles of 192 x 75+ keys
    ops._cached_plan.cache_clear()
    try:
        q = torch.randn(1, 2, 1200, 16, generator=torch.Generator().manual_seed(4))
        mask = M.sliding_window(100, 20)
        out, store = _window_call(q, mask)
        assert store is not None and store.limit == 100_000 and store.bytes <= 100_000
        expected = qkv.attention(q.double(), q.double(), q.double(), mask, backend="math")
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    finally:
        ops._cached_plan.cache_clear()  # no plan made under the patched limit outlives the test
