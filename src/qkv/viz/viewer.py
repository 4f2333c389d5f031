"""The standalone HTML attention viewer: one file, no network, token text kept as data.

`html(inspection, path)` writes a page with
- a head view: tokens as queries (left) and keys (right), one line per (query, key) pair whose
  opacity is the weight; hover or click a token to see where it looks / what looks at it;
- a model view: a thumbnail of every layer x head (and of each layer's head mean); click one
  to open it in the head view;
- layer and head selectors, an "average over heads" switch and a token / word switch.

What goes into the file, and why it is safe and small:
- The page's CSS and JS (``assets/``) are inlined; a Content-Security-Policy allows only those
  two blocks (by hash) and forbids every request, so nothing can load from another origin and
  an injected event handler (a token ``<img onerror=...>``) could not run even if it got in.
- The data is JSON in a ``<script type="application/json">`` block with ``<``, ``>``, ``&``,
  U+2028 and U+2029 escaped, so a token ``</script>`` cannot end the block. The script builds
  the DOM with ``textContent``; token text is never parsed as markup.
- Weights are quantized to 8 bits (step 1/255, the page shows them to 2-3 decimals), then
  zlib-compressed and base64-encoded; the page inflates them with the browser's
  DecompressionStream. Word-level maps and head means are computed in the page from the token
  maps, the way `Inspection.word_attentions` defines them.
"""

from __future__ import annotations

import base64
import hashlib
import html as html_text
import json
import re
import zlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.inspect import Inspection

__all__ = ["QUANT_LEVELS", "html", "payload", "render", "render_inline"]

QUANT_LEVELS = 255  # a weight w is stored as round(w * 255) in one byte
ZLIB_LEVEL = 6  # level 9 is ~10x slower on 512 tokens for ~10 % less
_JSON_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)
_SLOT = re.compile(r"\{\{(csp|css|js|data)\}\}")


def html(inspection: Inspection, path: str | Path) -> Path:
    """Write the viewer for ``inspection`` to ``path`` (one self-contained .html file); return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(inspection), encoding="utf-8")
    return path


def render(inspection: Inspection) -> str:
    """The viewer page as one HTML string."""
    css, js = _asset("viewer.css"), _asset("viewer.js")
    csp = "; ".join(
        [
            "default-src 'none'",  # no fetch, image, font or frame from anywhere
            f"script-src '{_sha256(js)}'",
            f"style-src '{_sha256(css)}'",
        ]
    )
    data = json.dumps(payload(inspection), ensure_ascii=False, separators=(",", ":"))
    slots = {"csp": csp, "css": css, "js": js, "data": data.translate(_JSON_ESCAPES)}
    # One pass over the template: text put into a slot is never scanned for further slots.
    return _SLOT.sub(lambda match: slots[match.group(1)], _asset("viewer.html"))


def render_inline(inspection: Inspection, *, height: int = 760) -> str:
    """The viewer inside a sandboxed ``<iframe srcdoc>``, for Jupyter's ``_repr_html_``.

    The iframe keeps the page's script and styles away from the notebook's own page.
    """
    page = html_text.escape(render(inspection), quote=True)
    return (
        f'<iframe srcdoc="{page}" sandbox="allow-scripts" title="qkv attention viewer" '
        f'style="width: 100%; height: {int(height)}px; border: 0"></iframe>'
    )


def payload(inspection: Inspection) -> dict[str, Any]:
    """What the page receives: tokens, words, groups and the quantized weights.

    ``weights`` is base64(zlib(uint8 bytes)) of shape (layers, heads, T, T), row-major,
    row = query; a stored byte b means weight b / ``scale``.
    """
    import torch  # only here: the package imports without torch until a viewer is written

    attentions = inspection.attentions.detach().to("cpu", torch.float32)  # (layers, H, T, T)
    T = len(inspection.tokens)
    if attentions.ndim != 4 or attentions.shape[-2:] != (T, T):
        raise ValueError(
            f"attentions must have shape (layers, heads, {T}, {T}) for {T} tokens; "
            f"got {tuple(attentions.shape)}"
        )
    quantized = torch.round(attentions.nan_to_num(0.0).clamp(0.0, 1.0) * QUANT_LEVELS)
    raw = quantized.to(torch.uint8).contiguous().numpy().tobytes()
    return {
        "model": inspection.model_name,
        "text": inspection.text,
        "tokens": list(inspection.tokens),
        "words": inspection.words,
        "groups": inspection.groups,
        "layers": inspection.num_layers,
        "heads": inspection.num_heads,
        "scale": QUANT_LEVELS,
        "weights": base64.b64encode(zlib.compress(raw, ZLIB_LEVEL)).decode("ascii"),
    }


def _asset(name: str) -> str:
    return (resources.files("qkv.viz") / "assets" / name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "sha256-" + base64.b64encode(digest).decode("ascii")
