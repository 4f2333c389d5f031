"""Example 3, why the scores are divided by sqrt(d_k) (first article, detail 1).

If every entry of q and k is independent with mean 0 and variance 1, q.k is a sum of d_k
products of variance 1 each, so var(q.k) = d_k: at d_k = 64 a typical score is about
+-8. Scores that large saturate softmax: [1, 2, 3] becomes [0.09, 0.24, 0.67], but ten
times that, [10, 20, 30], becomes about [0, 0, 1], and the other tokens get almost no
weight and almost no gradient. Dividing by sqrt(d_k) brings the variance back to 1 for every
d_k. Here the variances are measured by sampling (seeded), not just stated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, table, vector
from qkv.reference import Array

__all__ = ["Result", "VarianceRow", "run"]

NAME = "scaling"
TITLE = "Why divide by sqrt(d_k): dot products grow with the dimension"
SUMMARY = (
    "var(q.k) = d_k for unit-variance entries, so big heads make big scores and a saturated "
    "softmax; dividing by sqrt(d_k) brings the variance back to 1."
)

DIMENSIONS = (1, 4, 16, 64, 256)
SAMPLES = 20_000  # pairs (q, k) per dimension: the variance estimate is good to ~1-2 %
SEED = 0
SOFTMAX_INPUTS = ((1.0, 2.0, 3.0), (10.0, 20.0, 30.0))
SOFTMAX_DIGITS = 2  # the article prints [0.09, 0.24, 0.67]


@dataclass(frozen=True)
class VarianceRow:
    """Sampled statistics of q.k for one d_k (``samples`` pairs of N(0, 1) vectors)."""

    d_k: int
    samples: int
    var_raw: float
    std_raw: float
    var_scaled: float
    std_scaled: float


@dataclass(frozen=True)
class Result(ExampleResult):
    """Measured variances per d_k and the two softmax rows of the article."""

    seed: int
    variances: tuple[VarianceRow, ...]
    softmax_inputs: Array  # (2, 3)
    softmax_outputs: Array  # (2, 3)

    def row(self, d_k: int) -> VarianceRow:
        return next(r for r in self.variances if r.d_k == d_k)

    def headline(self) -> str:
        r = self.row(64)
        return (
            f"d_k = 64: std(q.k) = {fmt(r.std_raw, 2)}, after / sqrt(d_k) {fmt(r.std_scaled, 2)}; "
            f"softmax{vector(self.softmax_inputs[1], 0)} = {vector(self.softmax_outputs[1], SOFTMAX_DIGITS)}"
        )

    def render(self) -> RenderableType:
        variances = table(
            ["d_k", "var(q.k)", "std(q.k)", "var(q.k / sqrt(d_k))", "std"],
            [
                [str(r.d_k), fmt(r.var_raw, 2), fmt(r.std_raw, 2), fmt(r.var_scaled, 2), fmt(r.std_scaled, 2)]
                for r in self.variances
            ],
            numeric=True,
        )
        soft = table(
            ["scores", "softmax"],
            [[vector(x, 0), vector(p, SOFTMAX_DIGITS)] for x, p in zip(self.softmax_inputs, self.softmax_outputs, strict=True)],
        )
        samples = self.variances[0].samples
        return Group(
            Text(f"q, k with N(0, 1) entries, {samples} sampled pairs per d_k (seed {self.seed})", style="italic"),
            variances,
            Text("var(q.k) follows d_k (std about 8 at d_k = 64); after scaling it is about 1.\n"),
            Text("Large scores make softmax nearly one-hot", style="italic"),
            soft,
        )


def measure(d_k: int, samples: int, rng: np.random.Generator) -> VarianceRow:
    """Sample ``samples`` pairs q, k ~ N(0, I_{d_k}) and measure var(q.k) before and after scaling."""
    q = rng.standard_normal((samples, d_k))  # (N, d_k)
    k = rng.standard_normal((samples, d_k))  # (N, d_k)
    raw = np.einsum("ne,ne->n", q, k)  # (N,): one q.k per pair
    scaled = reference.scale_scores(raw, d_k)  # (N,)
    return VarianceRow(
        d_k=d_k,
        samples=samples,
        var_raw=float(raw.var()),
        std_raw=float(raw.std()),
        var_scaled=float(scaled.var()),
        std_scaled=float(scaled.std()),
    )


def run() -> Result:
    """Measure var(q.k) for each d_k in DIMENSIONS and softmax the article's two rows."""
    rng = np.random.default_rng(SEED)
    inputs = np.array(SOFTMAX_INPUTS)  # (2, 3)
    outputs, _ = reference.softmax(inputs)
    return Result(
        seed=SEED,
        variances=tuple(measure(d, SAMPLES, rng) for d in DIMENSIONS),
        softmax_inputs=inputs,
        softmax_outputs=outputs,
    )
