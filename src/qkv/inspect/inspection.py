"""An `Inspection`: one text run through a model, with everything needed to look inside.

Tokens, their character offsets and word ids, the exact attention probabilities of every
layer and head, and the hidden state after every layer. The viewers (`qkv.viz`) and the
CLI read this object; `Inspection.find`, `Inspection.top_attended`,
`Inspection.attention_between` and `context_similarity` answer the seeds' questions (where
does "it" look? does "bank" change with its context?); nothing is stashed inside the model
(attention maps are returned, never kept as side state). `qkv.inspect.pronoun` asks the
first of them of every head, on the Winograd trophy sentences.

Three more questions are answered here, each in its own module:
- `Inspection.steps`: the seeds' four steps (q.k, scale, softmax, mix) on one query row of
  one head, from the per-head projections the Inspection keeps (`qkv.inspect.steps`);
- `Inspection.head_roles`: how much each head looks at the previous / next token, itself,
  [CLS], [SEP] and punctuation, after Clark et al. 2019 (`qkv.inspect.roles`);
- `Inspection.rollout`: attention rollout through the layers, after Abnar & Zuidema 2020
  (`qkv.inspect.rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.inspect.roles import HeadRoles, head_roles
from qkv.inspect.rollout import rollout
from qkv.inspect.steps import Projections, StepTrace, steps

__all__ = ["HeadRoles", "Inspection", "Projections", "StepTrace", "context_similarity", "word_groups"]


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
    - projections: every layer's per-head q, k, v (see `Projections`), which `steps` needs;
      None when the model that made the Inspection did not provide them.
    """

    text: str
    tokens: list[str]
    offsets: list[tuple[int, int]]
    word_ids: list[int | None]
    attentions: torch.Tensor
    hidden_states: torch.Tensor
    model_name: str = ""
    projections: Projections | None = None

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
            start, end = self._span(group)
            out.append(self.text[start:end] if end > start else self.tokens[group[0]])
        return out

    def _span(self, group: list[int]) -> tuple[int, int]:
        """The characters of a word group, without the whitespace that byte-level BPE
        tokenizers (GPT-2, Llama 3, Qwen) count into a word's first token (" it")."""
        start, end = self.offsets[group[0]][0], self.offsets[group[-1]][1]
        while start < end and self.text[start].isspace():
            start += 1
        return start, end

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

    def steps(self, layer: int, head: int, query: int) -> StepTrace:
        """The seeds' four steps for token ``query`` in (layer, head), in float64: q, k, v,
        scores = k q, scaled, exponentials and their total, weights, output = weights @ v and
        each key's contribution (see `qkv.inspect.steps.StepTrace`). The weights are checked
        against ``attentions[layer, head, query]``.

            >>> import qkv
            >>> inspection = qkv.models.load_encoder().inspect("The cat sat.")
            >>> trace = inspection.steps(layer=0, head=0, query=2)
            >>> trace.q.shape, trace.k.shape, trace.weights.shape
            ((32,), (6, 32), (6,))
            >>> bool(abs(trace.weights - inspection.attentions[0, 0, 2].numpy()).max() < 1e-5)
            True
        """
        if self.projections is None:
            raise ValueError(
                "this Inspection holds no per-head projections (q, k, v), so its steps cannot be "
                f"shown; the model that made it ({self.model_name or 'unnamed'}) did not provide them "
                "(qkv's encoders do, and transformers models that run on attn_implementation='qkv')"
            )
        return steps(self.projections, self.attentions, layer, head, query)

    def head_roles(self) -> HeadRoles:
        """How much attention every head gives to the previous token, the next token, itself,
        [CLS], [SEP], punctuation and the rest, plus its row entropy (`qkv.inspect.roles`)."""
        return head_roles(self)

    def rollout(self, through: int | None = None) -> torch.Tensor:
        """Attention rollout (T, T) float64 from the embeddings through layer ``through``
        (default: all layers); row i is what top-layer token i draws from each input token
        (`qkv.inspect.rollout`)."""
        return rollout(self.attentions, through)

    # -- questions asked of an inspection ------------------------------------------------------

    def occurrences(self, word: str) -> list[list[int]]:
        """The token indices of every occurrence of ``word`` (case-insensitive), in text order;
        [] when it does not occur. Matches cover whole words, as in `find`."""
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"word must be a non-empty str, got {word!r}")
        target = word.strip().lower()
        real_groups = [g for g in self.groups if self.word_ids[g[0]] is not None]
        spans = [self._span(g) for g in real_groups]
        word_ends = {end for _, end in spans}
        matches: list[list[int]] = []
        for start, _ in spans:
            end = start + len(target)
            if self.text[start:end].lower() == target and end in word_ends:
                # every token of the words from this one up to the match's end
                matches.append([j for (s, e), g in zip(spans, real_groups, strict=True) if start <= s and e <= end for j in g])
        return matches

    def find(self, word: str, occurrence: int = 0) -> list[int]:
        """Token indices of ``word`` in the text (case-insensitive), e.g. [5, 6] for a word split
        into two pieces. The match must cover whole words: "it" is not found inside "fits", nor
        "unbel" in "unbelievable"; it may span several words ("New York"). ``occurrence`` picks
        the n-th match (0 = first). Raises ValueError naming the word when it is not there."""
        if isinstance(occurrence, bool) or not isinstance(occurrence, int):
            raise TypeError(f"occurrence must be an int (0 = the first), got {occurrence!r}")
        matches = self.occurrences(word)
        if not matches:
            real_groups = [g for g in self.groups if self.word_ids[g[0]] is not None]
            words = [self.text[slice(*self._span(g))] for g in real_groups]
            raise ValueError(f"{word!r} is not a word of the text; its words are {words}")
        if not 0 <= occurrence < len(matches):
            raise ValueError(
                f"{word!r} occurs {len(matches)} time(s) in the text; occurrence={occurrence} is out of "
                f"range (numbered from 0)"
            )
        return matches[occurrence]

    def top_attended(
        self, query: int | list[int], layer: int, head: int, k: int = 5
    ) -> list[tuple[int, float]]:
        """The k keys that ``query`` attends to most in (layer, head), as (token index, weight),
        heaviest first. ``query`` is a token index, or a word's token indices (see `find`), whose
        rows are averaged (a word looks the way its pieces look on average)."""
        T = len(self.tokens)
        rows = [query] if isinstance(query, int) else query  # a bool is refused just below
        if not isinstance(rows, (list, tuple)) or not all(_is_index(r) for r in rows):
            raise TypeError(f"query must be a token index (int) or a list of them, got {query!r}")
        if not rows or not all(0 <= r < T for r in rows):
            raise ValueError(f"query must be token indices in [0, {T}), got {query!r}")
        for name, value, count in (("layer", layer, self.num_layers), ("head", head, self.num_heads)):
            if not _is_index(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if not 0 <= value < count:
                raise ValueError(f"{name} must be in [0, {count}), got {value}")
        if not _is_index(k):
            raise TypeError(f"k must be an int, got {k!r}")
        if k < 1:
            raise ValueError(f"k must be a positive int, got {k}")
        weights = self.attentions[layer, head, rows].mean(dim=0)  # (T,)
        top = torch.topk(weights, min(k, T))
        return [(int(i), float(w)) for w, i in zip(top.values, top.indices, strict=True)]

    def attention_between(self, query: str, key: str, query_occurrence: int = 0, key_occurrence: int = 0) -> torch.Tensor:
        """The weight word ``query`` gives word ``key`` in every layer and head, (layers, heads):
        the query's pieces' rows averaged (a word looks the way its pieces look on average), the
        key's pieces' weights summed. Words are found as by `find` (whole words, the n-th
        occurrence); e.g. ``attention_between("it", "trophy")`` for the seeds' pronoun."""
        rows = self.find(query, query_occurrence)
        keys = self.find(key, key_occurrence)
        weights = self.attentions[:, :, rows].mean(dim=2)  # (layers, heads, T): the query word's row
        return weights[:, :, keys].sum(dim=-1)  # (layers, heads)

    def word_vectors(self, word: str, occurrence: int = 0) -> torch.Tensor:
        """``word``'s vector after every layer (layers + 1, D): the mean over its tokens."""
        return self.hidden_states[:, self.find(word, occurrence)].mean(dim=1)  # (layers + 1, D)


def _is_index(value: object) -> bool:
    """An int that is not a bool: True would silently mean token 1 (or select by mask)."""
    return isinstance(value, int) and not isinstance(value, bool)


def context_similarity(a: Inspection, b: Inspection, word: str) -> torch.Tensor:
    """Cosine similarity (layers + 1,) between ``word``'s vectors in two inspected texts, layer
    by layer; index 0 compares the embedding outputs. A word's vector starts from the same
    token embedding in both texts and drifts apart as attention mixes in each context (the
    seeds' "apple" the fruit vs the company)."""
    if a.hidden_states.shape[0] != b.hidden_states.shape[0] or a.hidden_states.shape[-1] != b.hidden_states.shape[-1]:
        raise ValueError(
            f"the inspections come from different models: hidden states {tuple(a.hidden_states.shape)} "
            f"and {tuple(b.hidden_states.shape)}"
        )
    vectors_a = a.word_vectors(word)  # (layers + 1, D)
    vectors_b = b.word_vectors(word)  # (layers + 1, D)
    return torch.nn.functional.cosine_similarity(vectors_a, vectors_b, dim=-1)  # (layers + 1,)
