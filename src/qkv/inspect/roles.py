"""Head roles: where each head's attention goes, in the categories of Clark et al. (2019).

Clark, Khandelwal, Levy and Manning, "What Does BERT Look At? An Analysis of BERT's
Attention", measure for every head how much attention goes to the previous token, the next
token, the token itself, [CLS], [SEP] and punctuation, and how spread out each row is (its
entropy). `head_roles` does this for one Inspection; `HeadRoles.mean` averages texts.

The categories split every row's weight (which sums to 1) into parts that add up to 1, so a
key counts once, by the first category that fits, in this order:

    cls        the special token that opens the text (position 0, no word: [CLS], <s>)
    sep        any other special token ([SEP], </s>)
    self       the query token itself
    previous   the token just before the query
    next       the token just after the query
    punctuation  a token whose characters are all Unicode punctuation (".", ",", "?", ...)
    rest       everything else

Special tokens are the ones without a word id, so no model's spelling is hard-coded. Every
query row counts, [CLS] and [SEP] included, as in the paper; shares and entropy are the mean
over the rows of a text. Entropy is in nats (log base e): 0 for a head that puts all weight
on one key, log T for a uniform row.
"""

from __future__ import annotations

import operator
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from qkv.inspect.inspection import Inspection

__all__ = ["ROLES", "HeadRoles", "head_roles", "key_categories"]

ROLES = ("previous", "next", "self", "cls", "sep", "punctuation", "rest")
ROLE_TEXT = {
    "previous": "the previous token",
    "next": "the next token",
    "self": "itself",
    "cls": "[CLS]",
    "sep": "[SEP]",
    "punctuation": "punctuation",
    "rest": "the other tokens",
}
_CLS, _SEP, _PUNCT = ROLES.index("cls"), ROLES.index("sep"), ROLES.index("punctuation")
_SELF, _PREV, _NEXT, _REST = ROLES.index("self"), ROLES.index("previous"), ROLES.index("next"), ROLES.index("rest")


@dataclass(frozen=True, eq=False)
class HeadRoles:
    """Role shares of every head.

    - shares: (layers, heads, len(ROLES)) float64, the mean share of a query row's weight that
      goes to each role (in the order of `ROLES`); the last axis sums to 1.
    - entropy: (layers, heads) float64, the mean row entropy in nats.
    - texts: how many texts were averaged.
    """

    shares: torch.Tensor
    entropy: torch.Tensor
    texts: int = 1

    @property
    def num_layers(self) -> int:
        return int(self.shares.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.shares.shape[1])

    def share(self, role: str) -> torch.Tensor:
        """(layers, heads) shares of one role."""
        return self.shares[..., _role_index(role)]

    def strongest(self, role: str) -> tuple[int, int, float]:
        """(layer, head, share) of the head that gives ``role`` the largest share."""
        share = self.share(role)  # (layers, heads)
        flat = int(torch.argmax(share))
        layer, head = divmod(flat, self.num_heads)
        return layer, head, float(share[layer, head])

    def dominant(self) -> torch.Tensor:
        """(layers, heads) int64: the index into `ROLES` of each head's largest share."""
        return torch.argmax(self.shares, dim=-1)

    def records(self) -> list[dict[str, Any]]:
        """One record per (layer, head): layer, head, every role's share, entropy, dominant role."""
        dominant = self.dominant()
        out = []
        for layer in range(self.num_layers):
            for head in range(self.num_heads):
                record: dict[str, Any] = {"layer": layer, "head": head}
                record.update({role: float(self.shares[layer, head, r]) for r, role in enumerate(ROLES)})
                record["entropy"] = float(self.entropy[layer, head])
                record["dominant"] = ROLES[int(dominant[layer, head])]
                out.append(record)
        return out

    @staticmethod
    def mean(parts: Sequence[HeadRoles]) -> HeadRoles:
        """The average of several texts' roles, each text counting once (weighted by its
        number of texts when the parts are averages themselves)."""
        if not parts:
            raise ValueError("HeadRoles.mean needs at least one HeadRoles")
        shapes = {tuple(p.shares.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"cannot average head roles of different models: shapes {sorted(shapes)}")
        counts = torch.tensor([p.texts for p in parts], dtype=torch.float64)  # (N,)
        w = counts / counts.sum()
        shares = reduce(operator.add, (wi * p.shares for wi, p in zip(w, parts, strict=True)))
        entropy = reduce(operator.add, (wi * p.entropy for wi, p in zip(w, parts, strict=True)))
        return HeadRoles(shares=shares, entropy=entropy, texts=int(counts.sum()))


def _role_index(role: str) -> int:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return ROLES.index(role)


def _is_punctuation(text: str) -> bool:
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def key_categories(inspection: Inspection) -> torch.Tensor:
    """(T, T) int64: the role index of key j for query i (see the module docstring)."""
    T = len(inspection.tokens)
    special = torch.tensor([w is None for w in inspection.word_ids])  # (T,)
    punctuation = torch.tensor(
        [
            w is not None and _is_punctuation(inspection.text[start:end])
            for w, (start, end) in zip(inspection.word_ids, inspection.offsets, strict=True)
        ]
    )  # (T,)
    i = torch.arange(T)[:, None]  # (T, 1) query
    j = torch.arange(T)[None, :]  # (1, T) key
    categories = torch.full((T, T), _REST, dtype=torch.int64)  # (T, T)
    # Assigned from the last category in priority to the first, so the first that fits wins.
    categories[punctuation[None, :].expand(T, T)] = _PUNCT
    categories[(j == i + 1).expand(T, T)] = _NEXT
    categories[(j == i - 1).expand(T, T)] = _PREV
    categories[(j == i).expand(T, T)] = _SELF
    is_cls = torch.zeros(T, dtype=torch.bool)
    is_cls[0] = bool(special[0])
    categories[(special & ~is_cls)[None, :].expand(T, T)] = _SEP
    categories[is_cls[None, :].expand(T, T)] = _CLS
    return categories


def head_roles(inspection: Inspection) -> HeadRoles:
    """Role shares and row entropy of every head of one inspected text."""
    attentions = inspection.attentions.detach().to("cpu", torch.float64)  # (layers, H, T, T)
    T = attentions.shape[-1]
    one_hot = torch.nn.functional.one_hot(key_categories(inspection), len(ROLES)).to(torch.float64)  # (T, T, R)
    # shares[l, h, r] = mean over queries i of sum over keys j in role r of attentions[l, h, i, j]
    shares = torch.einsum("lhij,ijr->lhr", attentions, one_hot) / T  # (layers, H, R)
    logs = torch.where(attentions > 0, torch.log(attentions.clamp_min(torch.finfo(torch.float64).tiny)), 0.0)
    entropy = -(attentions * logs).sum(dim=-1).mean(dim=-1)  # (layers, H)
    return HeadRoles(shares=shares, entropy=entropy, texts=1)
