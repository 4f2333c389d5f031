"""Causal squares of the block engine (`Piece.causal`: the kernel's is_causal, no tile) against
the float64 reference, forward, lse and backward, on awkward sizes.

Expected values come from `qkv.reference` given ``mask.to_dense(L, S)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv.backends.blocks.planner import BlockConfig, BlockSizes, plan_intervals
from tests.kernels.test_blocks import _problem, _reference, check_engine

# (q_lengths, k_lengths) of packed documents: equal lengths, more keys than queries (the
# diagonal starts right of the first key), fewer keys (leading rows see nothing), a 1025-row
# document and one-token documents between longer ones
DOCUMENTS = {
    "equal": ([1, 30, 97, 5, 64, 1, 40], None),
    "more-keys": ([20, 97, 3, 50], [31, 120, 3, 77]),
    "fewer-keys": ([40, 97, 9], [25, 60, 9]),
    "long": ([1025, 7], None),
}
MASKS = {
    "varlen-causal": lambda q, k: M.varlen(torch.tensor(q), None if k is None else torch.tensor(k), causal=True),
    "varlen-window": lambda q, k: M.varlen(torch.tensor(q), None if k is None else torch.tensor(k), causal=True, window=(300, 0)),
    "documents&causal": lambda q, k: M.documents(torch.repeat_interleave(torch.arange(len(q)), torch.tensor(q))) & M.causal(),
}
CONFIGS = {"default": BlockConfig(), "small": BlockConfig(block_q=16, block_k=8, masked_span=8, min_rows=4)}


def _plan(mask: M.Mask, N: int, H: int, L: int, S: int, Ep: int, cfg: BlockConfig, score_heads: int = 0):
    """The plan of ``mask``; ``score_heads`` > 0: with score terms, tiles of that many heads."""
    lo, hi = mask.row_intervals(L, S)  # type: ignore[misc]
    sizes = BlockSizes(N=N, H=H, L=L, S=S, Ep=Ep, itemsize=8, mask_heads=max(score_heads, 1), score_terms=score_heads > 0)
    return plan_intervals(lo, hi, sizes, cfg)


# documents(ids) has one length per document: with k_lengths it is covered by the varlen kinds
CASES = [(docs, kind) for docs in DOCUMENTS for kind in MASKS if not (kind == "documents&causal" and DOCUMENTS[docs][1])]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("docs", "kind"), CASES)
def test_causal_squares_match_the_reference(docs: str, kind: str, config: str) -> None:
    q_lengths, k_lengths = DOCUMENTS[docs]
    mask = MASKS[kind](q_lengths, k_lengths)
    L, S = sum(q_lengths), sum(k_lengths or q_lengths)
    N, H, G, E, Ev, scale = 1, 4, 2, 59, 16, 0.3
    plan = _plan(mask, N, H, L, S, max(E, Ev), CONFIGS[config])
    assert any(c.causal for c in plan.calls)  # the path under test runs
    check_engine(mask, plan, _problem(N, H, G, L, S, E, Ev), scale, heads=[1, 3], rows=[L - 1, 0, q_lengths[0], L // 2])


def test_a_causal_document_is_one_call_without_a_tile() -> None:
    lengths = [300, 1025, 17, 500]
    mask = M.varlen(torch.tensor(lengths), causal=True)
    plan = _plan(mask, 1, 8, sum(lengths), sum(lengths), 64, BlockConfig())
    assert [(c.q0, c.q_len, c.k0, c.width) for c in plan.calls] == [(0, 300, 0, 300), (300, 1025, 300, 1025),
                                                                    (1325, 17, 1325, 17), (1342, 500, 1342, 500)]
    assert all(c.causal and not c.masked and not c.merge for c in plan.calls)
    # the lower triangles only, the pairs the kernel computes
    assert plan.computed_pairs() == sum(n * (n + 1) // 2 for n in lengths)


def test_score_terms_keep_their_tiles() -> None:
    """With a bias every call carries a per-head tile anyway: no causal squares, same result."""
    lengths = torch.tensor([40, 97, 1])
    mask = M.varlen(lengths, causal=True)
    L = int(lengths.sum())
    plan = _plan(mask, 1, 2, L, L, 8, BlockConfig(), score_heads=2)
    assert not any(c.causal for c in plan.calls)
    q, k, v, _ = _problem(1, 2, 2, L, L, 8, 8)
    got = qkv.attention(q, k, v, mask, bias=qkv.bias.alibi(), backend="blocks")
    want = qkv.attention(q, k, v, mask, bias=qkv.bias.alibi(), backend="math")
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_gradient_of_a_broadcast_output_gradient(dtype: torch.dtype) -> None:
    """out.sum() gives a broadcast (stride 0) gradient: each call copies only its own rows."""
    mask = M.varlen(torch.tensor([50, 31]), causal=True)
    q, k, v, _ = _problem(1, 2, 2, 81, 81, 8, 8, dtype=dtype)
    q.requires_grad_(True)
    qkv.attention(q, k, v, mask, backend="blocks").sum().backward()
    _, ref_grads = _reference(q.detach(), k, v, mask, torch.ones(1, 2, 81, 8, dtype=torch.float64), 0.125 ** 0.5)
    assert q.grad is not None and q.grad.dtype == dtype
    # bf16: the engine's backward runs in float32 on exact copies; only the inputs are rounded
    np.testing.assert_allclose(q.grad.double().numpy(), ref_grads[0], atol=1e-10 if dtype == torch.float64 else 0.05)
