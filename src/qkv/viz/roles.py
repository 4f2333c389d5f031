"""The head-role grid: one cell per (layer, head), coloured by the role that gets the largest
share of its attention (`qkv.inspect.HeadRoles`), with that share written in the cell.

Rows are layers (0 at the top), columns heads, both numbered from 0 as everywhere in qkv. A
legend names the colours. Drawn with matplotlib's object API (no pyplot state).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from qkv.inspect.roles import ROLE_TEXT, ROLES

if TYPE_CHECKING:
    from qkv.inspect.inspection import HeadRoles

__all__ = ["ROLE_COLOURS", "role_grid", "save_role_grid"]

# One colour per role of ROLES, distinguishable in print and for the common colour blindness.
ROLE_COLOURS = {
    "previous": "#1d4ed8",
    "next": "#0891b2",
    "self": "#7c3aed",
    "cls": "#c2410c",
    "sep": "#ca8a04",
    "punctuation": "#15803d",
    "rest": "#9ca3af",
}


def role_grid(roles: HeadRoles, *, title: str = "") -> Figure:
    """The layers x heads grid of dominant roles, each cell labelled with its share in %."""
    dominant = roles.dominant().numpy()  # (layers, heads)
    shares = roles.shares.numpy()  # (layers, heads, roles)
    layers, heads = dominant.shape
    fig = Figure(figsize=(1.0 + 0.62 * heads, 1.4 + 0.5 * layers), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = ListedColormap([ROLE_COLOURS[role] for role in ROLES])
    ax.imshow(dominant, cmap=cmap, vmin=-0.5, vmax=len(ROLES) - 0.5, aspect="auto")
    for layer in range(layers):
        for head in range(heads):
            share = shares[layer, head, dominant[layer, head]]
            ax.text(head, layer, f"{100 * share:.0f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_xticks(np.arange(heads), [str(h) for h in range(heads)])
    ax.set_yticks(np.arange(layers), [str(layer) for layer in range(layers)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title or f"dominant role of each head (% of its attention), {roles.texts} text(s)", fontsize=10)
    handles = [Patch(color=ROLE_COLOURS[role], label=ROLE_TEXT[role]) for role in ROLES]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    return fig


def save_role_grid(roles: HeadRoles, path: str | Path, *, title: str = "", dpi: int = 150) -> Path:
    """Write `role_grid` to ``path`` (format from the suffix: .png, .svg, .pdf); return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    role_grid(roles, title=title).savefig(path, dpi=dpi)
    return path
