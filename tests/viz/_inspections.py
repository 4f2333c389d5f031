"""Inspections built by hand for the viz tests: random softmax maps and hostile token text.

Building them here (not with the real model) keeps the tests fast and makes the expected
numbers independent of the code under test.
"""

from __future__ import annotations

import torch

from qkv.inspect import Inspection

# Token text that is markup, mathtext, a script terminator or a line break: all must show as typed.
HOSTILE = "<img src=x onerror=alert(1)>"
HOSTILE_TOKENS = [HOSTILE, "</script><b>x</b>", "$x$", "a&amp;b", "\u2028", "\\n"]


def make_inspection(
    words: list[list[str]], *, layers: int = 2, heads: int = 3, seed: int = 0
) -> Inspection:
    """[CLS] + the words' pieces + [SEP], with sharp random attention (rows sum to 1).

    ``words`` lists each word's pieces, e.g. [["the"], ["tro", "##phy"]]. The text is the
    pieces joined (without "##"), words separated by spaces.
    """
    tokens, offsets, word_ids = ["[CLS]"], [(0, 0)], [None]
    text = ""
    for w, pieces in enumerate(words):
        if w:
            text += " "
        for piece in pieces:
            bare = piece.removeprefix("##")
            tokens.append(piece)
            offsets.append((len(text), len(text) + len(bare)))
            word_ids.append(w)
            text += bare
    tokens.append("[SEP]")
    offsets.append((0, 0))
    word_ids.append(None)
    T = len(tokens)
    generator = torch.Generator().manual_seed(seed)
    # Scores with a wide spread so that some weights are near 1 and many near 0, as in real heads.
    scores = 3.0 * torch.randn(layers, heads, T, T, generator=generator)
    attentions = torch.softmax(scores, dim=-1)  # (layers, heads, T, T)
    hidden = torch.randn(layers + 1, T, 8, generator=generator)
    return Inspection(text, tokens, offsets, word_ids, attentions, hidden, model_name="handmade")


def make_projected_inspection(
    words: list[list[str]], *, layers: int = 2, heads: int = 4, kv_heads: int = 2, E: int = 6, seed: int = 0,
    decoder: bool = False,
) -> Inspection:
    """Like `make_inspection`, but the attention comes from random per-head q, k, v kept as
    `Projections` (grouped-query: head h reads key/value head h // (heads // kv_heads)), so
    that the steps of every row can be shown. ``decoder``: layer 0 is causal and the other
    layers see a window of the query and the 2 tokens before it, as a decoder's layers may
    differ (Gemma 2)."""
    from qkv.inspect import Projections

    base = make_inspection(words, layers=layers, heads=heads, seed=seed)
    T = len(base.tokens)
    generator = torch.Generator().manual_seed(seed + 1)
    q = 2 * torch.randn(layers, heads, T, E, generator=generator)
    k = 2 * torch.randn(layers, kv_heads, T, E, generator=generator)
    v = torch.randn(layers, kv_heads, T, E + 1, generator=generator)
    scale = E**-0.5
    scores = scale * q.double() @ k.double().repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2)  # (layers, H, T, T)
    allowed = None
    if decoder:
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = torch.stack([j <= i, *[(j <= i) & (j >= i - 2)] * (layers - 1)])  # (layers, T, T)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    attentions = torch.softmax(scores, dim=-1).float()
    return Inspection(
        base.text, base.tokens, base.offsets, base.word_ids, attentions, base.hidden_states,
        model_name="handmade", projections=Projections(q=q, k=k, v=v, scale=scale, allowed=allowed),
    )
