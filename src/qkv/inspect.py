"""An `Inspection`: one text run through a model, with everything needed to look inside.

Tokens, their character offsets and word ids, the exact attention probabilities of every
layer and head, and the hidden state after every layer. The viewers (`qkv.viz`) and the
CLI read this object; nothing is stashed inside the model (attention maps are returned,
never kept as side state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Inspection", "word_groups"]


def word_groups(word_ids: list[int | None]) -> list[list[int]]:
    """Token indices grouped by word, in order; a token without a word id (``[CLS]``,
    ``[SEP]``) is a group of its own."""
    groups: list[list[int]] = []
    previous: int | None = None
    for index, word in enumerate(word_ids):
        if word is not None and word == previous and groups:
            groups[-1].append(index)
        else:
            groups.append([index])
        previous = word
    return groups


@dataclass(frozen=True, eq=False)
class Inspection:
    """One text as a model saw it.

    Shapes: T tokens, W words (see `word_groups`), layers x heads attention maps.
    - tokens: T token strings as the tokenizer wrote them (``[CLS]``, ``it``, ``##s`` ...).
    - offsets: T (start, end) character spans into ``text`` ((0, 0) for special tokens).
    - word_ids: T word indices, None for special tokens.
    - attentions: (layers, heads, T, T) float32, exact probabilities; row = query, column = key.
    - hidden_states: (layers + 1, T, D) float32; index 0 is the embedding output.
    """

    text: str
    tokens: list[str]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]
    attentions: torch.Tensor
    hidden_states: torch.Tensor
    model_name: str = ""

    @property
    def num_layers(self) -> int:
        return int(self.attentions.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.attentions.shape[1])

    @property
    def groups(self) -> list[list[int]]:
        """Token indices of each word (special tokens alone)."""
        return word_groups(self.word_ids)

    @property
    def words(self) -> list[str]:
        """The text of each word group, read from the character offsets."""
        out = []
        for group in self.groups:
            start, end = self.offsets[group[0]][0], self.offsets[group[-1]][1]
            out.append(self.text[start:end] if end > start else self.tokens[group[0]])
        return out

    def word_attentions(self) -> torch.Tensor:
        """Attention between words (layers, heads, W, W): a word as a key receives the sum of
        its pieces' weights; a word as a query looks the way its pieces look on average. Rows
        still sum to 1."""
        groups = self.groups
        T = len(self.tokens)
        assign = torch.zeros(T, len(groups), dtype=self.attentions.dtype)  # (T, W): token -> its word
        for w, group in enumerate(groups):
            assign[group, w] = 1.0
        keys_summed = self.attentions @ assign  # (layers, heads, T, W)
        mean_over_pieces = assign / assign.sum(dim=0, keepdim=True)  # (T, W), columns sum to 1
        return mean_over_pieces.T @ keys_summed  # (layers, heads, W, W)
