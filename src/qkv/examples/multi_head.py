"""Example 6, multi-head attention: the second article's sketch, run for real.

    # one head, sketched (Q, K, V already projected)
    scores = Q @ K.T / sqrt(d_k)
    weights = softmax(scores)
    out = weights @ V
    # multi-head: do the above H times in parallel, then
    combined = concat(out_1, ..., out_H) @ W_O

(qkv numbers heads from 0, as everywhere: the article's out_1 ... out_H are heads 0 ... H - 1.)

H = 2 heads, each with its own W_Q, W_K, W_V projecting the D = 8 model width to a smaller
E = Ev = 4 subspace (D / H, the usual split), then the heads' outputs side by side (L x H*Ev)
and W_O (H*Ev x D) mixing them back to one vector per token. The embeddings and matrices are
random (seeded, scaled like a standard initialization): in a trained model they are learned;
here the point is the shapes and that the sketch, looped head by head, equals
`qkv.reference.multi_head_attention`, which does all heads at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import matrix_table, shape, side_by_side, table
from qkv.reference import Array, MultiHeadTrace

__all__ = ["Result", "run", "sketch"]

NAME = "multi-head"
TITLE = "Multi-head attention: H smaller heads, concatenated, mixed by W_O"
SUMMARY = (
    "Each head has its own W_Q, W_K, W_V in a smaller subspace and its own weights; the "
    "outputs are concatenated and W_O mixes them back to d_model."
)

TOKENS = ("獎盃", "塞不進", "手提箱", "因為", "它", "太大")
D_MODEL = 8
HEADS = 2
D_HEAD = D_MODEL // HEADS  # E = Ev = 4
SEED = 0


def _softmax_rows(x: Array) -> Array:
    e = np.exp(x - x.max(axis=-1, keepdims=True))  # minus the row max: same result, no overflow
    return e / e.sum(axis=-1, keepdims=True)


def sketch(x: Array, w_q: Array, w_k: Array, w_v: Array, w_o: Array) -> tuple[list[Array], Array, Array]:
    """The article's sketch, line for line, one head at a time: (outs, concat, combined).

    x (L, D); w_q, w_k (H, D, E); w_v (H, D, Ev); w_o (H * Ev, D).
    """
    outs = []
    for h in range(w_q.shape[0]):
        Q, K, V = x @ w_q[h], x @ w_k[h], x @ w_v[h]  # (L, E), (L, E), (L, Ev)
        d_k = Q.shape[-1]
        scores = Q @ K.T / np.sqrt(d_k)  # (L, L)
        weights = _softmax_rows(scores)  # (L, L)
        outs.append(weights @ V)  # (L, Ev)
    concat = np.concatenate(outs, axis=-1)  # (L, H * Ev)
    return outs, concat, concat @ w_o  # (L, D)


@dataclass(frozen=True)
class Result(ExampleResult):
    """Inputs, per-head matrices, the reference's trace and the sketch's agreement with it."""

    tokens: tuple[str, ...]
    x: Array  # (L, D)
    w_q: Array  # (H, D, E)
    w_k: Array  # (H, D, E)
    w_v: Array  # (H, D, Ev)
    w_o: Array  # (H * Ev, D)
    trace: MultiHeadTrace
    sketch_output: Array  # (L, D)
    sketch_difference: float  # max |sketch - reference|

    def headline(self) -> str:
        t = self.trace
        return (
            f"x {shape(self.x)} -> {self.w_q.shape[0]} heads of q {shape(t.heads.q[0])} -> concat "
            f"{shape(t.concat)} -> output {shape(t.output)}; sketch = reference to {self.sketch_difference:.1g}"
        )

    def render(self) -> RenderableType:
        t, words = self.trace, list(self.tokens)
        H = self.w_q.shape[0]
        rows = [
            ("x", "embeddings, one row per token", self.x),
            ("W_Q^h, W_K^h", "per head", self.w_q[0]),
            ("W_V^h", "per head", self.w_v[0]),
            ("Q_h, K_h", "x W_Q^h, x W_K^h", t.heads.q[0]),
            ("V_h", "x W_V^h", t.heads.v[0]),
            ("scores_h", "Q_h K_h^T / sqrt(d_k)", t.heads.scaled[0]),
            ("weights_h", "softmax per row", t.heads.weights[0]),
            ("out_h", "weights_h V_h", t.heads.output[0]),
            ("concat", f"[out_0 ... out_{H - 1}]", t.concat),
            ("W_O", "mixes the heads", self.w_o),
            ("output", "concat W_O", t.output),
        ]
        steps = table(["step", "formula", "shape"], [[s, f, shape(a)] for s, f, a in rows])
        heads = side_by_side(
            *(matrix_table(f"head {h} weights", t.heads.weights[h], words, words, digits=2) for h in range(H))
        )
        return Group(
            steps,
            Text(f"Each head attends differently (heads 0 to {H - 1}; row: query, column: key)", style="italic"),
            heads,
            matrix_table("output = concat W_O", t.output, words, [str(d) for d in range(t.output.shape[-1])], digits=2),
            Text(
                f"The sketch, looped over heads, equals qkv.reference.multi_head_attention: "
                f"max |difference| = {self.sketch_difference:.2g}\n"
            ),
        )


def run() -> Result:
    """Random (seeded) embeddings and weights, through the reference and through the sketch."""
    rng = np.random.default_rng(SEED)
    L = len(TOKENS)
    x = rng.standard_normal((L, D_MODEL))  # (L, D)
    init = 1.0 / np.sqrt(D_MODEL)  # keeps q, k, v entries at unit variance
    w_q, w_k, w_v = (init * rng.standard_normal((HEADS, D_MODEL, D_HEAD)) for _ in range(3))  # (H, D, E)
    w_o = rng.standard_normal((HEADS * D_HEAD, D_MODEL)) / np.sqrt(HEADS * D_HEAD)  # (H * Ev, D)
    trace = reference.multi_head_attention(x, w_q, w_k, w_v, w_o)
    _, _, combined = sketch(x, w_q, w_k, w_v, w_o)
    return Result(
        tokens=TOKENS,
        x=x,
        w_q=w_q,
        w_k=w_k,
        w_v=w_v,
        w_o=w_o,
        trace=trace,
        sketch_output=combined,
        sketch_difference=float(np.abs(combined - trace.output).max()),
    )
