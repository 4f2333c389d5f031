"""Head roles of a model over many texts, and the built-in sentences they are measured on.

`head_roles(encoder, texts)` runs every text through `Encoder.inspect` and averages
`Inspection.head_roles` (the categories of Clark et al. 2019: previous token, next token,
itself, [CLS], [SEP], punctuation, the rest; plus row entropy), each text counting once.

`ROLE_SENTENCES` are varied English sentences written for qkv: short and long, questions,
lists, quotes, numbers, clauses that refer back ("it", "which"), so that heads tracking
neighbours, separators or punctuation show what they do on ordinary text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from qkv.inspect.inspection import HeadRoles
from qkv.models.encoder import TextTooLongError

if TYPE_CHECKING:
    from qkv.models.encoder import Encoder

__all__ = ["ROLE_SENTENCES", "head_roles"]

ROLE_SENTENCES = (
    "The trophy did not fit into the suitcase because it was too big.",
    "The trophy did not fit into the suitcase because it was too small.",
    "She bought apples, pears and a loaf of bread at the market.",
    "Apple released a new phone on Tuesday, and its shares rose.",
    "Where did you park the car last night?",
    "My grandmother, who is ninety, still walks to the village every morning.",
    "The river bank was muddy after three days of rain.",
    "He deposited the cheque at the bank before lunch.",
    "If it rains tomorrow, the match will be moved to Sunday.",
    "The committee, after a long debate, rejected the proposal.",
    "Cats sleep for most of the day; dogs, on the other hand, want to play.",
    "Please send the report to Maria by Friday at 5 p.m.",
    "The recipe calls for two eggs, 200 grams of flour and a pinch of salt.",
    "Nobody expected the quiet student to win the chess tournament.",
    "The old bridge, built in 1872, was finally closed to traffic.",
    "Why do leaves change colour in autumn?",
    "The children laughed when the clown slipped on the banana peel.",
    "Our train was delayed by forty minutes because of a signal failure.",
    "The doctor told him to drink more water and to rest.",
    "\"I will be back soon,\" she said, closing the door behind her.",
    "The company that makes these chairs is based in a small town in Sweden.",
    "Learning a language takes patience, practice and a little courage.",
    "The telescope revealed thousands of galaxies that no one had seen before.",
    "When the power went out, we lit candles and played cards.",
    "The keys were under the mat, exactly where he had left them.",
    "A good night's sleep improves memory and mood.",
    "The museum is closed on Mondays, but the garden stays open.",
    "They painted the fence white, then planted roses along it.",
    "The pilot announced that we would land twenty minutes early.",
    "Although the test was hard, most students passed it.",
    "The cat chased the mouse, which hid behind the fridge.",
    "Interest rates rose again, and house prices began to fall.",
    "Is this the road to the station, or should we turn left?",
    "The author signed copies of her new novel for two hours.",
    "Water boils at 100 degrees Celsius at sea level.",
    "He forgot his umbrella, so he arrived soaked to the skin.",
    "The orchestra played Beethoven's ninth symphony to a full hall.",
    "Before you leave, turn off the lights and lock the back door.",
    "The farmer sold his tomatoes, onions and potatoes at a fair price.",
    "Scientists found that the ancient tree is over four thousand years old.",
    "The waiter brought the soup, but it was cold.",
    "My brother lives in Toronto, where winters are long and snowy.",
    "The software update fixed the bug that crashed the app on start.",
    "Could you tell me how this machine works?",
    "The mountain village has one shop, one school and one church.",
    "After the storm, volunteers cleared the fallen trees from the road.",
    "The lawyer argued that the contract had never been signed.",
    "Birds migrate south when the days grow shorter.",
)


def head_roles(
    encoder: Encoder,
    texts: Sequence[str] = ROLE_SENTENCES,
    *,
    truncate: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> HeadRoles:
    """The roles of every head of ``encoder`` (qkv's `Encoder`, or a transformers model from
    `qkv.integrations.transformers.load_model`), averaged over ``texts`` (each text once).

    Raises ValueError naming the first empty text (or, unless ``truncate``, too long text)
    before any text is run. ``progress`` is called with (texts done, texts in all).
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("head_roles needs at least one text")
    for index, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"text {index} is empty or not a str: {text!r}")
    # a too-long text is refused before any work; a model without a position limit has none
    limit = encoder.max_tokens
    counts = encoder.token_counts(texts)
    too_long = [i for i, n in enumerate(counts) if limit is not None and n > limit]
    if too_long and not truncate and limit is not None:
        first = too_long[0]
        raise TextTooLongError(count=len(too_long), index=first, tokens=counts[first], limit=limit)
    parts = []
    for done, text in enumerate(texts, start=1):
        parts.append(encoder.inspect(text, truncate=truncate).head_roles())
        if progress is not None:
            progress(done, len(texts))
    return HeadRoles.mean(parts)
