"""Shared pieces of the browser tests: the Chromium flags, an opened viewer page that records
console messages, requests and dialogs, and the check of drawn focus lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from playwright.sync_api import Browser, Page

from qkv.viz.viewer import QUANT_LEVELS

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    # No background traffic from the browser itself, so every request seen is the page's.
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# A drawn weight is the stored byte / 255 (off by at most half a step) printed to 4 decimals.
TOLERANCE = 0.5 / QUANT_LEVELS + 5e-5 + 1e-7


@dataclass
class Viewer:
    """An open viewer page and everything it did: console messages, requests, dialogs."""

    page: Page
    url: str
    console: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def hover(self, side: str, index: int) -> None:
        column = "#queries" if side == "query" else "#keys"
        self.page.hover(f'{column} .token[data-index="{index}"]')

    def lines(self) -> list[tuple[int, int, float, float]]:
        """(query, key, data-weight, opacity) of every focus line drawn."""
        rows = self.page.eval_on_selector_all(
            "#focus-lines line",
            "lines => lines.map(l => [l.dataset.query, l.dataset.key, l.dataset.weight, l.getAttribute('opacity')])",
        )
        return [(int(q), int(k), float(w), float(o)) for q, k, w, o in rows]

    def column(self, side: str) -> list[str]:
        column = "#queries" if side == "query" else "#keys"
        return self.page.eval_on_selector_all(
            f"{column} .token", "ts => ts.map(t => t.textContent)"
        )

    def view(self, name: str) -> str:
        return self.page.get_attribute("#head-view", f"data-{name}")


def open_viewer(browser: Browser, path: Path) -> Viewer:
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    viewer = Viewer(page, path.resolve().as_uri())
    page.on(
        "console",
        lambda m: (
            viewer.console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
        ),
    )
    page.on("pageerror", lambda error: viewer.console.append(f"pageerror: {error}"))
    page.on("request", lambda request: viewer.requests.append(request.url))
    page.on("dialog", lambda dialog: (viewer.dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(viewer.url)
    page.wait_for_selector("body[data-ready=true]", timeout=20_000)
    return viewer


def assert_lines(
    lines: list[tuple[int, int, float, float]],
    expected: np.ndarray,
    *,
    query: int | None = None,
    key: int | None = None,
    tolerance: float = TOLERANCE,
) -> None:
    """The lines are one per pair of the focused row (query=...) or column (key=...), weighted as expected."""
    n = len(expected)
    pairs = [(query, j) for j in range(n)] if query is not None else [(i, key) for i in range(n)]
    assert [(q, k) for q, k, _, _ in lines] == pairs
    drawn = np.array([w for _, _, w, _ in lines])
    np.testing.assert_allclose(drawn, expected, atol=tolerance, rtol=0)
    assert [o for _, _, _, o in lines] == [w for _, _, w, _ in lines]  # opacity is the weight
