"""A drawing of a `qkv.masks` object: which (query, key) pairs it allows, and its tiles.

The score matrix is cut into tiles of ``block_q`` queries x ``block_k`` keys (see
`qkv.masks.BlockLayout`). Each tile is coloured by its state: full (computed without a mask),
partial (computed with the mask's slice) or empty (skipped, the work a block-sparse kernel
saves). On top, every visible pair is a dark dot, as long as the matrix is small enough to
draw point by point. Queries are rows, keys are columns, as in `heatmap`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

if TYPE_CHECKING:
    from qkv.masks import Mask

__all__ = ["draw_mask"]

# Tile colours, indexed by state EMPTY = 0, PARTIAL = 1, FULL = 2 (qkv.masks).
TILE_COLOURS = ("#f1f3f5", "#f6c28b", "#8fc5a0")
TILE_NAMES = ("empty (skipped)", "partial (masked)", "full (no mask)")
POINT_COLOUR = "#1f2933"
POINT_ALPHA = 0.6  # the tile colour shows through the visible pairs
MAX_POINTS = 1 << 22  # above L x S = 4M the visible pairs are not drawn, only the tiles
MAX_TILES_PER_SIDE = 16  # the default tile size keeps the drawing at most this many tiles wide


def draw_mask(
    mask: Mask,
    L: int,
    S: int | None = None,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    batch: int = 0,
    head: int = 0,
) -> Figure:
    """Draw ``mask`` for L queries and S keys (default S = L) with its tiles.

    Args:
        mask: a `qkv.masks` object (``causal()``, ``sliding_window(4)`` & ..., ``dense(t)``).
        L, S: query and key lengths.
        block_q, block_k: tile size; default the smallest power of two that keeps at most
            16 tiles a side (pass 128 for FlexAttention's tiles, or block_q=192, block_k=64
            for the layout grid of the CPU block engine, which groups rows into its own items).
        batch, head: which batch row and head, for masks that differ across them.
    """
    from qkv.masks import Mask  # torch is needed here, not for heatmaps of NumPy arrays

    if not isinstance(mask, Mask):
        raise TypeError(
            f"draw_mask needs a qkv.masks object, got {type(mask).__name__}; "
            "wrap a bool tensor with qkv.masks.dense(tensor)"
        )
    S = L if S is None else S
    auto = 1 << max(0, math.ceil(math.log2(max(L, S) / MAX_TILES_PER_SIDE)))
    block_q = block_q or auto
    block_k = block_k or block_q
    layout = mask.layout(L, S, block_q, block_k)
    b, h = min(batch, layout.states.shape[0] - 1), min(head, layout.states.shape[1] - 1)
    states = layout.states[b, h].numpy()  # (nQ, nK)

    fig = Figure(figsize=(6.4, max(2.5, min(6.4, 6.4 * L / S)) + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    n_q, n_k = states.shape
    # The padded tile grid covers n_q * block_q rows; the axis limits cut it back to L x S.
    ax.imshow(
        states,
        cmap=ListedColormap(TILE_COLOURS),
        vmin=0,
        vmax=2,
        extent=(0, n_k * block_k, n_q * block_q, 0),
        interpolation="nearest",
        aspect="auto",
    )
    if L * S <= MAX_POINTS:
        dense = mask.to_dense(L, S)  # (B | 1, H | 1, L, S)
        visible = dense[min(batch, dense.shape[0] - 1), min(head, dense.shape[1] - 1)].numpy()
        points = np.zeros((L, S, 4))  # RGBA: transparent where hidden, dark where visible
        points[visible] = to_rgba(POINT_COLOUR, alpha=POINT_ALPHA)
        ax.imshow(points, extent=(0, S, L, 0), interpolation="nearest", aspect="auto")
    ax.set_xticks(np.arange(0, S + 1, block_k), minor=True)
    ax.set_yticks(np.arange(0, L + 1, block_q), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xlim(0, S)
    ax.set_ylim(L, 0)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"{layout.name}: L={L}, S={S}, tiles of {block_q} x {block_k}", fontsize=10)

    counts = [int((states == state).sum()) for state in range(3)]
    handles = [
        Patch(facecolor=colour, edgecolor="#999", label=f"{name}: {count}")
        for colour, name, count in zip(TILE_COLOURS, TILE_NAMES, counts, strict=True)
    ]
    if L * S <= MAX_POINTS:
        handles.append(
            Patch(facecolor=POINT_COLOUR, alpha=POINT_ALPHA, label="visible (query, key)")
        )
    visited = 1 - counts[0] / states.size
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=2,
        fontsize=8,
        title=f"{visited:.0%} of tiles visited",
        title_fontsize=8,
    )
    return fig
