"""The standalone HTML attention viewer: one file, no network, token text kept as data.

`html(inspection, path)` writes a page with
- a head view: tokens as queries (left) and keys (right), one line per (query, key) pair whose
  opacity is the weight; hover or click a token to see where it looks / what looks at it;
- a model view: a thumbnail of every layer x head (and of each layer's head mean); click one
  to open it in the head view;
- layer and head selectors, an "average over heads" switch and a token / word switch.

It opens on the head that `opening_head` picks (the one whose rows look hardest at another
word; a given ``layer`` / ``head`` is kept), not on layer 0 head 0, where BERT's heads park
their attention on [CLS] and [SEP] and every line is faint. The compare page's difference
matrix has its key words along the top and its query words down the left. Below 700 px the
token columns narrow and the lines between them fit the window (a 420 px phone included).

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

Since issue 16 the page also
- opens a steps panel when a line is clicked (or a key while a query is pinned): q.k, the
  scaled score, its exponential, its share of the row's total (the weight) and the length of
  what the key's value brings (weight x v). It reads each head's q and k (float32) and the
  lengths of v, stored when the Inspection holds `Projections`; the page computes the row in
  float64 from them, so its numbers are those of `Inspection.steps` to float32 rounding;
- colours the model view by each head's dominant role (`Inspection.head_roles`) on demand;
- shows attention rollout (`Inspection.rollout`, through the selected layer) as a view;
- compares two texts (``compare=other``): both head views side by side under one layer/head
  selection, and a difference view over the words that the two texts share, aligned in order
  (difflib's longest matching blocks over lower-cased words).

Long inputs: past `DENSE_LIMIT` stored weights (layers x heads x T x T), the file keeps, for
every query row, only the `top_k` largest weights exactly (float32, with their key indices),
k chosen so that the weights fit `SPARSE_BUDGET` bytes; the page says so. Projections and
rollout are left out when they would not fit either (the page says that too).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import html as html_text
import json
import re
import zlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qkv.inspect.inspection import Inspection

__all__ = [
    "DENSE_LIMIT",
    "QUANT_LEVELS",
    "SPARSE_BUDGET",
    "align_words",
    "html",
    "opening_head",
    "payload",
    "render",
    "render_inline",
]

QUANT_LEVELS = 255  # a weight w is stored as round(w * 255) in one byte
ZLIB_LEVEL = 6  # level 9 is ~10x slower on 512 tokens for ~10 % less
_JSON_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)
# Up to this many stored weights (layers x heads x T x T, one byte each) the file holds every
# weight; MiniLM at 512 tokens is 18.9 M. Past it, each row keeps its top-k weights exactly.
DENSE_LIMIT = 40_000_000
SPARSE_BUDGET = 30_000_000  # bytes of top-k weights and indices; base64 adds a third: < 50 MB
PROJECTION_BUDGET = 24_000_000  # bytes of float32 q and k (and v lengths) for the steps panel
_SLOT = re.compile(r"\{\{(csp|css|js|data)\}\}")


def html(
    inspection: Inspection,
    path: str | Path,
    *,
    compare: Inspection | None = None,
    layer: int | None = None,
    head: int | None = None,
    query: list[int] | None = None,
) -> Path:
    """Write the viewer for ``inspection`` to ``path`` (one self-contained .html file); return it.

    ``compare``: a second Inspection from the same model (same layers and heads), shown next
    to the first with a difference view over the words they share. ``layer`` and ``head``:
    the selection the page opens with; what is left None is chosen by `opening_head` (for the
    tokens ``query``, e.g. a word's pieces, or for every word's token without one).
    """
    page = render(inspection, compare=compare, layer=layer, head=head, query=query)  # every check before the file is touched
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def opening_head(
    inspection: Inspection, query: list[int] | None = None, *, layer: int | None = None, head: int | None = None
) -> tuple[int, int]:
    """The (layer, head) a viewer opens on: the one whose query rows look hardest at one other word.

    Rule: for each head, every query row (the tokens ``query``; without it, every token that
    belongs to a word) gives its largest weight to a key that is a word's token other than the
    query itself; the head with the highest mean of those weights wins, the first in (layer,
    head) order on a tie. Weight on [CLS] / [SEP] (tokens without a word id) and on the token
    itself does not count: heads that park their attention there (most of layer 0 of BERT,
    "no-op" heads in Clark et al. 2019) draw faint lines everywhere and show nothing. A
    ``layer`` or ``head`` that is given is kept; the rule picks the rest.
    """
    import torch

    T = len(inspection.tokens)
    words = torch.tensor([w is not None for w in inspection.word_ids])  # (T,) key is a word's token
    rows = [i for i in range(T) if inspection.word_ids[i] is not None] if query is None else list(query)
    if not rows or int(words.sum()) < 2:  # nothing to look at: the first head
        return (0 if layer is None else layer), (0 if head is None else head)
    weights = inspection.attentions[:, :, rows].clone()  # (layers, H, R, T)
    weights[..., ~words] = 0.0
    weights[:, :, torch.arange(len(rows)), torch.tensor(rows)] = 0.0  # a query's weight on itself
    strength = weights.amax(dim=-1).mean(dim=-1)  # (layers, H)
    if layer is not None:
        strength = strength[layer : layer + 1]
    if head is not None:
        strength = strength[:, head : head + 1]
    best = int(torch.argmax(strength.flatten()))  # the first maximum, in (layer, head) order
    found_layer, found_head = divmod(best, strength.shape[1])
    return (found_layer if layer is None else layer), (found_head if head is None else head)


def render(
    inspection: Inspection,
    *,
    compare: Inspection | None = None,
    layer: int | None = None,
    head: int | None = None,
    query: list[int] | None = None,
) -> str:
    """The viewer page as one HTML string (see `html`)."""
    for name, value, count in (("layer", layer, inspection.num_layers), ("head", head, inspection.num_heads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count):
            raise ValueError(f"{name} must be an int in [0, {count}), got {value!r}")
    T = len(inspection.tokens)
    if query is not None and (not query or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < T for i in query)):
        raise ValueError(f"query must be a non-empty list of token indices in [0, {T}), got {query!r}")
    layer, head = opening_head(inspection, query, layer=layer, head=head)
    css, js = _asset("viewer.css"), _asset("viewer.js")
    csp = "; ".join(
        [
            "default-src 'none'",  # no fetch, image, font or frame from anywhere
            f"script-src '{_sha256(js)}'",
            f"style-src '{_sha256(css)}'",
        ]
    )
    content = payload(inspection)
    content["start"] = {"layer": layer, "head": head}
    if compare is not None:
        if (compare.num_layers, compare.num_heads) != (inspection.num_layers, inspection.num_heads):
            raise ValueError(
                f"compare needs two inspections of the same model: {inspection.num_layers} layers x "
                f"{inspection.num_heads} heads against {compare.num_layers} x {compare.num_heads}"
            )
        content["compare"] = payload(compare)
        content["alignment"] = align_words(inspection.words, compare.words)
    data = json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
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


def align_words(a: list[str], b: list[str]) -> list[list[int]]:
    """[[i, j], ...]: word i of ``a`` matches word j of ``b`` (case-insensitive), in order."""
    matcher = difflib.SequenceMatcher(a=[w.lower() for w in a], b=[w.lower() for w in b], autojunk=False)
    return [[block.a + n, block.b + n] for block in matcher.get_matching_blocks() for n in range(block.size)]


def payload(inspection: Inspection) -> dict[str, Any]:
    """What the page receives: tokens, words, groups, the weights and what the panels need.

    ``weights`` is base64(zlib(uint8 bytes)) of shape (layers, heads, T, T), row-major,
    row = query; a stored byte b means weight b / ``scale``. For long inputs ``weights`` is
    None and ``sparse`` holds ``k``, ``indices`` (base64 zlib uint32, (layers, heads, T, k))
    and ``values`` (float32, same shape): each row's k largest weights, exactly.
    ``projections``: base64 float32 ``q`` and ``k`` (layers, heads, T, E), key heads repeated
    per query head, ``vnorm`` (layers, heads, T) the length of each value, and ``scale``;
    None when the Inspection has none or they would not fit. ``rollout``: base64 zlib uint8
    (layers, T, T), the rollout through each layer quantized like the weights, or None.
    ``roles``: the dominant role of each head and its share.
    """
    import torch  # only here: the package imports without torch until a viewer is written

    attentions = inspection.attentions.detach().to("cpu", torch.float32)  # (layers, H, T, T)
    T = len(inspection.tokens)
    if attentions.ndim != 4 or attentions.shape[-2:] != (T, T):
        raise ValueError(
            f"attentions must have shape (layers, heads, {T}, {T}) for {T} tokens; "
            f"got {tuple(attentions.shape)}"
        )
    layers, H = int(attentions.shape[0]), int(attentions.shape[1])
    dense = layers * H * T * T <= DENSE_LIMIT
    weights, sparse, rollout = None, None, None
    if dense:
        weights = _pack(_quantize(attentions))
        flow = torch.stack([inspection.rollout(layer) for layer in range(layers)])  # (layers, T, T)
        rollout = _pack(_quantize(flow))
    else:
        k = max(1, min(T, SPARSE_BUDGET // (layers * H * T * 8)))
        top = torch.topk(attentions, k, dim=-1)  # values, indices (layers, H, T, k)
        sparse = {
            "k": k,
            "indices": _pack(top.indices.to(torch.int32).contiguous().numpy().tobytes()),
            "values": _pack(top.values.contiguous().numpy().tobytes()),
        }
    from qkv.inspect.roles import ROLES

    roles = inspection.head_roles()
    dominant = roles.dominant()  # (layers, H)
    return {
        "model": inspection.model_name,
        "text": inspection.text,
        "tokens": list(inspection.tokens),
        "words": inspection.words,
        "groups": inspection.groups,
        "layers": inspection.num_layers,
        "heads": inspection.num_heads,
        "scale": QUANT_LEVELS,
        "weights": weights,
        "sparse": sparse,
        "rollout": rollout,
        "projections": _projections(inspection),
        "roles": {
            "names": list(ROLES),
            "dominant": [[ROLES[int(r)] for r in row] for row in dominant],
            "share": [[round(float(roles.shares[layer, h, dominant[layer, h]]), 4) for h in range(H)] for layer in range(layers)],
        },
    }


def _quantize(weights: Any) -> bytes:
    """Weights in [0, 1] as bytes round(w * QUANT_LEVELS)."""
    import torch

    quantized = torch.round(weights.nan_to_num(0.0).clamp(0.0, 1.0) * QUANT_LEVELS)
    return quantized.to(torch.uint8).contiguous().numpy().tobytes()


def _pack(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, ZLIB_LEVEL)).decode("ascii")


def _projections(inspection: Inspection) -> dict[str, Any] | None:
    """float32 q, k per query head and value lengths for the steps panel, or None."""
    import torch

    p = inspection.projections
    if p is None or p.unsupported is not None:  # the steps would not give the model's weights
        return None
    layers, H, T, E = p.q.shape
    if layers * H * T * (2 * E + 1) * 4 > PROJECTION_BUDGET:
        return None
    allowed = None  # (layers, T, T) as bytes 0 / 1: which keys each query of a layer may see
    if p.allowed is not None:
        per_layer = [p.allowed_rows(layer) for layer in range(layers)]  # never None: p.allowed is set
        rows = torch.stack([r for r in per_layer if r is not None])  # (layers, T, T)
        allowed = _pack(rows.to(torch.uint8).contiguous().numpy().tobytes())
    repeat = H // int(p.k.shape[1])
    keys = p.k.repeat_interleave(repeat, dim=1)  # (layers, H, T, E): query head h reads key head h // repeat
    values = p.v.repeat_interleave(repeat, dim=1)  # (layers, H, T, Ev)
    as_bytes = lambda x: base64.b64encode(x.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).decode("ascii")  # noqa: E731
    return {
        "E": int(E),
        "scale": float(p.scale),
        "q": as_bytes(p.q),
        "k": as_bytes(keys),
        "vnorm": as_bytes(torch.linalg.vector_norm(values.double(), dim=-1)),
        "allowed": allowed,
    }


def _asset(name: str) -> str:
    return (resources.files("qkv.viz") / "assets" / name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "sha256-" + base64.b64encode(digest).decode("ascii")
