"""The viewer's panels in Chromium: the steps panel against `Inspection.steps`, the roles
colouring, the rollout view, compare mode with hostile tokens in both texts, long inputs kept
as exact top-k weights, and a layout that does not move under the pointer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import Browser
from tests.viz._browser import TOLERANCE, Viewer, assert_lines, open_viewer
from tests.viz._inspections import (
    HOSTILE,
    HOSTILE_TOKENS,
    make_inspection,
    make_projected_inspection,
)

from qkv.inspect.roles import ROLES
from qkv.viz import html
from qkv.viz import viewer as viewer_module
from qkv.viz.roles import ROLE_COLOURS

pytestmark = pytest.mark.browser

WORDS = [["the"], ["tro", "##phy"], ["did"], ["not"], ["fit"], [","], ["it"], ["was"], ["big"], ["."]]


@pytest.fixture(scope="module")
def projected():
    return make_projected_inspection(WORDS)


@pytest.fixture
def page(browser: Browser, projected, tmp_path: Path):
    opened = open_viewer(browser, html(projected, tmp_path / "projected.html", layer=0, head=0))
    yield opened
    opened.page.close()


def panel(viewer: Viewer) -> dict[str, str]:
    return viewer.page.eval_on_selector("#steps", "p => Object.assign({}, p.dataset)")


def assert_panel_is_the_steps(viewer: Viewer, inspection, layer: int, head: int, query: int, key: int) -> None:
    shown = panel(viewer)
    assert shown["state"] == "shown"
    assert [int(shown[n]) for n in ("layer", "head", "query", "key")] == [layer, head, query, key]
    trace = inspection.steps(layer, head, query)
    # Same float32 q and k on both sides, summed in float64: only the summation order differs.
    for name, expected in (
        ("score", trace.scores[key]), ("scaled", trace.scaled[key]), ("exp", trace.exponentials[key]),
        ("total", trace.total), ("weight", trace.weights[key]),
    ):
        assert float(shown[name]) == pytest.approx(expected, rel=1e-9), name
    assert float(shown["contribution"]) == pytest.approx(np.linalg.norm(trace.contributions[key]), rel=1e-6)
    text = viewer.page.text_content("#steps")
    assert f"query {query} “{inspection.tokens[query]}” → key {key} “{inspection.tokens[key]}”" in text


def test_pinned_query_and_a_clicked_key_open_their_steps(page: Viewer, projected) -> None:
    page.page.select_option("#layer", "1")
    page.page.select_option("#head", "3")  # reads key/value head 1 of 2
    page.page.click('#queries .token[data-index="3"]')
    page.page.click('#keys .token[data-index="5"]')
    assert_panel_is_the_steps(page, projected, 1, 3, 3, 5)
    page.page.mouse.move(1, 1)
    assert page.view("focus") == "query:3"  # the pin stays
    page.page.select_option("#head", "2")  # the numbers belonged to head 3: the panel clears
    assert panel(page) == {} and page.page.text_content("#steps").startswith("Steps: pin a query")


def test_clicking_a_line_opens_its_steps(page: Viewer, projected) -> None:
    page.hover("query", 2)
    page.page.click('#focus-lines line[data-key="7"]')
    assert_panel_is_the_steps(page, projected, 0, 0, 2, 7)


def test_clicking_a_cell_of_a_small_map_opens_that_head_and_its_steps(page: Viewer, projected) -> None:
    thumb = page.page.locator('.thumb[data-layer="1"][data-head="2"]')
    box = thumb.bounding_box()
    T = len(projected.tokens)
    border = 3
    inner = box["width"] - 2 * border
    x = box["x"] + border + (4.5 / T) * inner  # key 4
    y = box["y"] + border + (6.5 / T) * inner  # query 6
    page.page.mouse.click(x, y)
    assert (page.view("layer"), page.view("head")) == ("1", "2")
    assert_panel_is_the_steps(page, projected, 1, 2, 6, 4)


def test_a_decoders_steps_follow_its_mask_in_every_layer(browser: Browser, tmp_path: Path) -> None:
    """A decoder's file carries which keys each query sees (causal in layer 0, a window of 3 in
    layer 1); its steps equal `Inspection.steps`, and a hidden key says so with exp = 0."""
    decoder = make_projected_inspection(WORDS, decoder=True)
    viewer = open_viewer(browser, html(decoder, tmp_path / "decoder.html"))
    try:
        for layer, query, key in ((0, 6, 2), (1, 6, 5), (1, 6, 2), (0, 3, 8)):
            viewer.page.select_option("#layer", str(layer))
            viewer.page.select_option("#head", "1")
            viewer.page.click(f'#queries .token[data-index="{query}"]')
            viewer.page.click(f'#keys .token[data-index="{key}"]')
            assert_panel_is_the_steps(viewer, decoder, layer, 1, query, key)
            hidden = "the model's mask hides this key from this query: exp = 0" in viewer.page.text_content("#steps")
            assert hidden == (key > query or (key < query - 2 and layer == 1))
            viewer.page.click(f'#queries .token[data-index="{query}"]')  # unpin
    finally:
        viewer.page.close()


def test_steps_panel_refuses_what_has_no_single_head(page: Viewer) -> None:
    page.page.check("#average")
    page.page.click('#queries .token[data-index="3"]')
    page.page.click('#keys .token[data-index="5"]')
    assert panel(page)["state"] == "refused"
    assert "per token and per head" in page.page.text_content("#steps")


def test_roles_colour_each_small_map_by_its_dominant_role(page: Viewer, projected) -> None:
    assert page.page.is_hidden("#role-legend") or page.page.eval_on_selector("#role-legend", "e => getComputedStyle(e).visibility") == "hidden"
    page.page.check("#roles")
    dominant = projected.head_roles().dominant()
    for layer in range(projected.num_layers):
        for head in range(projected.num_heads):
            colour = page.page.eval_on_selector(
                f'.thumb[data-layer="{layer}"][data-head="{head}"]', "t => getComputedStyle(t).borderTopColor"
            )
            hex_colour = ROLE_COLOURS[ROLES[int(dominant[layer, head])]]
            expected = "rgb({}, {}, {})".format(*(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)))
            assert colour == expected, (layer, head)
    assert page.page.eval_on_selector("#role-legend", "e => getComputedStyle(e).visibility") == "visible"


def test_rollout_view_draws_the_rollout_through_the_layer(page: Viewer, projected) -> None:
    page.page.select_option("#mode", "rollout")
    page.page.select_option("#layer", "1")
    assert page.view("head") == "rollout"
    assert page.page.is_disabled("#head")
    page.hover("query", 4)
    assert_lines(page.lines(), projected.rollout(1)[4].numpy(), query=4)
    page.page.select_option("#layer", "0")
    page.hover("query", 1)
    assert_lines(page.lines(), projected.rollout(0)[1].numpy(), query=1)


def test_compare_mode_with_hostile_tokens_in_both_texts(browser: Browser, tmp_path: Path) -> None:
    a = make_inspection([["the"], [HOSTILE], ["fit"], *([t] for t in HOSTILE_TOKENS[1:3])], layers=2, heads=2, seed=1)
    b = make_inspection([["the"], ["</script><b>y</b>"], ["fit"], [HOSTILE], ["$x$"]], layers=2, heads=2, seed=2)
    viewer = open_viewer(browser, html(a, tmp_path / "compare.html", compare=b, layer=0, head=0))
    try:
        page = viewer.page
        assert viewer.column("query") == a.tokens
        assert page.eval_on_selector_all("#queries-b .token", "ts => ts.map(t => t.textContent)") == b.tokens
        assert page.text_content("#pane-title-b") == f"B: {b.text}"
        page.select_option("#layer", "1")
        page.select_option("#head", "1")
        page.hover('#queries-b .token[data-index="2"]')
        drawn = page.eval_on_selector_all("#focus-lines-b line", "ls => ls.map(l => Number(l.dataset.weight))")
        np.testing.assert_allclose(drawn, b.attentions[1, 1, 2].numpy(), atol=TOLERANCE)
        # The difference view: aligned words, each listed cell = A's word weight - B's.
        pairs = viewer_module.align_words(a.words, b.words)
        assert [(a.words[i], b.words[j]) for i, j in pairs] == [("[CLS]", "[CLS]"), ("the", "the"), ("fit", "fit"), (HOSTILE_TOKENS[2], "$x$"), ("[SEP]", "[SEP]")][: len(pairs)] or pairs
        wa, wb = a.word_attentions()[1, 1].numpy(), b.word_attentions()[1, 1].numpy()
        items = page.eval_on_selector_all("#diff-top li", "ls => ls.map(l => [l.dataset.query, l.dataset.key, l.dataset.a, l.dataset.b])")
        assert len(items) == min(8, len(pairs) ** 2)
        differences = []
        for r, c, shown_a, shown_b in items:
            (ia, ib), (ja, jb) = pairs[int(r)], pairs[int(c)]
            assert float(shown_a) == pytest.approx(wa[ia, ja], abs=3 * TOLERANCE)
            assert float(shown_b) == pytest.approx(wb[ib, jb], abs=3 * TOLERANCE)
            differences.append(abs(wa[ia, ja] - wb[ib, jb]))
        every = sorted((abs(wa[ia, ja] - wb[ib, jb]) for ia, ib in pairs for ja, jb in pairs), reverse=True)
        np.testing.assert_allclose(differences, every[: len(items)], atol=6 * TOLERANCE)
        spans = page.eval_on_selector_all("#alignment span", "ss => ss.map(s => s.textContent)")
        assert HOSTILE in spans and "</script><b>y</b>" in spans
        assert page.evaluate("document.querySelectorAll('img, b, main script').length") == 0
        assert viewer.dialogs == [] and viewer.console == []
        assert viewer.requests == [viewer.url]
    finally:
        viewer.page.close()


def test_compare_refuses_inspections_of_different_models(tmp_path: Path) -> None:
    a = make_inspection([["a"]], layers=2, heads=2)
    b = make_inspection([["a"]], layers=1, heads=2)
    with pytest.raises(ValueError, match="same model: 2 layers x 2 heads against 1 x 2"):
        html(a, tmp_path / "x.html", compare=b)
    assert not (tmp_path / "x.html").exists()


def test_long_inputs_keep_exact_top_k_weights(browser: Browser, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inspection = make_projected_inspection([[f"w{i}"] for i in range(58)], layers=1, heads=2, kv_heads=1)  # T = 60
    monkeypatch.setattr(viewer_module, "DENSE_LIMIT", 1000)  # 1 x 2 x 60 x 60 = 7200 weights: too many
    monkeypatch.setattr(viewer_module, "SPARSE_BUDGET", 1 * 2 * 60 * 8 * 5)  # room for k = 5 per row
    viewer = open_viewer(browser, html(inspection, tmp_path / "sparse.html", layer=0, head=0))
    try:
        note = viewer.page.text_content("#storage-note")
        assert "each query keeps its 5 largest weights, exactly" in note
        assert "rollout is not stored" in note
        viewer.page.select_option("#head", "1")
        viewer.hover("query", 30)
        row = inspection.attentions[0, 1, 30].numpy()
        kept = np.zeros_like(row)
        top = np.argsort(-row)[:5]
        kept[top] = row[top]
        assert_lines(viewer.lines(), kept, query=30, tolerance=5e-5 + 1e-7)  # exact, printed to 4 decimals
        assert viewer.page.is_disabled("#mode")
        assert viewer.console == []
    finally:
        viewer.page.close()


def _layout(viewer: Viewer) -> list:
    """The page's size and the box of every element in page coordinates (so that scrolling to
    reach a token changes nothing); what is drawn inside the svg and the steps panel (whose box
    counts) on demand, and boxless elements (options), aside."""
    return viewer.page.evaluate(
        """() => [document.documentElement.scrollWidth, document.documentElement.scrollHeight,
            ...Array.from(document.querySelectorAll('body *')).filter(e => (!e.closest('svg') || e.tagName === 'svg') && (!e.closest('#steps') || e.id === 'steps'))
                .filter(e => e.getBoundingClientRect().width > 0)
                .map(e => { const r = e.getBoundingClientRect();
                            return [e.tagName, r.x + scrollX, r.y + scrollY, r.width, r.height]; })]"""
    )


@pytest.mark.parametrize("long_token", [False, True])
def test_nothing_moves_under_the_pointer(browser: Browser, tmp_path: Path, long_token: bool) -> None:
    words = [["the"], ["tro", "##phy"], ["x" * 5000 if long_token else "fit"], ["it"]]
    viewer = open_viewer(browser, html(make_projected_inspection(words), tmp_path / "still.html", layer=0, head=0))
    try:
        before = _layout(viewer)
        width = viewer.page.evaluate("document.documentElement.scrollWidth")
        assert width <= 1200  # the viewport: a long token does not widen the page
        for side, index in (("query", 3), ("key", 3), ("query", 1), ("key", 5)):
            viewer.hover(side, index)
            assert viewer.page.text_content("#info") != ""
            assert _layout(viewer) == before, (side, index)
        viewer.page.click('#queries .token[data-index="3"]')
        viewer.page.click('#keys .token[data-index="1"]')  # the steps panel opens in its own room
        assert panel(viewer)["state"] == "shown"
        assert _layout(viewer) == before
    finally:
        viewer.page.close()


def test_the_difference_matrix_has_labelled_axes(browser: Browser, tmp_path: Path) -> None:
    """Key words along the top, query words down the left, in the matrix's order (the shared
    words, text A's spelling), hostile ones as plain text."""
    a = make_inspection([["the"], ["tro", "##phy"], [HOSTILE], ["fit"]], layers=1, heads=2, seed=3)
    b = make_inspection([["the"], ["tro", "##phy"], ["did"], [HOSTILE], ["fit"]], layers=1, heads=2, seed=4)
    viewer = open_viewer(browser, html(a, tmp_path / "axes.html", compare=b, layer=0, head=0))
    try:
        page = viewer.page
        shared = [a.words[i] for i, _ in viewer_module.align_words(a.words, b.words)]
        assert shared == ["[CLS]", "the", "trophy", HOSTILE, "fit", "[SEP]"]
        for axis in ("#diff-keys", "#diff-queries"):
            assert page.eval_on_selector_all(f"{axis} span", "ss => ss.map(s => s.textContent)") == shared
        assert page.text_content("#diff-corner") == "query ↓ key →"
        box = lambda selector: page.locator(selector).bounding_box()  # noqa: E731
        matrix, keys, queries = box("#diff-map"), box("#diff-keys"), box("#diff-queries")
        assert keys["y"] + keys["height"] <= matrix["y"] + 1 and abs(keys["x"] - matrix["x"]) <= 1  # above it
        assert queries["x"] + queries["width"] <= matrix["x"] + 1 and abs(queries["y"] - matrix["y"]) <= 1  # left
        # one label per row / column, each over its own cell of the matrix
        key_boxes = page.eval_on_selector_all("#diff-keys span", "ss => ss.map(s => s.getBoundingClientRect().left)")
        assert np.all(np.diff(key_boxes) > 0) and key_boxes[-1] < matrix["x"] + matrix["width"]
        assert page.evaluate("document.querySelectorAll('img, b, main script').length") == 0
        assert viewer.console == []
    finally:
        viewer.page.close()


@pytest.mark.parametrize("compare", [False, True])
def test_a_420_pixel_screen_keeps_every_column_on_screen(browser: Browser, tmp_path: Path, compare: bool) -> None:
    inspection = make_projected_inspection(WORDS)
    other = make_projected_inspection(WORDS, seed=5) if compare else None
    path = html(inspection, tmp_path / "narrow.html", compare=other, layer=0, head=0)
    page = browser.new_page(viewport={"width": 420, "height": 800})
    try:
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]", timeout=20_000)
        assert page.evaluate("document.scrollingElement.scrollWidth") <= 420  # no sideways scrolling
        for keys in ["#keys", *(["#keys-b"] if compare else [])]:
            column = page.locator(keys).bounding_box()
            assert column["x"] >= 0 and column["x"] + column["width"] <= 420, (keys, column)
            queries = page.locator(keys.replace("keys", "queries")).bounding_box()
            assert queries["x"] >= 0 and queries["x"] + queries["width"] <= column["x"]
        # and the head view still works there: hovering a query draws its row
        page.hover('#queries .token[data-index="2"]')
        drawn = page.eval_on_selector_all("#focus-lines line", "ls => ls.map(l => Number(l.dataset.weight))")
        np.testing.assert_allclose(drawn, inspection.attentions[0, 0, 2].numpy(), atol=TOLERANCE)
        ends = page.eval_on_selector_all("#focus-lines line", "ls => ls.map(l => Number(l.getAttribute('x2')))")
        assert set(ends) == {page.locator("#lines").bounding_box()["width"]}
    finally:
        page.close()
