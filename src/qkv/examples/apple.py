"""Example 2, the first article's "我 吃 苹果": how W_Q, W_K and W_V turn one vector into a
question, a label and a content.

Words are d_model = 4 vectors over [verb, noun, food, tech]:
我 = [0, 1, 0, 0], 吃 = [1, 0, 1, 0], 苹果 = [0, 1, 0.5, 0.5] (half food, half tech: it does
not know yet which 苹果 it is), and for the second sentence 发布 = [1, 0, 0, 1],
手机 = [0, 1, 0, 1]. d_k = d_v = 2, so each matrix is 4 x 2; row i says what feature i
becomes.

The matrices, reconstructed from the article's words and checked against its numbers:

    W_K (labels)          W_Q (questions)        W_V (content)
           verb noun            verb? noun?            food tech
    verb  [ 1    0 ]     verb  [ 0     3 ]      verb  [ 0    0 ]
    noun  [ 0    1 ]     noun  [ 3     0 ]      noun  [ 0    0 ]
    food  [ 0    0 ]     food  [ 0     0 ]      food  [ 1    0 ]
    tech  [ 0    0 ]     tech  [ 0     0 ]      tech  [ 0    1 ]

- W_K "keeps verb and noun unchanged and drops the rest": its label says "I am a verb" or
  "I am a noun".
- W_Q "translates I am a noun into I look for a verb" (and a verb into "I look for a noun"):
  its two columns are crossed with respect to W_K.
- W_V ignores the part of speech and passes on food and tech.

The words fix every entry except the strength of the question, the 3 in W_Q (a factor in
W_K instead would give the same scores; "unchanged" in the article puts it in W_Q). The
article's 0.807 pins it: 苹果's q = [c, 0] matches only 吃's key [1, 0], so its scaled scores
are (0, c / sqrt(2), 0) and its weight on 吃 is e^(c/√2) / (e^(c/√2) + 2). That rounds to
0.807 only for c in [2.999, 3.008); c = 3 gives 0.80662, and then 苹果's output is
0.80662 [1, 0] + 0.09669 [0.5, 0.5] = [0.855, 0.048] as printed. In "苹果 发布 手机" the
same weights land on 发布 and 苹果 becomes [0.048, 0.952]: tech.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, matrix_table, side_by_side, vector
from qkv.reference import Array, Trace

__all__ = ["Result", "SentenceRun", "run", "run_sentence"]

NAME = "apple"
TITLE = "我 吃 苹果: designed W_Q, W_K, W_V turn a vector into question, label and content"
SUMMARY = (
    "苹果 starts half food, half tech. Its question (q) looks for a verb, the verb's label (k) "
    "answers, and the verb's content (v) decides which 苹果 it is."
)

FEATURES = ("verb", "noun", "food", "tech")
KEY_AXES = ("is verb", "is noun")  # what W_K's two columns mean
QUERY_AXES = ("wants verb", "wants noun")  # W_Q's columns, matched against KEY_AXES
VALUE_AXES = ("food", "tech")

WORDS: dict[str, tuple[float, ...]] = {
    "我": (0.0, 1.0, 0.0, 0.0),
    "吃": (1.0, 0.0, 1.0, 0.0),
    "苹果": (0.0, 1.0, 0.5, 0.5),
    "发布": (1.0, 0.0, 0.0, 1.0),
    "手机": (0.0, 1.0, 0.0, 1.0),
}

# How strongly a question asks; the article's 0.807 pins it to 3 (module docstring).
QUESTION_STRENGTH = 3.0
W_K = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])  # (D=4, E=2)
W_Q = QUESTION_STRENGTH * np.array([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # (D=4, E=2)
W_V = np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # (D=4, Ev=2)

SENTENCES = (("我", "吃", "苹果"), ("苹果", "发布", "手机"))
FOCUS = "苹果"


@dataclass(frozen=True)
class SentenceRun:
    """Self-attention over one sentence with the designed matrices.

    x (L, 4); trace: q, k (L, 2), v (L, 2), scores, scaled, weights (L, L), output (L, 2);
    exponentials (L, L) = exp(scaled) before normalization.
    """

    tokens: tuple[str, ...]
    x: Array
    trace: Trace
    exponentials: Array

    def index(self, token: str) -> int:
        return self.tokens.index(token)

    def render(self, focus: str) -> list[RenderableType]:
        t, words = self.trace, list(self.tokens)
        i = self.index(focus)
        verb = max(range(len(words)), key=lambda j: t.weights[i, j])
        return [
            Text(" ".join(words), style="bold underline"),
            side_by_side(
                matrix_table("X (embedding)", self.x, words, FEATURES),
                matrix_table("Q = X W_Q", t.q, words, QUERY_AXES),
                matrix_table("K = X W_K", t.k, words, KEY_AXES),
                matrix_table("V = X W_V", t.v, words, VALUE_AXES),
            ),
            Text("row: query, column: key", style="dim"),
            side_by_side(
                matrix_table("scores = Q K^T", t.scores, words, words),
                matrix_table(f"scaled = scores / sqrt({t.q.shape[-1]})", t.scaled, words, words),
                matrix_table("exp(scaled)", self.exponentials, words, words),
                matrix_table("weights = softmax(scaled)", t.weights, words, words),
                matrix_table("output = weights V", t.output, words, VALUE_AXES),
            ),
            Text(
                f"{focus}: weight {fmt(t.weights[i, verb])} on {words[verb]}; "
                f"[food, tech] {vector(self.x[i, 2:])} -> {vector(t.output[i])}\n"
            ),
        ]


def run_sentence(
    tokens: Sequence[str],
    words: Mapping[str, Sequence[float]] = WORDS,
    x: Array | None = None,
) -> SentenceRun:
    """Self-attention of the designed matrices over ``tokens`` (or over explicit rows ``x``)."""
    x = np.array([words[t] for t in tokens], dtype=np.float64) if x is None else x  # (L, 4)
    trace = reference.self_attention(x, W_Q, W_K, W_V)
    return SentenceRun(tokens=tuple(tokens), x=x, trace=trace, exponentials=np.exp(trace.scaled))


@dataclass(frozen=True)
class Result(ExampleResult):
    """The matrices and both sentences; ``focus`` is the word the article follows."""

    features: tuple[str, ...]
    w_q: Array
    w_k: Array
    w_v: Array
    focus: str
    sentences: tuple[SentenceRun, ...]

    def focus_row(self, sentence: int) -> tuple[Array, Array]:
        """(weights (L,), output (2,)) of the focus word in sentence ``sentence``."""
        run = self.sentences[sentence]
        i = run.index(self.focus)
        return run.trace.weights[i], run.trace.output[i]

    def headline(self) -> str:
        parts = []
        for run in self.sentences:
            i = run.index(self.focus)
            parts.append(f"{' '.join(run.tokens)}: {self.focus} -> [food, tech] {vector(run.trace.output[i])}")
        return "; ".join(parts)

    def render(self) -> RenderableType:
        parts: list[RenderableType] = [
            side_by_side(
                matrix_table("W_K: part of speech", self.w_k, FEATURES, KEY_AXES),
                matrix_table("W_Q: noun wants verb", self.w_q, FEATURES, QUERY_AXES),
                matrix_table("W_V: meaning", self.w_v, FEATURES, VALUE_AXES),
            )
        ]
        for run in self.sentences:
            parts.extend(run.render(self.focus))
        return Group(*parts)


def run() -> Result:
    """Both sentences of the article with the same three matrices."""
    return Result(
        features=FEATURES,
        w_q=W_Q,
        w_k=W_K,
        w_v=W_V,
        focus=FOCUS,
        sentences=tuple(run_sentence(tokens) for tokens in SENTENCES),
    )
