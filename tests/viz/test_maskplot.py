"""`draw_mask`: the tiles and points drawn are the mask's, worked out here independently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv.masks as masks
from qkv.viz import draw_mask
from qkv.viz.maskplot import MAX_POINTS

EMPTY, PARTIAL, FULL = 0, 1, 2


def expected_tiles(visible: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """Tile states from a bool (L, S) matrix, by looking at every tile."""
    L, S = visible.shape
    rows, cols = range(0, L, block_q), range(0, S, block_k)
    tiles = np.empty((len(rows), len(cols)), dtype=int)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            tile = visible[r : r + block_q, c : c + block_k]
            tiles[i, j] = FULL if tile.all() else PARTIAL if tile.any() else EMPTY
    return tiles


def test_causal_tiles_and_points() -> None:
    L = S = 64
    fig = draw_mask(masks.causal(), L, block_q=16)
    ax = fig.axes[0]
    tiles, points = ax.images
    lower = np.tril(np.ones((L, S), dtype=bool))  # causal with L == S: key <= query
    np.testing.assert_array_equal(tiles.get_array(), expected_tiles(lower, 16, 16))
    np.testing.assert_array_equal(points.get_array()[..., 3] > 0, lower)
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels[:3] == ["empty (skipped): 6", "partial (masked): 4", "full (no mask): 6"]
    assert fig.legends[0].get_title().get_text() == "62% of tiles visited"


def test_sliding_window_with_more_keys_than_queries() -> None:
    L, S, left = 24, 40, 5
    fig = draw_mask(masks.sliding_window(left), L, S, block_q=8, block_k=16)
    tiles, points = fig.axes[0].images
    position = np.arange(L)[:, None] + S - L  # bottom-right: query i sits at S - L + i
    key = np.arange(S)[None, :]
    window = (key <= position) & (key >= position - left)
    np.testing.assert_array_equal(points.get_array()[..., 3] > 0, window)
    np.testing.assert_array_equal(tiles.get_array(), expected_tiles(window, 8, 16))
    assert fig.axes[0].get_xlim() == (0, S)


def test_per_batch_documents_and_default_tiles() -> None:
    ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 30 + [1] * 2])  # two batch rows
    fig = draw_mask(masks.documents(ids), 32, batch=1)
    tiles, points = fig.axes[0].images
    same = (ids[1][:, None] == ids[1][None, :]).numpy()
    np.testing.assert_array_equal(points.get_array()[..., 3] > 0, same)
    np.testing.assert_array_equal(tiles.get_array(), expected_tiles(same, 2, 2))  # 32 / 16 a side


def test_large_problems_draw_tiles_only(tmp_path) -> None:
    L = 4096
    assert L * L > MAX_POINTS
    fig = draw_mask(masks.causal(), L, block_q=512)
    assert len(fig.axes[0].images) == 1
    fig.savefig(tmp_path / "causal.png", dpi=40)
    assert (tmp_path / "causal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_tensor_is_not_a_mask() -> None:
    with pytest.raises(TypeError, match=r"qkv\.masks\.dense"):
        draw_mask(torch.ones(4, 4, dtype=torch.bool), 4)
