"""Example 8, contextual meaning: the same word leaves attention with different vectors.

Looking a word up in the embedding table always gives the same vector; "我爱吃苹果" and
"苹果发布了新手机" start from the same 苹果. Attention mixes in the context, so what comes
out differs by sentence. With the apple example's designed matrices, 苹果 puts the same
weight, 0.807, on the verb of each sentence; only what the verb hands over differs: food
after 吃, tech after 发布, and neither after 买 (a verb that says nothing about fruit or
phones leaves 苹果 undecided).

In a trained model the same happens with learned matrices and many layers: "bank" by a
river or by money, "it" in "the trophy did not fit in the suitcase because it was too big".
`qkv inspect TEXT` (and `qkv context`) show it on a real pretrained encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, table, vector
from qkv.examples.apple import FEATURES, WORDS, SentenceRun, run_sentence
from qkv.reference import Array

__all__ = ["Result", "run"]

NAME = "context"
TITLE = "Context: the same word leaves attention with different vectors"
SUMMARY = (
    "苹果 enters every sentence as the same vector and leaves each with a different one: "
    "the weights find the verb, the verb's content decides the meaning."
)

FOCUS = "苹果"
# 买 (buy) is a verb with no food or tech meaning
VOCABULARY: dict[str, tuple[float, ...]] = {**WORDS, "买": (1.0, 0.0, 0.0, 0.0)}
SENTENCES = (("我", "吃", "苹果"), ("苹果", "发布", "手机"), ("我", "买", "苹果"))


def _cosine(a: Array, b: Array) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@dataclass(frozen=True)
class Result(ExampleResult):
    """Each sentence's run; ``inputs`` (N, 4) and ``outputs`` (N, 2) are the focus word's rows,
    ``cosine`` (N, N) the cosine similarity of its outputs across sentences."""

    focus: str
    sentences: tuple[SentenceRun, ...]
    inputs: Array
    outputs: Array
    focus_weights: tuple[Array, ...]  # the focus word's weights (L,) in each sentence
    cosine: Array

    def headline(self) -> str:
        parts = [f"{' '.join(s.tokens)} -> {vector(o)}" for s, o in zip(self.sentences, self.outputs, strict=True)]
        return f"{self.focus} [food, tech]: " + "; ".join(parts)

    def render(self) -> RenderableType:
        rows = []
        for run, x, w, out in zip(self.sentences, self.inputs, self.focus_weights, self.outputs, strict=True):
            looked_at = int(np.argmax(w))
            rows.append(
                [" ".join(run.tokens), vector(x), f"{fmt(w[looked_at])} on {run.tokens[looked_at]}", vector(out)]
            )
        summary = table(
            ["sentence", f"{self.focus} in [{', '.join(FEATURES)}]", "largest weight", "out [food, tech]"], rows
        )
        names = [" ".join(s.tokens) for s in self.sentences]
        cosine = table(["cosine of outputs", *names], [[n, *(fmt(c) for c in row)] for n, row in zip(names, self.cosine, strict=True)], numeric=True)
        return Group(
            summary,
            Text("Same input vector in every sentence (cosine 1); after attention:", style="italic"),
            cosine,
            Text(
                "On a real pretrained encoder: qkv context bank \"I sat on the bank of the river.\" "
                "\"I paid at the bank.\" compares one word's vectors in two texts, layer by layer; "
                "qkv inspect TEXT --token it shows where each head looks from a word.\n"
            ),
        )


def run() -> Result:
    """苹果 in three sentences, with the apple example's matrices."""
    runs = tuple(run_sentence(tokens, VOCABULARY) for tokens in SENTENCES)
    rows = [run.index(FOCUS) for run in runs]
    outputs = np.array([run.trace.output[i] for run, i in zip(runs, rows, strict=True)])  # (N, 2)
    count = len(runs)
    return Result(
        focus=FOCUS,
        sentences=runs,
        inputs=np.array([run.x[i] for run, i in zip(runs, rows, strict=True)]),  # (N, 4)
        outputs=outputs,
        focus_weights=tuple(run.trace.weights[i] for run, i in zip(runs, rows, strict=True)),
        cosine=np.array([[_cosine(outputs[a], outputs[b]) for b in range(count)] for a in range(count)]),
    )
