"""The planner's sizes: named, checked, and never silently swapped."""

from __future__ import annotations

import pytest
import torch

from qkv import masks as M
from qkv.kernels.block_plan import BlockConfig, BlockSizes, plan_intervals, plan_layout


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
