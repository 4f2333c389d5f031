"""BlockLayout and the tile-state helpers of qkv.masks._layout, against counts made by hand."""

from __future__ import annotations

import torch

from qkv.masks import EMPTY, FULL, PARTIAL, BlockLayout
from qkv.masks._layout import block_bounds, compose_states, states_from_dense, states_from_intervals


def test_block_bounds_cut_the_last_block_short() -> None:
    first, last = block_bounds(10, 4)
    assert first.tolist() == [0, 4, 8] and last.tolist() == [3, 7, 9]


def test_compose_states_truth_table() -> None:
    all_visible = torch.tensor([True, False, False])
    any_visible = torch.tensor([True, True, False])
    assert compose_states(all_visible, any_visible).tolist() == [FULL, PARTIAL, EMPTY]


def test_states_from_dense_by_hand() -> None:
    # 3 x 5 mask, tiles of 2 x 3: rows {0, 1} and {2}, keys {0, 1, 2} and {3, 4}
    visible = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    states = states_from_dense(visible[None, None], 2, 3)[0, 0]
    assert states.tolist() == [[FULL, PARTIAL], [EMPTY, EMPTY]]


def test_visited_pairs_count_edge_tiles_by_their_true_size() -> None:
    # L = 5, S = 7, tiles of 4 x 4: tile areas 16, 12 (first row of tiles), 4, 3 (last row)
    states = torch.tensor([[[[FULL, EMPTY], [PARTIAL, FULL]]]], dtype=torch.uint8)
    layout = BlockLayout(states, 5, 7, 4, 4)
    assert layout.visited_pairs() == 16 + 4 + 3
    assert layout.count(EMPTY) == 1 and layout.visited_block_fraction == 0.75


def test_states_from_intervals_equal_the_states_of_the_dense_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    B, L, S = 3, 23, 19
    for bq, bk in ((1, 1), (4, 4), (5, 3), (32, 32)):
        lo = torch.randint(-2, S, (B, L), generator=gen)
        hi = lo + torch.randint(-3, 8, (B, L), generator=gen)  # lo > hi: a row with no key
        keys = torch.arange(S)
        visible = (keys >= lo[:, :, None]) & (keys <= hi[:, :, None])  # (B, L, S)
        want = states_from_dense(visible[:, None], bq, bk)  # (B, 1, nQ, nK)
        got = states_from_intervals(lo.clamp(min=0), hi.clamp(max=S - 1), S, bq, bk)
        # FULL is exact (every row covers the tile); EMPTY is never wrong, but rows whose
        # intervals leave a hole between them may make an empty tile PARTIAL (sound)
        assert torch.equal(got == FULL, want == FULL)
        assert not ((got == EMPTY) & (want != EMPTY)).any()
        assert ((got == want) | (got == PARTIAL)).all()
        assert (got == want).float().mean() > 0.5  # most tiles come out exact
