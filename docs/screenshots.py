"""Regenerate the README's two pictures from `qkv tour`'s output.

    uv run qkv tour --quiet --out qkv-out
    uv run python docs/screenshots.py qkv-out

Takes a screenshot of the viewer (hovering "it" in the trophy sentence) with Debian's
Chromium through Playwright, and copies the heatmap of the head where "it" looks at
"trophy" most, shrunk to a README-friendly size.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.image import imread
from playwright.sync_api import sync_playwright

HERE = Path(__file__).resolve().parent
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def screenshot_viewer(page_path: Path, target: Path, layer: int, head: int) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto(page_path.resolve().as_uri())
        page.wait_for_timeout(500)
        page.select_option("#layer", str(layer))
        page.select_option("#head", str(head))
        token = page.get_by_text("it", exact=True).first
        token.hover()
        page.wait_for_timeout(300)
        page.screenshot(path=str(target))
        browser.close()


def shrink(source: Path, target: Path, width_inches: float = 6.0) -> None:
    image = imread(source)
    height, width = image.shape[:2]
    fig = Figure(figsize=(width_inches, width_inches * height / width), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.imshow(image)
    ax.axis("off")
    fig.savefig(target)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "qkv-out")
    heads = sorted(out.glob("trophy-big-layer*-head*.png"))
    if not heads:
        raise SystemExit(f"no trophy-big-layer*-head*.png in {out}; run `uv run qkv tour --out {out}` first")
    # the tour names the file after the head where "it" looks at "trophy" most
    layer, head = (int(part) for part in re.findall(r"layer(\d+)-head(\d+)", heads[0].name)[0])
    screenshot_viewer(out / "trophy-big.html", HERE / "viewer.png", layer, head)
    shrink(heads[0], HERE / "heatmap.png")


if __name__ == "__main__":
    main()
