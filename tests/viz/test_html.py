"""The viewer file without a browser: self-contained, safe to embed, and carrying the right numbers.

The browser tests (test_browser.py) check what the page draws; these check what the file holds.
"""

from __future__ import annotations

import base64
import hashlib
import html as html_text
import json
import re
import zlib

import numpy as np
import pytest
import torch
from tests.viz._inspections import HOSTILE_TOKENS, make_inspection

import qkv
from qkv.inspect import Inspection
from qkv.viz import html, render, render_inline
from qkv.viz.viewer import QUANT_LEVELS

DATA_BLOCK = re.compile(r'<script type="application/json" id="qkv-data">(.*?)</script>', re.S)


def _data(page: str) -> dict:
    blocks = DATA_BLOCK.findall(page)
    assert len(blocks) == 1
    return json.loads(blocks[0])


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


@pytest.fixture(scope="module")
def hostile():
    return make_inspection([[token] for token in HOSTILE_TOKENS], layers=2, heads=2)


def test_writes_one_self_contained_file(small, tmp_path) -> None:
    path = html(small, tmp_path / "sub" / "view.html")
    assert path == tmp_path / "sub" / "view.html"
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert "src=x" in page  # the hostile token is in the data block, as data ...
    page = DATA_BLOCK.sub("", page)  # ... and the markup and code around it load nothing:
    assert not re.search(r"<(link|iframe|img|object|embed)\b", page, re.I)
    assert not re.search(r"\b(src|href)\s*=", page, re.I)  # nothing to load, from anywhere
    assert not re.search(r"@import|url\(", page)
    assert len(re.findall(r"<script\b", page)) == 1  # the viewer itself, inline


def test_policy_allows_exactly_the_inline_script_and_style(small) -> None:
    page = render(small)
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page).group(1)
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    assert policy.split("; ") == [
        "default-src 'none'",
        f"script-src '{_sha256(script)}'",
        f"style-src '{_sha256(style)}'",
    ]


def test_hostile_tokens_cannot_leave_the_data_block(hostile) -> None:
    page = render(hostile)
    block = DATA_BLOCK.search(page).group(1)
    for forbidden in ("<", ">", "&", "\u2028", "\u2029"):
        assert forbidden not in block
    data = _data(page)
    assert data["tokens"] == hostile.tokens  # exactly the strings, after the round trip
    assert data["text"] == hostile.text
    assert data["words"] == hostile.words


def test_weights_are_the_inspections_within_one_quantization_step(small) -> None:
    data = _data(render(small))
    raw = zlib.decompress(base64.b64decode(data["weights"]))
    T = len(small.tokens)
    stored = np.frombuffer(raw, dtype=np.uint8).reshape(small.num_layers, small.num_heads, T, T)
    assert data["scale"] == QUANT_LEVELS
    error = np.abs(stored / QUANT_LEVELS - small.attentions.numpy())
    assert error.max() <= 0.5 / QUANT_LEVELS + 1e-6
    assert data["groups"] == small.groups
    assert (data["layers"], data["heads"]) == (small.num_layers, small.num_heads)


def test_size_for_128_tokens_stays_small(tmp_path) -> None:
    inspection = make_inspection([[f"w{i}"] for i in range(126)], layers=6, heads=12)  # T = 128
    size = html(inspection, tmp_path / "long.html").stat().st_size
    # 6 x 12 x 128 x 128 float32 weights are 4.7 MB raw; random maps are the hard case to compress.
    assert size < 600_000


def test_inline_form_is_a_sandboxed_srcdoc_iframe(hostile) -> None:
    fragment = render_inline(hostile)
    match = re.fullmatch(
        r'<iframe srcdoc="([^"]*)" sandbox="allow-scripts" ([^<>]*)></iframe>', fragment
    )
    assert match is not None
    assert "<" not in match.group(1)
    assert html_text.unescape(match.group(1)) == render(hostile)
    assert qkv._notebook_html(hostile) == fragment


def test_notebooks_show_an_inspection_as_the_viewer(hostile, monkeypatch) -> None:
    # IPython is not a dependency: a stand-in with the one method qkv calls records the hook
    import sys
    import types

    registered = {}

    class Formatter:
        def for_type_by_name(self, module, name, function):
            registered[(module, name)] = function

    shell = types.SimpleNamespace(display_formatter=types.SimpleNamespace(formatters={"text/html": Formatter()}))
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    qkv._show_inspections_in_notebooks()
    view = registered[(type(hostile).__module__, type(hostile).__qualname__)]
    assert view(hostile) == render_inline(hostile)


def test_attentions_must_match_the_tokens(small) -> None:
    broken = make_inspection([["a"]], layers=1, heads=1)
    object.__setattr__(broken, "attentions", torch.ones(1, 1, 4, 4) / 4)  # 3 tokens, 4 x 4 maps
    with pytest.raises(ValueError, match=r"\(layers, heads, 3, 3\) for 3 tokens"):
        render(broken)


def _hand_made_heads() -> Inspection:
    """[CLS] the cat sat [SEP], 3 layers x 3 heads, every row uniform except:
    layer 0 head 1 puts 0.9 of every row on [SEP] (a "no-op" head: faint lines everywhere),
    layer 1 head 0 puts 0.9 of every row on the query itself,
    layer 2 head 2 sends "sat" (token 3) 0.7 to "cat" (token 2), the others' rows 0.5 to "the".
    """
    T = 5
    attentions = torch.full((3, 3, T, T), 1 / T)  # (layers, heads, T, T)
    attentions[0, 1] = 0.1 / (T - 1)
    attentions[0, 1, :, 4] = 0.9
    attentions[1, 0] = 0.1 / (T - 1)
    attentions[1, 0, torch.arange(T), torch.arange(T)] = 0.9
    attentions[2, 2] = 0.5 / (T - 1)
    attentions[2, 2, :, 1] = 0.5 + 0.5 / (T - 1)
    attentions[2, 2, 3] = torch.tensor([0.1, 0.1, 0.7, 0.0, 0.1])
    tokens = ["[CLS]", "the", "cat", "sat", "[SEP]"]
    offsets = [(0, 0), (0, 3), (4, 7), (8, 11), (0, 0)]
    return Inspection("the cat sat", tokens, offsets, [None, 0, 1, 2, None], attentions, torch.zeros(4, T, 2))


def test_the_viewer_opens_on_the_head_that_looks_hardest_at_another_word() -> None:
    """By hand: each head's mean, over the query rows, of the largest weight on another word's
    token. Uniform heads: 0.2. [SEP] head 0 -> 0.1 / 4 = 0.025 ([SEP] does not count), self
    head: 0.025 (itself does not count). Layer 2 head 2, all word rows: "the" gives 0.625 to
    nothing else but 0.125 ("cat" or "sat"): (0.125 + 0.625 + 0.7) / 3 = 0.483; the best."""
    from qkv.viz.viewer import opening_head

    inspection = _hand_made_heads()
    assert opening_head(inspection) == (2, 2)
    assert opening_head(inspection, [3]) == (2, 2)  # "sat": 0.7 on "cat"
    assert opening_head(inspection, [3], layer=0) == (0, 0)  # uniform 0.2 beats [SEP]'s 0.025 and ties head 2
    assert opening_head(inspection, head=1) == (1, 1)  # layers 1 and 2 tie at 0.2: the first
    assert opening_head(inspection, layer=1, head=0) == (1, 0)  # both given: kept
    assert _data(render(inspection))["start"] == {"layer": 2, "head": 2}
    assert _data(render(inspection, layer=0, head=1))["start"] == {"layer": 0, "head": 1}
    with pytest.raises(ValueError, match="query must be a non-empty list of token indices in"):
        render(inspection, query=[5])
