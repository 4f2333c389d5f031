"""Fonts for heatmap labels: matplotlib's DejaVu Sans, then a CJK font that qkv ships.

DejaVu Sans has no Chinese, Japanese or Korean glyphs, so tokens such as 苹果 would be drawn as
empty boxes. qkv depends on the PyPI package ``noto-cjk-sans-jp-regular``, which carries Noto
Sans CJK JP Regular (Google's Noto CJK, SIL Open Font License 1.1, free to redistribute); its
glyph set covers the CJK Unified Ideographs of all regions, simplified Chinese included (the
"JP" names the default glyph shapes, not the coverage). `label_families` registers it with
matplotlib's font manager on first use and returns the fallback list for labels: matplotlib
draws each character with the first family in the list that has it.
"""

from __future__ import annotations

import functools

from matplotlib import font_manager

__all__ = ["CJK_FAMILY", "label_families", "register_cjk_font"]

BASE_FAMILY = "DejaVu Sans"  # matplotlib's own default, Latin, Greek, Cyrillic and symbols
CJK_FAMILY = "Noto Sans CJK JP"  # the family name inside the shipped font file
# Other CJK families that a system may have installed, used after the shipped one.
SYSTEM_CJK_FAMILIES = ("Noto Sans CJK SC", "WenQuanYi Zen Hei", "Droid Sans Fallback")


@functools.cache
def register_cjk_font() -> str | None:
    """Add the shipped CJK font to matplotlib's font manager (once); its family name, or None
    if the font package is missing (a broken install): labels then fall back to system fonts."""
    try:
        import noto_cjk_sans_jp_regular
    except ImportError:
        return None
    font_manager.fontManager.addfont(str(noto_cjk_sans_jp_regular.FONT_PATH))
    return CJK_FAMILY


def label_families() -> list[str]:
    """The font families for token labels, in fallback order, all of them installed."""
    register_cjk_font()
    installed = {entry.name for entry in font_manager.fontManager.ttflist}
    return [BASE_FAMILY, *(f for f in (CJK_FAMILY, *SYSTEM_CJK_FAMILIES) if f in installed)]
