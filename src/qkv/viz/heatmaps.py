"""Attention heatmaps with matplotlib's object API (a `Figure` on an Agg canvas, no pyplot state).

One head, or every head of a layer on one shared colour scale with one colourbar. Queries are
rows, keys are columns, as in the weights matrix softmax(Q K^T / sqrt(E)) of the seed articles.
Save with ``fig.savefig("map.png")`` or ``.svg``, or with `save_heatmap`.

Token text is drawn literally: mathtext is switched off, so a token such as ``$x$`` or
``\\alpha`` shows as typed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qkv.viz.fonts import label_families

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.image import AxesImage

    from qkv.inspect.inspection import Inspection

__all__ = ["heatmap", "heatmap_grid", "save_heatmap"]

Head = int | Literal["mean"]

CMAP = "Blues"
MAX_LABELS = 64  # beyond this many tokens on an axis, label every k-th one so labels stay legible
GRID_MAX_LABELS = 24  # the grid's panels are smaller
MAX_LABEL_CHARS = 32  # a longer token label is cut, so that the heatmap keeps its room


@dataclass(frozen=True)
class _Maps:
    """What a heatmap shows: weights (H, L, S) and the labels of the L queries and S keys."""

    weights: np.ndarray
    queries: list[str]
    keys: list[str]
    title: str


def heatmap(
    source: Inspection | np.ndarray | object,
    *,
    layer: int = 0,
    head: Head = 0,
    words: bool = False,
    labels: list[str] | None = None,
    key_labels: list[str] | None = None,
    vmax: float | None = None,
    cmap: str = CMAP,
) -> Figure:
    """One head's attention weights as a heatmap: row i = query i, column j = key j.

    Args:
        source: an `Inspection`, or raw weights as a tensor / array of shape (L, S),
            (H, L, S) or (layers, H, L, S).
        layer: which layer of an Inspection or of a 4-d array.
        head: which head, or ``"mean"`` for the average over the layer's heads.
        words: for an Inspection, attention between words instead of tokens.
        labels: query labels (L); default the Inspection's tokens / words, else indices.
        key_labels: key labels (S); default ``labels`` when L == S.
        vmax: top of the colour scale; default the largest weight shown.
        cmap: a matplotlib colormap name.
    """
    maps = _select(source, layer=layer, words=words, labels=labels, key_labels=key_labels)
    weights, name = _pick_head(maps, head)
    side_l, side_s = _panel_inches(len(maps.queries), len(maps.keys), single=True)
    margin_w, margin_h = _label_inches(maps.queries), _label_inches(maps.keys)
    fig = Figure(figsize=(side_s + margin_w + 1.4, side_l + margin_h + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = _draw_panel(
        ax, weights, maps, vmax=_top(weights, vmax), cmap=cmap, max_labels=MAX_LABELS
    )
    ax.set_title(f"{maps.title}{name}", fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
    return fig


def heatmap_grid(
    source: Inspection | np.ndarray | object,
    *,
    layer: int = 0,
    words: bool = False,
    labels: list[str] | None = None,
    key_labels: list[str] | None = None,
    vmax: float | None = None,
    cmap: str = CMAP,
    ncols: int | None = None,
) -> Figure:
    """Every head of one layer side by side, on one shared colour scale with one colourbar.

    Arguments as in `heatmap`; ``ncols`` panels per row (default about sqrt(H), 4 for 12 heads).
    Token labels sit on the left column and the bottom row.
    """
    maps = _select(source, layer=layer, words=words, labels=labels, key_labels=key_labels)
    H = maps.weights.shape[0]
    cols = ncols or min(H, max(1, math.ceil(math.sqrt(H))))
    nrows = math.ceil(H / cols)
    side_l, side_s = _panel_inches(len(maps.queries), len(maps.keys), single=False)
    margin_w, margin_h = _label_inches(maps.queries), _label_inches(maps.keys)
    # Panels get a little room each for their titles; labels only on the left and bottom edges.
    width = cols * (side_s + 0.15) + margin_w + 1.4
    fig = Figure(figsize=(width, nrows * (side_l + 0.35) + margin_h + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, cols, squeeze=False)
    top = _top(maps.weights, vmax)
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.set_axis_off()  # an empty slot in the last row
            continue
        image = _draw_panel(
            ax, maps.weights[h], maps, vmax=top, cmap=cmap, max_labels=GRID_MAX_LABELS
        )
        ax.set_title(f"head {h}", fontsize=9)
        if h % cols != 0:  # labels once per row and column of panels
            ax.set_yticklabels([])
            ax.set_ylabel("")
        if h + cols < H:
            ax.set_xticklabels([])
            ax.set_xlabel("")
    fig.suptitle(maps.title.rstrip(", "), fontsize=11)
    assert image is not None  # H >= 1: at least one panel was drawn
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight (shared scale)")
    return fig


def save_heatmap(
    source: Inspection | np.ndarray | object,
    path: str | Path,
    *,
    layer: int = 0,
    head: Head | None = None,
    words: bool = False,
    dpi: int = 150,
) -> Path:
    """Write `heatmap` (one head) or, with ``head=None``, `heatmap_grid` (all heads) to ``path``.

    The format follows the suffix (``.png``, ``.svg``, ``.pdf``). Returns the path written.
    """
    path = Path(path)
    if head is None:
        fig = heatmap_grid(source, layer=layer, words=words)
    else:
        fig = heatmap(source, layer=layer, head=head, words=words)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def _select(
    source: object,
    *,
    layer: int,
    words: bool,
    labels: list[str] | None,
    key_labels: list[str] | None,
) -> _Maps:
    """Normalize an Inspection or raw weights to one layer's maps (H, L, S) with labels."""
    # An Inspection can only exist once qkv.inspect (and torch) is loaded; raw arrays need neither.
    inspect_module = sys.modules.get("qkv.inspect")
    if inspect_module is not None and isinstance(source, inspect_module.Inspection):
        inspection = cast("Inspection", source)  # the module was found by name, so its class is opaque
        attentions = inspection.word_attentions() if words else inspection.attentions
        stack = np.asarray(attentions.detach().cpu().float().numpy())  # (layers, H, T, T)
        default = inspection.words if words else list(inspection.tokens)
        title = f"{inspection.model_name + ' · ' if inspection.model_name else ''}layer {layer}, "
    else:
        if words:
            raise ValueError("words=True needs an Inspection (it knows the word boundaries)")
        stack = _as_array(source)
        default = None
        title = "" if stack.ndim < 4 else f"layer {layer}, "
    if stack.ndim == 4:
        if not 0 <= layer < stack.shape[0]:
            raise ValueError(f"layer {layer} is out of range for {stack.shape[0]} layers")
        stack = stack[layer]  # (H, L, S)
    elif stack.ndim == 2:
        stack = stack[None]  # (1, L, S)
    elif stack.ndim != 3:
        raise ValueError(
            f"attention weights must have shape (L, S), (H, L, S) or (layers, H, L, S); got {tuple(stack.shape)}"
        )
    _, L, S = stack.shape
    queries = list(labels) if labels is not None else (default or [str(i) for i in range(L)])
    if key_labels is not None:
        keys = list(key_labels)
    elif default is not None or (labels is not None and L == S):
        keys = queries
    else:
        keys = [str(j) for j in range(S)]
    if len(queries) != L or len(keys) != S:
        raise ValueError(
            f"weights of shape (L={L}, S={S}) need {L} query labels and {S} key labels; "
            f"got {len(queries)} and {len(keys)}"
        )
    return _Maps(stack, queries, keys, title)


def _as_array(source: object) -> np.ndarray:
    if callable(getattr(source, "detach", None)):  # a torch tensor; read without importing torch here
        tensor: Any = source
        source = tensor.detach().cpu().float().numpy()
    return np.asarray(source, dtype=np.float32)


def _pick_head(maps: _Maps, head: Head) -> tuple[np.ndarray, str]:
    H = maps.weights.shape[0]
    if head == "mean":
        return maps.weights.mean(axis=0), f"mean of {H} heads"
    if not isinstance(head, int) or not 0 <= head < H:
        raise ValueError(f"head must be 'mean' or an int in [0, {H}); got {head!r}")
    return maps.weights[head], (f"head {head}" if H > 1 or maps.title else "attention weights")


def _top(weights: np.ndarray, vmax: float | None) -> float:
    """Top of the colour scale: the largest weight shown (never 0, so an all-zero map draws)."""
    if vmax is not None:
        return float(vmax)
    return max(float(np.nanmax(weights)) if weights.size else 0.0, 1e-6)


def _panel_inches(L: int, S: int, *, single: bool) -> tuple[float, float]:
    """Height and width of one panel: about a label's height per token, within readable bounds."""
    per_token, low, high = (0.22, 2.5, 12.0) if single else (0.12, 1.6, 3.2)
    return min(max(L * per_token, low), high), min(max(S * per_token, low), high)


def _label_inches(labels: list[str]) -> float:
    """Room for a column of tick labels (or a row, rotated) plus the axis title."""
    longest = max((len(_one_line(label)) for label in labels), default=1)
    return 0.45 + longest * 8 * 0.6 / 72  # ~0.6 em per character at 8 pt


def _draw_panel(
    ax: Axes, weights: np.ndarray, maps: _Maps, *, vmax: float, cmap: str, max_labels: int
) -> AxesImage:
    image = ax.imshow(
        weights, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest"
    )
    _label_axis(ax, "y", maps.queries, max_labels)
    _label_axis(ax, "x", maps.keys, max_labels)
    ax.set_ylabel("query", fontsize=8)
    ax.set_xlabel("key", fontsize=8)
    return image


def _label_axis(ax: Axes, axis: Literal["x", "y"], labels: list[str], max_labels: int) -> None:
    step = max(1, math.ceil(len(labels) / max_labels))
    positions = list(range(0, len(labels), step))
    text = [_one_line(labels[i]) for i in positions]
    size = 8 if len(positions) <= 24 else 6
    # parse_math=False: a token is text, never mathtext ("$x$" must not turn into italics).
    # label_families: DejaVu Sans, then the CJK font qkv ships, so 苹果 is drawn, not boxes
    options: dict[str, Any] = {"fontsize": size, "parse_math": False, "fontfamily": label_families()}
    if axis == "x":
        ax.set_xticks(positions, labels=text, rotation=90, **options)
    else:
        ax.set_yticks(positions, labels=text, **options)


def _one_line(label: str) -> str:
    """A tick label: one line (control characters such as a "\\n" token are shown escaped),
    at most MAX_LABEL_CHARS characters (longer ones end in "…")."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in label)
    return text if len(text) <= MAX_LABEL_CHARS else text[: MAX_LABEL_CHARS - 1] + "…"

