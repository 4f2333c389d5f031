"""The seeds' four steps on one query row of a real model: `Projections` and `StepTrace`.

A model's attention map says how much each query looks at each key, but not why. The seeds
answer "why" with four steps on hand-made numbers (score q.k, scale by 1/sqrt(d_k), softmax,
mix the values); `Inspection.steps(layer, head, query)` runs the same four steps on the
per-head queries, keys and values that the model really computed, in float64, through
`qkv.reference.attention`, and checks that the weights it finds are the ones the model used.

`Projections` is what an Inspection keeps for this, in a form that does not depend on the
model that produced it: the per-head q, k, v of every layer (after any rotary embedding), the
score scale, and the (query, key) pairs that were allowed. Any model (qkv's BERT, a
transformers model) can fill it in.

Shape legend (docs/design.md): T tokens (queries and keys of one text), H query heads, G key/value
heads (head h reads key/value head h // (H // G)), E q/k head width, Ev value head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from qkv import reference
from qkv.reference import Array

__all__ = ["WEIGHT_TOLERANCE", "Projections", "StepTrace", "steps"]

# The weights recomputed in float64 must match the model's own float32 weights this closely;
# float32 rounding of 32- to 128-wide dot products stays orders of magnitude below it, while a
# term the projections do not hold (a bias, a mask they do not describe) shows up far above.
WEIGHT_TOLERANCE = 1e-4
# exp(x) overflows float64 past about 709.78; rows whose scaled scores go past this are shifted.
_LARGEST_EXPONENT = 700.0


@dataclass(frozen=True, eq=False)
class Projections:
    """Every layer's per-head queries, keys and values for one text.

    - q: (layers, H, T, E) queries, after any rotary embedding.
    - k: (layers, G, T, E) keys, after any rotary embedding.
    - v: (layers, G, T, Ev) values.
    - scale: the factor on q.k before softmax (1 / sqrt(E) for BERT).
    - allowed: None when every query sees every key, else (T, T) bool, True = may attend
      (a causal model's triangle), or (layers, T, T) when layers differ (Gemma 2's sliding
      and full layers).
    - unsupported: None, or why the four steps cannot reproduce this model's weights (a term
      of its scores that they do not hold, such as Gemma 2's soft-capping); `steps` raises it.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    allowed: torch.Tensor | None = None
    unsupported: str | None = None

    def __post_init__(self) -> None:
        q, k, v = self.q, self.k, self.v
        if not all(isinstance(x, torch.Tensor) and x.ndim == 4 for x in (q, k, v)):
            raise ValueError("projections q, k, v must be 4-d tensors (layers, heads, T, width)")
        layers, H, T, E = q.shape
        G = k.shape[1]
        if k.shape != (layers, G, T, E) or v.shape[:3] != (layers, G, T) or G == 0 or H % G:
            raise ValueError(
                f"projections do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                "(expected q (layers, H, T, E), k (layers, G, T, E), v (layers, G, T, Ev), H a multiple of G)"
            )
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"projections scale must be a positive finite number, got {self.scale!r}")
        if self.allowed is not None and (
            self.allowed.dtype != torch.bool or tuple(self.allowed.shape) not in ((T, T), (layers, T, T))
        ):
            raise ValueError(
                f"projections allowed must be a bool tensor ({T}, {T}) or ({layers}, {T}, {T}) or None, "
                f"got {self.allowed!r}"
            )

    @property
    def num_layers(self) -> int:
        return int(self.q.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    def allowed_rows(self, layer: int) -> torch.Tensor | None:
        """(T, T) bool of ``layer``: True where a query may see a key; None = every key."""
        if self.allowed is None or self.allowed.ndim == 2:
            return self.allowed
        return self.allowed[layer]

    def head(self, layer: int, head: int) -> tuple[Array, Array, Array]:
        """Head ``head`` of ``layer`` in float64: q (T, E), k (T, E), v (T, Ev)."""
        group = head // (self.num_heads // int(self.k.shape[1]))  # the key/value head it reads
        as64 = lambda x: x.detach().to("cpu", torch.float64).numpy()  # noqa: E731
        return as64(self.q[layer, head]), as64(self.k[layer, group]), as64(self.v[layer, group])


@dataclass(frozen=True)
class StepTrace:
    """One query row through the four steps, in float64 (field names of `qkv.reference.Trace`).

    - q (E,), k (T, E), v (T, Ev): the head's query for this token, every key, every value.
    - scores (T,) = k q; scaled (T,) = scores * scale (scale = 1 / sqrt(E) for BERT).
    - exponentials (T,) = exp(scaled - shift), total = their sum, weights (T,) = exponentials /
      total. shift is 0 unless a scaled score is too large for exp (then it is the row max,
      which changes no weight); keys the query may not see get exponential 0.
    - output (Ev,) = weights @ v; contributions (T, Ev) = weights[j] * v[j], the part of the
      output each key brings; largest: key indices, largest contribution (L2 norm) first.
    - lse: log of the softmax denominator, as in Trace.
    """

    layer: int
    head: int
    query: int
    q: Array
    k: Array
    v: Array
    scores: Array
    scaled: Array
    exponentials: Array
    total: float
    shift: float
    weights: Array
    output: Array
    contributions: Array
    largest: tuple[int, ...]
    lse: float
    scale: float


def steps(projections: Projections, attentions: torch.Tensor, layer: int, head: int, query: int) -> StepTrace:
    """The four steps of (layer, head) for token ``query``, checked against ``attentions``
    (layers, H, T, T), the weights the model itself returned. Raises ValueError if they differ
    by more than `WEIGHT_TOLERANCE`: the projections then miss a term of the model's scores."""
    layers, H, T = projections.num_layers, projections.num_heads, int(projections.q.shape[2])
    for name, value, count in (("layer", layer, layers), ("head", head, H), ("query", query, T)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise ValueError(f"{name} must be an int in [0, {count}), got {value!r}")
    if projections.unsupported is not None:
        raise ValueError(f"the four steps cannot reproduce this model's weights: {projections.unsupported}")
    q, k, v = projections.head(layer, head)  # (T, E), (T, E), (T, Ev)
    rows = projections.allowed_rows(layer)  # (T, T) | None
    allowed = None if rows is None else rows[query].numpy()  # (T,)
    mask = None if allowed is None else allowed[None, :]  # (1, T)
    trace = reference.attention(q[query][None, :], k, v, mask=mask, scale=projections.scale)  # one row (1, ...)
    scaled = trace.scaled[0]  # (T,)
    visible = scaled if allowed is None else scaled[allowed]
    top = float(visible.max()) if visible.size else 0.0
    shift = top if top > _LARGEST_EXPONENT else 0.0
    exponentials = np.exp(scaled - shift)  # (T,)
    if allowed is not None:
        exponentials[~allowed] = 0.0
    weights = trace.weights[0]  # (T,)
    model_weights = attentions[layer, head, query].detach().to("cpu", torch.float64).numpy()  # (T,)
    gap = float(np.max(np.abs(weights - model_weights)))
    if not gap <= WEIGHT_TOLERANCE:
        raise ValueError(
            f"the stored projections of layer {layer} head {head} give weights that differ from the "
            f"model's by {gap:.3g} (> {WEIGHT_TOLERANCE}); the model adds a score term they do not hold"
        )
    contributions = weights[:, None] * v  # (T, Ev)
    order = np.argsort(-np.linalg.norm(contributions, axis=1), kind="stable")
    return StepTrace(
        layer=layer,
        head=head,
        query=query,
        q=trace.q[0],
        k=trace.k,
        v=trace.v,
        scores=trace.scores[0],
        scaled=scaled,
        exponentials=exponentials,
        total=float(exponentials.sum()),
        shift=shift,
        weights=weights,
        output=trace.output[0],
        contributions=contributions,
        largest=tuple(int(j) for j in order),
        lse=float(trace.lse[0]),
        scale=float(trace.scale),
    )
