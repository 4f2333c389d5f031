"""Heatmaps: the pixels and labels drawn are the Inspection's numbers and tokens; files are valid."""

from __future__ import annotations

import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from matplotlib import font_manager, ft2font
from tests.viz._inspections import HOSTILE_TOKENS, make_inspection

from qkv.viz import heatmap, heatmap_grid, save_heatmap
from qkv.viz.heatmaps import MAX_LABEL_CHARS, MAX_LABELS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _labels(ax, axis: str) -> list[str]:
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [tick.get_text() for tick in ticks]


def test_one_head_shows_its_weights_with_token_labels(small) -> None:
    fig = heatmap(small, layer=1, head=2)
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), small.attentions[1, 2].numpy())
    assert _labels(ax, "y") == small.tokens  # queries are rows
    assert _labels(ax, "x") == small.tokens  # keys are columns
    assert len(fig.axes) == 2  # the map and its colourbar


def test_hostile_tokens_are_drawn_literally() -> None:
    inspection = make_inspection([[token] for token in HOSTILE_TOKENS if token.isprintable()])
    fig = heatmap(inspection, layer=0, head=0)
    fig.canvas.draw()  # mathtext would raise or rewrite "$x$" here
    labels = _labels(fig.axes[0], "x")
    assert labels == inspection.tokens
    assert all(not tick.get_parse_math() for tick in fig.axes[0].get_xticklabels())


def test_labels_stay_one_short_line() -> None:
    long_token = "x" * 40
    inspection = make_inspection([["a\nb"], [long_token], ["\u2028"]], layers=1, heads=1)
    fig = heatmap(inspection)
    fig.canvas.draw()
    assert _labels(fig.axes[0], "y")[1:4] == ["a\\nb", "x" * (MAX_LABEL_CHARS - 1) + "…", "\\u2028"]


def test_grid_has_every_head_on_one_shared_scale(small) -> None:
    fig = heatmap_grid(small, layer=0)
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(small.num_heads)]
    for h, ax in enumerate(panels):
        np.testing.assert_allclose(ax.images[0].get_array(), small.attentions[0, h].numpy())
    top = float(small.attentions[0].max())
    assert [ax.images[0].norm.vmin for ax in panels] == [0.0] * small.num_heads
    assert [ax.images[0].norm.vmax for ax in panels] == pytest.approx([top] * small.num_heads)
    colorbars = [ax for ax in fig.axes if not ax.images and ax.get_label() == "<colorbar>"]
    assert len(colorbars) == 1


def test_word_level_and_head_mean(small) -> None:
    words = heatmap(small, layer=1, head=0, words=True).axes[0]
    assert _labels(words, "y") == small.words
    np.testing.assert_allclose(
        words.images[0].get_array(), small.word_attentions()[1, 0].numpy(), rtol=1e-6
    )
    mean = heatmap(small, layer=1, head="mean").axes[0]
    np.testing.assert_allclose(
        mean.images[0].get_array(), small.attentions[1].mean(0).numpy(), rtol=1e-6
    )


def test_raw_cross_attention_with_labels() -> None:
    weights = torch.softmax(torch.randn(2, 3, 5), dim=-1)  # (H, L, S): 3 queries, 5 keys
    queries, keys = ["q0", "q1", "q2"], ["a", "b", "c", "d", "e"]
    fig = heatmap_grid(weights, labels=queries, key_labels=keys)
    first = fig.axes[0]
    assert _labels(first, "y") == queries
    assert first.images[0].get_array().shape == (3, 5)
    second = heatmap(weights.numpy(), head=1, labels=queries, key_labels=keys).axes[0]
    assert _labels(second, "x") == keys
    np.testing.assert_allclose(second.images[0].get_array(), weights[1].numpy())


@pytest.mark.parametrize(
    ("source", "options", "message"),
    [
        (np.ones((3, 3)), {"labels": ["a", "b"]}, "need 3 query labels"),
        (np.ones(3), {}, "must have shape"),
        (np.ones((3, 3)), {"words": True}, "needs an Inspection"),
        (np.ones((2, 3, 3)), {"head": 2}, "head must be"),
        (np.ones((2, 2, 3, 3)), {"layer": 5}, "layer 5 is out of range"),
    ],
)
def test_bad_arguments_are_named(source, options, message) -> None:
    with pytest.raises(ValueError, match=message):
        heatmap(source, **options)


def test_long_input_labels_every_kth_token() -> None:
    inspection = make_inspection([[f"w{i}"] for i in range(198)], layers=1, heads=1)  # T = 200
    ax = heatmap(inspection).axes[0]
    positions = [int(p) for p in ax.get_xticks()]
    assert 1 < len(positions) <= MAX_LABELS
    assert _labels(ax, "x") == [inspection.tokens[p] for p in positions]


def test_png_has_the_figure_size_times_dpi(small, tmp_path) -> None:
    fig = heatmap(small, layer=0, head=1)
    path = tmp_path / "map.png"
    fig.savefig(path, dpi=80)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    expected = np.round(fig.get_size_inches() * 80).astype(int)
    assert (width, height) == tuple(expected)


def test_svg_grid_parses_and_has_the_figure_size(small, tmp_path) -> None:
    path = save_heatmap(small, tmp_path / "out" / "grid.svg", layer=1, head=None)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    expected = heatmap_grid(small, layer=1).get_size_inches() * 72  # SVG sizes are in points
    assert float(root.get("width").removesuffix("pt")) == pytest.approx(expected[0], abs=0.01)
    assert float(root.get("height").removesuffix("pt")) == pytest.approx(expected[1], abs=0.01)


# DejaVu Sans has no CJK glyphs: without the shipped CJK font matplotlib would draw boxes and warn
# "Glyph ... missing from font", which filterwarnings = error turns into a failure here.
@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_cjk_tokens_are_drawn_with_a_font_that_has_them(tmp_path, suffix: str) -> None:
    inspection = make_inspection([["我"], ["吃"], ["苹", "##果"]], layers=1, heads=2)
    path = save_heatmap(inspection, tmp_path / f"apple{suffix}", head=0, dpi=50)
    assert path.stat().st_size > 0
    assert _labels(heatmap(inspection).axes[0], "y") == inspection.tokens
    fig = heatmap(np.eye(2), labels=["苹果", "吃"])
    fig.savefig(tmp_path / f"labels{suffix}", dpi=50)  # draws the labels: no glyph may be missing
    families = fig.axes[0].get_yticklabels()[0].get_fontfamily()
    has_glyphs = []
    for family in families:
        path = font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
        font = ft2font.FT2Font(path)
        has_glyphs.append(all(font.get_char_index(ord(ch)) != 0 for ch in "苹果吃我한국"))
    assert any(has_glyphs), families


def test_the_shipped_cjk_font_is_registered() -> None:
    from qkv.viz.fonts import CJK_FAMILY, label_families, register_cjk_font

    assert register_cjk_font() == CJK_FAMILY
    assert label_families()[:2] == ["DejaVu Sans", CJK_FAMILY]


def test_no_pyplot_and_no_needless_imports() -> None:
    code = (
        "import io, sys, numpy as np, qkv.viz as v\n"
        "v.html\n"
        "assert 'matplotlib' not in sys.modules, 'the HTML viewer imported matplotlib'\n"
        "v.heatmap(np.eye(3)).savefig(io.BytesIO())\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot was imported'\n"
        "assert 'torch' not in sys.modules, 'a heatmap of a NumPy array imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
