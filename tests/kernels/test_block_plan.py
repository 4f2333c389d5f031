"""The planner's sizes: named, checked, and never silently swapped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkv import masks as M
from qkv.backends.blocks.planner import (
    BlockConfig,
    BlockSizes,
    _plan_intervals,
    plan_intervals,
    plan_layout,
)


def test_sizes_are_keyword_only_and_checked() -> None:
    with pytest.raises(TypeError):
        BlockSizes(1, 2, 30, 50, 8, 4)  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"BlockSizes\.S must be a positive int, got 0"):
        BlockSizes(N=1, H=2, L=30, S=0, Ep=8, itemsize=4)
    with pytest.raises(ValueError, match=r"BlockSizes\.H"):
        BlockSizes(N=1, H=2.0, L=30, S=50, Ep=8, itemsize=4)  # type: ignore[arg-type]


def test_swapped_lengths_are_refused() -> None:
    mask = M.causal()
    L, S = 30, 50
    lo, hi = mask.row_intervals(L, S)  # type: ignore[misc]
    right = BlockSizes(N=1, H=2, L=L, S=S, Ep=8, itemsize=4)
    swapped = BlockSizes(N=1, H=2, L=S, S=L, Ep=8, itemsize=4)
    cfg = BlockConfig(block_q=16, block_k=16)
    assert plan_intervals(lo, hi, right, cfg).sizes == right
    with pytest.raises(ValueError, match=r"do not fit \(N \| 1, L\)"):
        plan_intervals(lo, hi, swapped, cfg)
    layout = mask.layout(L, S, 16, 16)
    assert plan_layout(layout, right, cfg).computed_pairs() > 0
    with pytest.raises(ValueError, match="a layout of 30x50 scores"):
        plan_layout(layout, swapped, cfg)


def test_batch_of_per_row_intervals_must_match_n() -> None:
    valid = torch.tensor([3, 7, 9])
    lo, hi = M.key_padding(valid).row_intervals(5, 9)  # type: ignore[misc]
    assert lo.shape[0] == 3
    cfg = BlockConfig(block_q=16, block_k=16)
    plan = plan_intervals(lo, hi, BlockSizes(N=3, H=2, L=5, S=9, Ep=8, itemsize=4), cfg)
    assert plan.computed_pairs() == 5 * (3 + 7 + 9)
    with pytest.raises(ValueError, match="do not fit"):
        plan_intervals(lo, hi, BlockSizes(N=2, H=3, L=5, S=9, Ep=8, itemsize=4), cfg)


def test_plans_of_recent_intervals_are_reused_by_their_exact_content() -> None:
    L = S = 300
    sizes = BlockSizes(N=1, H=2, L=L, S=S, Ep=8, itemsize=2, need_grad=False)
    cfg = BlockConfig(block_q=16, block_k=16)
    lo, hi = M.sliding_window(40, 7).row_intervals(L, S)  # type: ignore[misc]
    first = plan_intervals(lo, hi, sizes, cfg)
    assert plan_intervals(lo.clone(), hi.clone(), sizes, cfg) is first  # same intervals, new tensors
    # one key more on one row, other sizes or another config: planned anew
    wider = hi.clone()
    wider[0, 100] += 1
    other = plan_intervals(lo, wider, sizes, cfg)
    assert other is not first and other.computed_pairs() != first.computed_pairs()
    assert other.intervals is not None and int(other.intervals[1][0, 100]) == int(hi[0, 100]) + 1
    assert plan_intervals(lo, hi, dataclasses.replace(sizes, need_grad=True), cfg) is not first
    assert plan_intervals(lo, hi, sizes, BlockConfig(block_q=32, block_k=16)) is not first
    # each plan is the one planned without the cache
    for plan, ends in ((first, hi), (other, wider)):
        fresh = _plan_intervals(lo, ends, sizes, cfg)
        assert plan.calls == fresh.calls and plan.pieces == fresh.pieces
