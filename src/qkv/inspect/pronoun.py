"""Where a pronoun looks: the Winograd trophy sentences, head by head.

"The trophy did not fit into the suitcase because it was too big": "it" is the trophy; with
"too small" it is the suitcase. The seeds' claim is that attention lets "it" take in the
word it refers to. `pronoun_heads` measures, for every (layer, head) of a model, the weight
"it" gives "trophy" and "suitcase" in both sentences (`Inspection.attention_between`: a word
as a query looks the way its pieces look on average, a word as a key receives the sum of its
pieces' weights), heaviest on "trophy" in the "too big" sentence first. A head that resolves
the pronoun moves its weight from "trophy" to "suitcase" when the adjective changes.

Reference: Levesque, Davis and Morgenstern, "The Winograd Schema Challenge" (2012), whose
trophy/suitcase pair this is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkv.inspect.inspection import Inspection

__all__ = ["PRONOUN", "TROPHY_BIG", "TROPHY_SMALL", "PronounHead", "pronoun_heads"]

TROPHY_BIG = "The trophy did not fit into the suitcase because it was too big."
TROPHY_SMALL = "The trophy did not fit into the suitcase because it was too small."
PRONOUN = "it"


@dataclass(frozen=True)
class PronounHead:
    """The weight "it" gives each candidate in (layer, head), in both sentences (layers and
    heads numbered from 0)."""

    layer: int
    head: int
    big_trophy: float  # "... because it was too big": "it" is the trophy
    big_suitcase: float
    small_trophy: float  # "... because it was too small": "it" is the suitcase
    small_suitcase: float


def pronoun_heads(big: Inspection, small: Inspection) -> list[PronounHead]:
    """Every (layer, head) with the weight "it" gives "trophy" and "suitcase" in `TROPHY_BIG`
    (``big``) and `TROPHY_SMALL` (``small``), heaviest on "trophy" in ``big`` first.

    Raises ValueError when the inspections come from models of different sizes, or when a
    text lacks one of the words (as `Inspection.find` does).
    """
    if big.attentions.shape[:2] != small.attentions.shape[:2]:
        raise ValueError(
            f"the inspections come from different models: {big.num_layers} x {big.num_heads} and "
            f"{small.num_layers} x {small.num_heads} (layers x heads)"
        )
    weights = {
        (name, key): inspection.attention_between(PRONOUN, key)  # (layers, heads)
        for name, inspection in (("big", big), ("small", small))
        for key in ("trophy", "suitcase")
    }
    rows = [
        PronounHead(
            layer, head,
            *(float(weights[name, key][layer, head]) for name in ("big", "small") for key in ("trophy", "suitcase")),
        )
        for layer in range(big.num_layers)
        for head in range(big.num_heads)
    ]
    return sorted(rows, key=lambda r: -r.big_trophy)
