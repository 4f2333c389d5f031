"""Example 5, cross-attention: queries from one sequence, keys and values from another
(first article, detail 2).

In the original Transformer the decoder "consults the encoder": while translating, the
words written so far ask the questions (Q = X W_Q from the decoder) and the source sentence
answers (K = C W_K, V = C W_V from the encoder). Nothing ties the two sides together: here
the decoder has L = 2 tokens of width D = 3, the encoder S = 3 tokens of width Dc = 4, the
questions and labels live in E = 3 dimensions and the values in Ev = 4. The weights are
L x S, one row per decoder token, and the output has one row per decoder token too.

The designed matrices: the decoder's "我" asks for the source word that plays the pronoun
role and "吃" for the verb; the encoder's words label themselves by role; the values hand
over the whole source vector, so each output row says which source word was read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, matrix_table, shape, side_by_side, table
from qkv.reference import Array, Trace

__all__ = ["Result", "run"]

NAME = "cross-attention"
TITLE = "Cross-attention: the decoder reads the encoder"
SUMMARY = (
    "Queries come from the translation written so far, keys and values from the source "
    "sentence; the weights are a rectangle, decoder tokens x encoder tokens."
)

ROLES = ("pronoun", "verb", "noun")  # E = 3: what a question asks for and a label says
DECODER_FEATURES = ("pronoun", "verb", "noun")  # D = 3
ENCODER_FEATURES = ("pronoun", "verb", "noun", "food")  # Dc = 4
DECODER = {"我": (1.0, 0.0, 0.0), "吃": (0.0, 1.0, 0.0)}  # the translation so far
ENCODER = {"I": (1.0, 0.0, 0.0, 0.0), "eat": (0.0, 1.0, 0.0, 0.0), "apples": (0.0, 0.0, 1.0, 1.0)}

QUESTION_STRENGTH = 3.0  # as in the apple example: how sharply a question asks
W_Q = QUESTION_STRENGTH * np.eye(3)  # (D=3, E=3): each decoder word asks for its own role
W_K = np.vstack([np.eye(3), np.zeros((1, 3))])  # (Dc=4, E=3): the role, without "food"
W_V = np.eye(4)  # (Dc=4, Ev=4): hand over the whole source vector


@dataclass(frozen=True)
class Result(ExampleResult):
    """Decoder rows x (L, D), encoder rows context (S, Dc), the matrices and the trace."""

    decoder_tokens: tuple[str, ...]
    encoder_tokens: tuple[str, ...]
    x: Array
    context: Array
    w_q: Array
    w_k: Array
    w_v: Array
    trace: Trace

    def read(self) -> list[tuple[str, str, float]]:
        """(decoder token, encoder token it weights most, that weight) per decoder token."""
        best = self.trace.weights.argmax(axis=1)
        return [
            (d, self.encoder_tokens[j], float(self.trace.weights[i, j]))
            for i, (d, j) in enumerate(zip(self.decoder_tokens, best, strict=True))
        ]

    def headline(self) -> str:
        reads = ", ".join(f"{d} -> {e} ({fmt(w)})" for d, e, w in self.read())
        return f"weights {shape(self.trace.weights)} (L x S): {reads}"

    def render(self) -> RenderableType:
        t = self.trace
        dec, enc = list(self.decoder_tokens), list(self.encoder_tokens)
        steps = (
            ("decoder X", "queries' side", self.x),
            ("encoder C", "keys' and values' side", self.context),
            ("Q", "X W_Q", t.q),
            ("K", "C W_K", t.k),
            ("V", "C W_V", t.v),
            ("scores", "Q K^T", t.scores),
            ("weights", "softmax(scores / sqrt(E))", t.weights),
            ("output", "weights V", t.output),
        )
        shapes = table(["step", "formula", "shape"], [[s, f, shape(a)] for s, f, a in steps])
        return Group(
            shapes,
            side_by_side(
                matrix_table("decoder X", self.x, dec, DECODER_FEATURES),
                matrix_table("encoder C", self.context, enc, ENCODER_FEATURES),
            ),
            side_by_side(
                matrix_table("Q = X W_Q", t.q, dec, ROLES),
                matrix_table("K = C W_K", t.k, enc, ROLES),
                matrix_table("V = C W_V", t.v, enc, ENCODER_FEATURES),
            ),
            side_by_side(
                matrix_table("scores = Q K^T", t.scores, dec, enc),
                matrix_table("scaled = scores / sqrt(3)", t.scaled, dec, enc),
                matrix_table("weights", t.weights, dec, enc),
            ),
            matrix_table("output = weights V", t.output, dec, ENCODER_FEATURES),
            Text("; ".join(f"{d} reads {e} (weight {fmt(w)})" for d, e, w in self.read()) + "\n"),
        )


def run() -> Result:
    """The decoder's two words attend over the encoder's three."""
    x = np.array(list(DECODER.values()))  # (L=2, D=3)
    context = np.array(list(ENCODER.values()))  # (S=3, Dc=4)
    return Result(
        decoder_tokens=tuple(DECODER),
        encoder_tokens=tuple(ENCODER),
        x=x,
        context=context,
        w_q=W_Q,
        w_k=W_K,
        w_v=W_V,
        trace=reference.cross_attention(x, context, W_Q, W_K, W_V),
    )
