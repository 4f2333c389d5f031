"""The HTML viewer in a real browser: headless Debian Chromium driven by Playwright.

What the page draws is read back from the DOM (each focus line carries data-query, data-key,
data-weight and its opacity) and compared with the numbers of the Inspection built by hand.
CI installs /usr/bin/chromium (.ci/run); without it these tests fail, they never skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import Browser
from tests.viz._browser import TOLERANCE, Viewer, assert_lines, open_viewer
from tests.viz._inspections import HOSTILE, HOSTILE_TOKENS, make_inspection

import qkv
from qkv.inspect import Inspection
from qkv.viz import html
from qkv.viz.viewer import QUANT_LEVELS

pytestmark = pytest.mark.browser

@pytest.fixture(scope="module")
def small_file(small: Inspection, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return html(small, tmp_path_factory.mktemp("viewer") / "small.html", layer=0, head=0)


@pytest.fixture
def viewer(browser: Browser, small_file: Path) -> Iterator[Viewer]:
    opened = open_viewer(browser, small_file)
    yield opened
    opened.page.close()


def test_page_loads_with_no_error_and_no_other_request(viewer: Viewer, small: Inspection) -> None:
    assert viewer.console == []
    assert viewer.requests == [viewer.url]  # the file itself, nothing else
    assert viewer.column("query") == small.tokens
    assert viewer.column("key") == small.tokens
    assert viewer.page.text_content("#text") == small.text
    assert int(viewer.page.get_attribute("#all-lines", "data-lines")) > 0
    assert viewer.lines() == []  # nothing focused yet


def test_hovering_a_query_shows_where_it_looks(viewer: Viewer, small: Inspection) -> None:
    viewer.hover("query", 3)
    assert viewer.view("focus") == "query:3"
    assert_lines(viewer.lines(), small.attentions[0, 0, 3].numpy(), query=3)
    shades = viewer.page.eval_on_selector_all(
        "#keys .token", "ts => ts.map(t => Number(t.dataset.weight))"
    )
    np.testing.assert_allclose(shades, small.attentions[0, 0, 3].numpy(), atol=TOLERANCE)


def test_hovering_a_key_shows_what_looks_at_it(viewer: Viewer, small: Inspection) -> None:
    viewer.hover("key", 5)
    assert viewer.view("focus") == "key:5"
    assert_lines(viewer.lines(), small.attentions[0, 0, :, 5].numpy(), key=5)


def test_switching_layer_and_head_changes_the_drawing(viewer: Viewer, small: Inspection) -> None:
    before = viewer.page.eval_on_selector("#all-lines", "c => c.toDataURL()")
    viewer.page.select_option("#layer", "1")
    viewer.page.select_option("#head", "2")
    assert (viewer.view("layer"), viewer.view("head")) == ("1", "2")
    assert viewer.page.eval_on_selector("#all-lines", "c => c.toDataURL()") != before
    viewer.hover("query", 2)
    assert_lines(viewer.lines(), small.attentions[1, 2, 2].numpy(), query=2)


def test_clicking_pins_a_token(viewer: Viewer, small: Inspection) -> None:
    viewer.page.click('#queries .token[data-index="4"]')
    viewer.page.mouse.move(1, 1)  # leave the token: the pinned one stays shown
    assert viewer.view("focus") == "query:4"
    assert_lines(viewer.lines(), small.attentions[0, 0, 4].numpy(), query=4)
    viewer.page.click('#queries .token[data-index="4"]')
    viewer.page.mouse.move(1, 1)
    assert viewer.lines() == []


def test_average_over_heads_shows_the_head_mean(viewer: Viewer, small: Inspection) -> None:
    viewer.page.select_option("#layer", "1")
    viewer.page.check("#average")
    assert viewer.view("head") == "mean"
    assert viewer.page.is_disabled("#head")
    viewer.hover("query", 1)
    assert_lines(viewer.lines(), small.attentions[1].mean(dim=0)[1].numpy(), query=1)


def test_word_toggle_draws_words(viewer: Viewer, small: Inspection) -> None:
    viewer.page.check("#words")
    assert viewer.view("level") == "words"
    assert viewer.column("query") == small.words
    trophy = small.words.index("trophy")  # two pieces: "tro", "##phy"
    viewer.hover("query", trophy)
    # A key word sums its pieces' stored weights, so the error grows with the pieces per word.
    pieces = max(len(group) for group in small.groups)
    expected = small.word_attentions()[0, 0, trophy].numpy()
    assert_lines(viewer.lines(), expected, query=trophy, tolerance=pieces * TOLERANCE)
    viewer.page.uncheck("#words")
    assert viewer.column("key") == small.tokens


def test_model_view_thumbnails_draw_every_head_and_open_it(
    viewer: Viewer, small: Inspection
) -> None:
    thumbs = viewer.page.eval_on_selector_all(
        ".thumb", "ts => ts.map(t => [t.dataset.layer, t.dataset.head])"
    )
    heads = [*map(str, range(small.num_heads)), "mean"]
    assert thumbs == [[str(layer), head] for layer in range(small.num_layers) for head in heads]
    # Pixel (query, key) of a thumbnail goes from white (weight 0) to dark blue: red = 255 - 247 w.
    red = viewer.page.eval_on_selector(
        '.thumb[data-layer="1"][data-head="2"]',
        "c => Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data).filter((_, i) => i % 4 === 0)",
    )
    T = len(small.tokens)
    expected = 255 - 247 * np.round(small.attentions[1, 2].numpy() * QUANT_LEVELS) / QUANT_LEVELS
    np.testing.assert_allclose(np.array(red).reshape(T, T), expected, atol=1.0)
    viewer.page.click('.thumb[data-layer="1"][data-head="2"]')
    assert (viewer.page.input_value("#layer"), viewer.page.input_value("#head")) == ("1", "2")
    viewer.hover("query", 6)
    assert_lines(viewer.lines(), small.attentions[1, 2, 6].numpy(), query=6)
    viewer.page.click('.thumb[data-layer="0"][data-head="mean"]')
    assert viewer.page.is_checked("#average")
    assert (viewer.view("layer"), viewer.view("head")) == ("0", "mean")


def test_hostile_tokens_render_as_text(browser: Browser, tmp_path: Path) -> None:
    inspection = make_inspection([[token] for token in HOSTILE_TOKENS], layers=1, heads=2)
    viewer = open_viewer(browser, html(inspection, tmp_path / "hostile.html", layer=0, head=0))
    try:
        assert viewer.column("query") == inspection.tokens  # the literal strings
        assert viewer.column("key") == inspection.tokens
        assert viewer.page.text_content("#text") == inspection.text
        viewer.hover("query", inspection.tokens.index(HOSTILE))
        assert HOSTILE in viewer.page.text_content("#info")
        injected = viewer.page.evaluate("document.querySelectorAll('img, b, main script').length")
        assert injected == 0
        assert viewer.dialogs == []
        assert viewer.console == []
        assert viewer.requests == [viewer.url]  # "src=x" was never fetched
    finally:
        viewer.page.close()


def test_long_input_draws_a_capped_overview_and_full_focus(
    browser: Browser, tmp_path: Path
) -> None:
    inspection = make_inspection([[f"w{i}"] for i in range(398)], layers=1, heads=2)  # T = 400
    viewer = open_viewer(browser, html(inspection, tmp_path / "long.html", layer=0, head=0))
    try:
        assert 0 < int(viewer.page.get_attribute("#all-lines", "data-lines")) <= 1000  # long input: the lower cap
        assert viewer.page.text_content("#overview-note").startswith("Overview: the ")
        viewer.hover("query", 200)
        assert_lines(viewer.lines(), inspection.attentions[0, 0, 200].numpy(), query=200)
        assert viewer.console == []
    finally:
        viewer.page.close()


def test_notebook_iframe_runs_the_viewer_in_its_sandbox(
    browser: Browser, small: Inspection, tmp_path: Path
) -> None:
    # What Jupyter does with the HTML qkv registers for an Inspection: put the fragment into its own page.
    host = tmp_path / "notebook.html"
    host.write_text(
        f"<!DOCTYPE html><html><body>{qkv._notebook_html(small)}</body></html>", encoding="utf-8"
    )
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.goto(host.resolve().as_uri())
        frame = page.frame_locator("iframe")
        frame.locator("body[data-ready=true]").wait_for(timeout=20_000)
        tokens = frame.locator("#queries .token").all_text_contents()
        assert tokens == small.tokens
        frame.locator('#queries .token[data-index="2"]').hover()
        assert frame.locator("#focus-lines line").count() == len(small.tokens)
        assert errors == []
    finally:
        page.close()
