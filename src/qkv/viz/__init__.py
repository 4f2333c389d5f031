"""Looking at attention: matplotlib heatmaps and a standalone HTML viewer.

- `heatmap` (one head), `heatmap_grid` (all heads of a layer, shared colour scale),
  `save_heatmap` (either, to PNG / SVG): see `qkv.viz.heatmaps`.
- `draw_mask`: which (query, key) pairs a `qkv.masks` object allows, and its blocks.
- `role_grid` / `save_role_grid`: every head coloured by its dominant role (`qkv.inspect.HeadRoles`).
- `html` (one self-contained file), `render` (its text), `render_inline` (a sandboxed iframe
  for Jupyter): see `qkv.viz.viewer`.

Names resolve lazily: writing the HTML viewer never imports matplotlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv._aliases import lazy_names

_EXPORTS: dict[str, str] = {
    "heatmap": "qkv.viz.heatmaps",
    "heatmap_grid": "qkv.viz.heatmaps",
    "save_heatmap": "qkv.viz.heatmaps",
    "draw_mask": "qkv.viz.maskplot",
    "role_grid": "qkv.viz.roles",
    "save_role_grid": "qkv.viz.roles",
    "html": "qkv.viz.viewer",
    "render": "qkv.viz.viewer",
    "render_inline": "qkv.viz.viewer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from qkv.viz.heatmaps import heatmap, heatmap_grid, save_heatmap
    from qkv.viz.maskplot import draw_mask
    from qkv.viz.roles import role_grid, save_role_grid
    from qkv.viz.viewer import html, render, render_inline

__getattr__ = lazy_names(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return __all__
