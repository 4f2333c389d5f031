"""The NumPy float64 reference: attention exactly as the seed articles write it.

Every function here is one step of the articles, in the order they teach it:

1. project:  Q = X W_Q,  K = X W_K,  V = X W_V        (W_Q, W_K: D x E, W_V: D x Ev)
2. score:    scores = Q K^T                             (L x S)
3. scale:    scaled = scores / sqrt(d_k)                (or a custom scale)
4. softmax:  weights = softmax(scaled) row by row       (rows sum to 1)
5. mix:      output = weights V                         (L x Ev)

Together: Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V.

Score terms beyond the articles, between steps 3 and 4 (docs/design.md's order): a softcap
c * tanh(x / c), then an additive bias, then any score_mod(x, b, h, i, j), then the mask.
Attention sinks (gpt-oss) add one logit per head to every softmax denominator, with no value:
weights_j = exp(x_j) / (exp(sink) + sum_t exp(x_t)).

This module depends on NumPy alone, computes in float64, and is the oracle that every fast
path in qkv is tested against. It is written to be read, not to be fast: every intermediate
is materialized and returned in a `Trace`.

Masks: a boolean mask is True where a query may attend to a key; a float mask is added to
the scaled scores. A query row that may attend to nothing gets zero weights and a zero
output (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

Array = NDArray[np.float64]

__all__ = [
    "MultiHeadTrace",
    "Trace",
    "attention",
    "attention_grads",
    "cross_attention",
    "logit_grads",
    "mix",
    "modify_scores",
    "multi_head_attention",
    "project",
    "scale_scores",
    "scores",
    "self_attention",
    "softcap_scores",
    "softmax",
]


@dataclass(frozen=True)
class Trace:
    """Every intermediate of one scaled dot-product attention.

    Shapes (leading batch/head axes ``...`` are carried through):
    q (..., L, E), k (..., S, E), v (..., S, Ev), scores and scaled and weights (..., L, S),
    output (..., L, Ev). ``lse`` (..., L) is the log of each row's softmax denominator
    (-inf for a row that sees no key).
    """

    q: Array
    k: Array
    v: Array
    scores: Array
    scaled: Array
    weights: Array
    output: Array
    lse: Array
    scale: float
    kv_heads: int | None = None  # G when the caller's k and v had fewer heads than q
    # the scores that enter the softmax: scaled, soft-capped, biased, modified (..., L, S)
    logits: Array | None = None
    softcap: float | None = None
    score_mod: bool = False  # a score_mod was applied (its gradient is not known here)
    sinks: Array | None = None  # (..., 1, 1) the sink logit of each row's denominator, when given


@dataclass(frozen=True)
class MultiHeadTrace:
    """Every intermediate of multi-head attention.

    ``heads`` is a Trace whose arrays carry a head axis before (L, ...): q (..., H, L, E).
    concat (..., L, H * Ev) is the heads' outputs side by side; output (..., L, D) = concat W_O.
    """

    heads: Trace
    concat: Array
    output: Array


def _as_float64(x: ArrayLike, name: str) -> Array:
    array = np.asarray(x, dtype=np.float64)
    if array.ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., length, dim), got shape {array.shape}")
    return array


def project(x: ArrayLike, w: ArrayLike, b: ArrayLike | None = None) -> Array:
    """Step 1, projection: ``x @ w (+ b)``. x (..., L, D), w (D, E) -> (..., L, E)."""
    out = np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64)
    if b is not None:
        out = out + np.asarray(b, dtype=np.float64)
    return out


def scores(q: ArrayLike, k: ArrayLike) -> Array:
    """Step 2, relevance: ``scores[i, j] = q_i . k_j``, i.e. Q K^T. (..., L, E), (..., S, E) -> (..., L, S)."""
    k = np.asarray(k, dtype=np.float64)
    return np.asarray(q, dtype=np.float64) @ np.swapaxes(k, -1, -2)


def scale_scores(raw: ArrayLike, d_k: int, scale: float | None = None) -> Array:
    """Step 3, scaling: ``scores / sqrt(d_k)``, or ``scores * scale`` when a scale is given.

    Why: for q, k with unit-variance entries, var(q . k) = d_k; dividing by sqrt(d_k) brings
    it back to 1 so that softmax does not saturate.
    """
    factor = 1.0 / np.sqrt(d_k) if scale is None else float(scale)
    return np.asarray(raw, dtype=np.float64) * factor


def softmax(scaled: ArrayLike, mask: ArrayLike | None = None, sink: ArrayLike | None = None) -> tuple[Array, Array]:
    """Step 4, weights: ``softmax(x)_j = exp(x_j) / sum_t exp(x_t)`` over the last axis.

    Numerically stable (the row maximum is subtracted first, which changes nothing since
    softmax(x + c) = softmax(x)). ``mask``: bool (True = may attend) or float (added).
    Returns (weights, lse) with lse = log sum_t exp(x_t); a row with no visible key gets
    zero weights and lse = -inf.

    ``sink`` (broadcastable to (..., 1)): an attention sink, one more term in the denominator,
    ``exp(x_j) / (exp(sink) + sum_t exp(x_t))``; the maximum then runs over the sink too, and
    lse = log(exp(sink) + sum_t exp(x_t)). A row with no visible key still gets zeros.
    """
    x = np.array(scaled, dtype=np.float64)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            x = np.where(mask, x, -np.inf)
        else:
            x = x + mask.astype(np.float64)
    row_max = np.max(x, axis=-1, keepdims=True)
    empty = ~np.isfinite(row_max)  # every key masked (row max is -inf)
    if sink is not None:
        sink = np.asarray(sink, dtype=np.float64)
        row_max = np.maximum(row_max, sink)  # the max over the scores and the sink
    shifted = x - np.where(empty, 0.0, row_max)
    exponentials = np.exp(shifted)
    sums = exponentials.sum(axis=-1, keepdims=True)
    if sink is not None:
        sums = sums + np.exp(sink - np.where(empty, 0.0, row_max))  # the sink's term, no value
    weights = np.where(empty, 0.0, exponentials / np.where(empty, 1.0, sums))
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, np.log(np.where(empty, 1.0, sums)) + np.where(empty, 0.0, row_max))
    return weights, lse[..., 0]


def mix(weights: ArrayLike, v: ArrayLike) -> Array:
    """Step 5, mixing: ``output_i = sum_j weights[i, j] v_j``, i.e. weights V. (..., L, S), (..., S, Ev) -> (..., L, Ev)."""
    return np.asarray(weights, dtype=np.float64) @ np.asarray(v, dtype=np.float64)


def softcap_scores(scaled: ArrayLike, softcap: float) -> Array:
    """Soft cap: ``softcap * tanh(x / softcap)``, about x for |x| << softcap, never beyond +-softcap."""
    return float(softcap) * np.tanh(np.asarray(scaled, dtype=np.float64) / float(softcap))


def modify_scores(scaled: Array, score_mod: Callable[..., ArrayLike]) -> Array:
    """``score_mod(x, b, h, i, j)`` on broadcasting index arrays over the last four axes
    (b: batch, h: head, i: query, j: key), FlexAttention's contract written for NumPy."""
    shape = scaled.shape
    x = scaled.reshape((1,) * max(0, 4 - scaled.ndim) + shape)  # (..., B | 1, H | 1, L, S)
    lead = (1,) * (x.ndim - 4)
    sizes: tuple[int, ...] = x.shape[-4:]  # B | 1, H | 1, L, S
    b, h, i, j = (
        np.arange(n).reshape(lead + tuple(n if a == axis else 1 for a in range(4)))
        for axis, n in enumerate(sizes)
    )
    modified = np.broadcast_to(np.asarray(score_mod(x, b, h, i, j), dtype=np.float64), x.shape)
    return modified.reshape(shape).copy()


def _repeat_kv_heads(q: Array, kv: Array) -> Array:
    """Grouped-query attention: query head h reads key/value head h // (H // G)."""
    if q.ndim < 3 or kv.ndim < 3 or q.shape[-3] == kv.shape[-3]:
        return kv
    heads, groups = q.shape[-3], kv.shape[-3]
    if heads % groups != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({groups})")
    return np.repeat(kv, heads // groups, axis=-3)


def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    scale: float | None = None,
    *,
    bias: ArrayLike | None = None,
    softcap: float | None = None,
    score_mod: Callable[..., ArrayLike] | None = None,
    sinks: ArrayLike | None = None,
) -> Trace:
    """Scaled dot-product attention: ``softmax(Q K^T / sqrt(d_k) + mask) V``, every step kept.

    q (..., L, E), k (..., S, E), v (..., S, Ev); with head axes (..., H, L, E) and
    (..., G, S, E), H a multiple of G (grouped-query attention). ``mask`` is broadcastable
    to (..., L, S): bool True = may attend, or float added to the scaled scores.

    Score terms, in this order after scaling: ``softcap`` (x -> c tanh(x / c)), ``bias``
    (an array broadcastable to (..., L, S), added), ``score_mod`` (x, b, h, i, j) -> x on
    NumPy index arrays (`modify_scores`).

    ``sinks``: attention-sink logits, one per head, broadcastable to q's (..., H): (H,) or
    (B, H); each row's softmax gets exp(sink_h) in its denominator (`softmax`).
    """
    q = _as_float64(q, "q")
    k = _as_float64(k, "k")
    v = _as_float64(v, "v")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share their last dimension E, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length S, got {k.shape[-2]} and {v.shape[-2]}")
    kv_heads = k.shape[-3] if k.ndim >= 3 and q.ndim >= 3 and k.shape[-3] != q.shape[-3] else None
    k, v = _repeat_kv_heads(q, k), _repeat_kv_heads(q, v)
    d_k = q.shape[-1]
    raw = scores(q, k)  # (..., L, S)
    scaled = scale_scores(raw, d_k, scale)  # (..., L, S)
    logits = scaled if softcap is None else softcap_scores(scaled, softcap)  # (..., L, S)
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    if score_mod is not None:
        logits = modify_scores(logits, score_mod)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64)[..., None, None]  # (..., H, 1, 1)
    weights, lse = softmax(logits, mask, sink)  # (..., L, S), (..., L)
    output = mix(weights, v)  # (..., L, Ev)
    used_scale = 1.0 / np.sqrt(d_k) if scale is None else float(scale)
    return Trace(
        q=q, k=k, v=v, scores=raw, scaled=scaled, weights=weights, output=output, lse=lse,
        scale=used_scale, kv_heads=kv_heads, logits=logits, softcap=softcap, score_mod=score_mod is not None,
        sinks=sink,
    )


def attention_grads(
    trace: Trace, d_output: ArrayLike, d_lse: ArrayLike | None = None
) -> tuple[Array, Array, Array]:
    """Gradients of a scalar loss with respect to q, k and v, given d_output = dloss/doutput
    (and d_lse = dloss/dlse (..., L) when the loss also reads the log-sum-exp).

    The chain rule through the five steps, backwards:

    dV = P^T dO                                  (mix)
    dP = dO V^T
    dX = P * (dP - rowsum(dP * P))               (softmax; X are the logits: also d bias)
    dX += P * d_lse                              (lse_i = log sum_j exp(X_ij): d lse_i / d X_ij = P_ij)
    dX <- dX * (1 - tanh(x / c)^2)               (softcap, when set; x the scaled scores)
    dQ = scale * dX K,   dK = scale * dX^T Q     (scale, then score)

    Masked entries have P = 0 and so receive no gradient; a fully masked row contributes
    nothing. With grouped-query attention the gradients of the key/value heads that serve
    several query heads are summed over those heads. Shapes: dq like trace.q, dk and dv like
    the k and v passed to `attention` (before heads were repeated).
    """
    if trace.score_mod:
        raise ValueError("the reference cannot differentiate a score_mod (an opaque function)")
    d_out = np.asarray(d_output, dtype=np.float64)
    p = trace.weights
    dv = np.swapaxes(p, -1, -2) @ d_out  # (..., S, Ev)
    dx = logit_grads(trace, d_out)  # (..., L, S)
    if d_lse is not None:
        dx = dx + p * np.asarray(d_lse, dtype=np.float64)[..., None]  # (..., L, S)
    if trace.softcap is not None:
        dx = dx * (1.0 - np.tanh(trace.scaled / trace.softcap) ** 2)
    dq = trace.scale * dx @ trace.k  # (..., L, E)
    dk = trace.scale * np.swapaxes(dx, -1, -2) @ trace.q  # (..., S, E)
    return dq, _sum_repeated_heads(dk, trace.kv_heads), _sum_repeated_heads(dv, trace.kv_heads)


def logit_grads(trace: Trace, d_output: ArrayLike) -> Array:
    """dloss/dlogits (..., L, S) = P * (dP - rowsum(dP * P)), dP = dO V^T: the gradient of
    an additive bias (sum it over the axes the bias broadcasts on)."""
    d_out = np.asarray(d_output, dtype=np.float64)
    p = trace.weights
    dp = d_out @ np.swapaxes(trace.v, -1, -2)  # (..., L, S)
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


def _sum_repeated_heads(grad: Array, kv_heads: int | None) -> Array:
    """Undo `_repeat_kv_heads` for a gradient: (..., H, S, D) -> (..., G, S, D) by summing."""
    if kv_heads is None or grad.shape[-3] == kv_heads:
        return grad
    heads = grad.shape[-3]
    grouped = grad.reshape(*grad.shape[:-3], kv_heads, heads // kv_heads, *grad.shape[-2:])  # (..., G, r, S, D)
    return grouped.sum(axis=-3)


def self_attention(
    x: ArrayLike,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    mask: ArrayLike | None = None,
    scale: float | None = None,
) -> Trace:
    """Self-attention: queries, keys and values all come from the same sequence x.

    x (..., L, D); w_q, w_k (D, E); w_v (D, Ev). Q = X W_Q, K = X W_K, V = X W_V, then
    ``attention(Q, K, V)``. Output (..., L, Ev): one new vector per token.
    """
    return cross_attention(x, x, w_q, w_k, w_v, mask=mask, scale=scale)


def cross_attention(
    x: ArrayLike,
    context: ArrayLike,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    mask: ArrayLike | None = None,
    scale: float | None = None,
) -> Trace:
    """Cross-attention: queries from x, keys and values from another sequence, ``context``.

    x (..., L, D), context (..., S, Dc); w_q (D, E), w_k (Dc, E), w_v (Dc, Ev). The decoder
    reading the encoder: Q = X W_Q, K = C W_K, V = C W_V. Output (..., L, Ev).
    """
    x = _as_float64(x, "x")
    context = _as_float64(context, "context")
    q = project(x, w_q)  # (..., L, E)
    k = project(context, w_k)  # (..., S, E)
    v = project(context, w_v)  # (..., S, Ev)
    return attention(q, k, v, mask=mask, scale=scale)


def multi_head_attention(
    x: ArrayLike,
    w_q: Sequence[ArrayLike] | ArrayLike,
    w_k: Sequence[ArrayLike] | ArrayLike,
    w_v: Sequence[ArrayLike] | ArrayLike,
    w_o: ArrayLike,
    *,
    context: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    scale: float | None = None,
    b_q: ArrayLike | None = None,
    b_k: ArrayLike | None = None,
    b_v: ArrayLike | None = None,
    b_o: ArrayLike | None = None,
) -> MultiHeadTrace:
    """Multi-head attention: H heads, each with its own W_Q, W_K, W_V in a smaller subspace.

    head_h = Attention(X W_Q^h, C W_K^g, C W_V^g)  with g = h // (H // G)
    output = concat(head_1, ..., head_H) W_O (+ b_O)

    x (..., L, D); context (..., S, Dc), default x (self-attention); w_q (H, D, E);
    w_k (G, Dc, E); w_v (G, Dc, Ev); w_o (H * Ev, D_out); optional biases b_q (H, E),
    b_k (G, E), b_v (G, Ev), b_o (D_out,). ``mask`` is broadcastable to (..., H, L, S).
    """
    x = _as_float64(x, "x")
    context = x if context is None else _as_float64(context, "context")
    w_q, w_k, w_v = (np.asarray(w, dtype=np.float64) for w in (w_q, w_k, w_v))
    q = np.einsum("...ld,hde->...hle", x, w_q)  # (..., H, L, E)
    k = np.einsum("...sd,gde->...gse", context, w_k)  # (..., G, S, E)
    v = np.einsum("...sd,gde->...gse", context, w_v)  # (..., G, S, Ev)
    if b_q is not None:
        q = q + np.asarray(b_q, dtype=np.float64)[:, None, :]
    if b_k is not None:
        k = k + np.asarray(b_k, dtype=np.float64)[:, None, :]
    if b_v is not None:
        v = v + np.asarray(b_v, dtype=np.float64)[:, None, :]
    heads = attention(q, k, v, mask=mask, scale=scale)
    out = np.swapaxes(heads.output, -3, -2)  # (..., L, H, Ev)
    concat = out.reshape(*out.shape[:-2], -1)  # (..., L, H * Ev)
    output = concat @ np.asarray(w_o, dtype=np.float64)  # (..., L, D_out)
    if b_o is not None:
        output = output + np.asarray(b_o, dtype=np.float64)
    return MultiHeadTrace(heads=heads, concat=concat, output=output)
