"""How fast the HTML viewer is in Chromium: a 512-token all-MiniLM-L6-v2 input, and a long
synthetic input stored as exact top-k weights.

    uv run python benchmarks/viewer.py            # prints a table; needs /usr/bin/chromium
    uv run python benchmarks/viewer.py --quick    # the 512-token case only

Figures (milliseconds, medians of several runs, measured inside the page with performance.now()):
- ready: from navigation start to the page's data-ready mark (inflate, thumbnails, first drawing);
- head switch / layer switch / rollout: one change event, from dispatch to the end of its
  synchronous redraw, plus the next animation frame (what the user waits for);
- steps panel: the first click decodes the file's q and k; later clicks reuse them.
The machine is shared: the load average is printed with the figures.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from playwright.sync_api import sync_playwright

from qkv.inspect import Inspection
from qkv.models import load_encoder
from qkv.viz import html

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu"]
REPEATS = 5

# One change event and the frame after it, timed in the page.
SWITCH = """async ([selector, value]) => {
  const select = document.querySelector(selector);
  const t0 = performance.now();
  select.value = value;
  select.dispatchEvent(new Event("change"));
  await new Promise((resolve) => requestAnimationFrame(() => resolve()));
  return performance.now() - t0;
}"""
CLICK = """async ([q, k]) => {
  const t0 = performance.now();
  document.querySelector(`#queries .token[data-index="${q}"]`).click();
  document.querySelector(`#keys .token[data-index="${k}"]`).click();
  await new Promise((resolve) => requestAnimationFrame(() => resolve()));
  const elapsed = performance.now() - t0;
  document.querySelector(`#queries .token[data-index="${q}"]`).click();  // unpin
  return elapsed;
}"""


def minilm_512() -> Inspection:
    encoder = load_encoder()
    sentence = "attention mixes every token with the tokens it finds relevant , and the model learns which ones matter ."
    words = sentence.split(" ")
    text = " ".join(words[i % len(words)] for i in range(600))
    return encoder.inspect(text, truncate=True)  # 512 tokens, [CLS] and [SEP] included


def synthetic(T: int, layers: int, heads: int) -> Inspection:
    generator = torch.Generator().manual_seed(0)
    attentions = torch.softmax(3 * torch.randn(layers, heads, T, T, generator=generator), dim=-1)
    tokens = ["[CLS]", *(f"w{i}" for i in range(T - 2)), "[SEP]"]
    offsets, text, position = [(0, 0)], "", 0
    for token in tokens[1:-1]:
        offsets.append((position, position + len(token)))
        text += token + " "
        position += len(token) + 1
    offsets.append((0, 0))
    word_ids = [None, *range(T - 2), None]
    return Inspection(text.strip(), tokens, offsets, word_ids, attentions, torch.zeros(layers + 1, T, 1), model_name="synthetic")


def measure(inspection: Inspection, directory: Path, name: str) -> dict[str, float]:
    path = html(inspection, directory / f"{name}.html")
    out = {"file MB": path.stat().st_size / 1e6}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        ready = []
        for _ in range(REPEATS):
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(path.resolve().as_uri())
            page.wait_for_selector("body[data-ready=true]", timeout=120_000)
            ready.append(float(page.get_attribute("body", "data-ready-at")))
            page.close()
        out["ready ms"] = statistics.median(ready)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]", timeout=120_000)
        heads = inspection.num_heads
        out["head switch ms"] = statistics.median(page.evaluate(SWITCH, ["#head", str(h % heads)]) for h in range(1, 2 * REPEATS + 1))
        out["layer switch ms"] = statistics.median(
            page.evaluate(SWITCH, ["#layer", str(layer % inspection.num_layers)]) for layer in range(1, 2 * REPEATS + 1)
        )
        if page.is_enabled("#mode"):
            out["rollout ms"] = page.evaluate(SWITCH, ["#mode", "rollout"])
            page.evaluate(SWITCH, ["#mode", "attention"])
        if inspection.projections is not None:
            out["steps first ms"] = page.evaluate(CLICK, [5, 7])
            out["steps next ms"] = statistics.median(page.evaluate(CLICK, [5 + i, 9]) for i in range(REPEATS))
        browser.close()
    return out


def main() -> None:
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        cases = {"MiniLM, 512 tokens": minilm_512()}
        if "--quick" not in sys.argv:
            cases["synthetic 2048 tokens, 6 x 12 heads (top-k)"] = synthetic(2048, 6, 12)
        rows = {name: measure(inspection, directory, name.split(",")[0].replace(" ", "-")) for name, inspection in cases.items()}
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (2 cores, shared)")
    for name, figures in rows.items():
        print(name + ": " + ", ".join(f"{key} {value:.1f}" for key, value in figures.items()))


if __name__ == "__main__":
    main()
