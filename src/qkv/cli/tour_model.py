"""The tour's second half: a real pretrained model's attention, drawn and written to disk.

The seeds claim that attention turns a context-free embedding into a contextual one: "it"
absorbs "the trophy", "apple" becomes a fruit or a company. This section shows it on
all-MiniLM-L6-v2 (6 layers x 12 heads, shipped in a PyPI package, run on qkv's modules):

1. the trophy sentence and its "too small" twin: which heads send "it" to "trophy", and
   which of them move to "suitcase" when the adjective changes;
2. context: the same word ("apple", "bank") in two sentences, cosine similarity layer by
   layer, identical tokens drifting apart with depth;
3. head roles: for each of Clark et al.'s categories (previous / next token, itself, [CLS],
   [SEP], punctuation), the head that sends the largest share there, measured over qkv's
   built-in sentences: the seeds' claim that heads specialize, answered with the model's numbers;
4. artifacts: heatmaps (PNG) of the most telling layer and head, a standalone HTML viewer per
   sentence, and two compare viewers (trophy big / small, apple fruit / company) that show
   both sentences under one layer/head selection with a difference view.

The model is English-only, so the seeds' Chinese apple sentences (我爱吃苹果 / 苹果发布了新手机)
are given in English here; the worked `apple` example keeps the Chinese.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

# the sentences only: qkv.inspect.pronoun imports no torch
from qkv.inspect.pronoun import TROPHY_BIG, TROPHY_SMALL

if TYPE_CHECKING:
    from qkv.cli.tour_context import TourContext
    from qkv.inspect.inspection import Inspection
    from qkv.inspect.pronoun import PronounHead

__all__ = ["SENTENCES", "model_section"]

@dataclass(frozen=True)
class Sentence:
    """A sentence the tour inspects; ``slug`` names its files."""

    slug: str
    text: str


SENTENCES: tuple[Sentence, ...] = (
    Sentence("trophy-big", TROPHY_BIG),
    Sentence("trophy-small", TROPHY_SMALL),
    Sentence("apple-fruit", "I love eating an apple every day."),
    Sentence("apple-company", "Apple released a new phone today."),
    Sentence("bank-river", "We sat on the bank of the river."),
    Sentence("bank-money", "She deposited the money at the bank."),
)
# (word, sentence slug a, sentence slug b) compared layer by layer
CONTEXT_PAIRS: tuple[tuple[str, str, str], ...] = (
    ("apple", "apple-fruit", "apple-company"),
    ("bank", "bank-river", "bank-money"),
)
TOP_HEADS = 5
# The pairs drawn side by side in one viewer: (file slug, sentence a, sentence b).
COMPARE_PAIRS: tuple[tuple[str, str, str], ...] = (
    ("trophy-compare", "trophy-big", "trophy-small"),
    ("apple-compare", "apple-fruit", "apple-company"),
)


def _heads_table(rows: list[PronounHead]) -> Table:
    table = Table(title='Where "it" looks: the heads that send it to "trophy" (weights summed over word pieces)')
    for col in ("layer (from 0)", "head (from 0)", "too big: trophy", "too big: suitcase", "too small: trophy", "too small: suitcase"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.layer), str(r.head),
            f"{r.big_trophy:.3f}", f"{r.big_suitcase:.3f}", f"{r.small_trophy:.3f}", f"{r.small_suitcase:.3f}",
        )
    return table


def _context_table(similarities: dict[str, list[float]]) -> Table:
    table = Table(title="The same word in two sentences: cosine similarity of its vectors, layer by layer")
    table.add_column("word")
    states = len(next(iter(similarities.values())))  # the embeddings, then one per layer
    for index in range(states):
        # layers are numbered from 0, as everywhere in qkv: state 1 is the output of layer 0
        table.add_column("embeddings" if index == 0 else f"after layer {index - 1}", justify="right")
    for word, values in similarities.items():
        table.add_row(word, *(f"{v:.3f}" for v in values))
    return table


def model_section(context: TourContext) -> dict[str, Any]:
    """Load the embedded model, inspect the seeds' sentences, write heatmaps and viewers."""
    from qkv.inspect.inspection import context_similarity
    from qkv.inspect.pronoun import pronoun_heads
    from qkv.models import load_encoder

    out = context.out
    verbose = out is not None and not context.quiet
    if out is not None:
        with out.status("Loading all-MiniLM-L6-v2 from the qkv-minilm package ..."):
            encoder = load_encoder()
            inspections = {s.slug: encoder.inspect(s.text) for s in SENTENCES}
        out.print(f"Loaded {encoder!r}; inspected {len(inspections)} sentences.")
    else:
        encoder = load_encoder()
        inspections = {s.slug: encoder.inspect(s.text) for s in SENTENCES}

    heads = pronoun_heads(inspections["trophy-big"], inspections["trophy-small"])
    best = heads[0]
    roles = _head_roles(encoder)
    similarities = {
        word: [float(x) for x in context_similarity(inspections[a], inspections[b], word)]
        for word, a, b in CONTEXT_PAIRS
    }
    if out is not None:
        if verbose:
            out.print(_heads_table(heads[:TOP_HEADS]))
            out.print(_context_table(similarities))
            out.print(Text(f"What the heads do, over {roles['texts']} built-in sentences (qkv heads for the whole table):"))
            for row in roles["strongest"]:
                out.print(Text("  " + row["sentence"]), highlight=False, soft_wrap=True)
        else:
            out.print(
                f'"it" -> "trophy": strongest in layer {best.layer} head {best.head} '
                f'({best.big_trophy:.3f}); "apple" similarity falls from '
                f'{similarities["apple"][0]:.3f} to {similarities["apple"][-1]:.3f}'
            )

    written = _write_artifacts(context.out_dir, inspections, best.layer, best.head)
    if out is not None:
        # the folder on a line of its own, never wrapped: a table title would wrap a long path
        out.print(Text(f"Written to {context.out_dir}:"), highlight=False, soft_wrap=True)
        table = Table()
        table.add_column("file")
        table.add_column("what")
        table.add_column("size", justify="right")
        for path, what in written:
            table.add_row(path.name, what, f"{path.stat().st_size / 1024:.0f} KiB")
        out.print(table)
        viewer = context.out_dir / "trophy-big.html"
        out.print(
            Text.assemble("Open ", (str(viewer), "bold"), " in a browser (no server needed) to explore every layer and head."),
            soft_wrap=True,
        )
    return {
        "model": encoder.name,
        "sentences": {s.slug: s.text for s in SENTENCES},
        "pronoun_heads": [asdict(row) for row in heads[:TOP_HEADS]],
        "context_similarity": similarities,
        "head_roles": roles,
        "files": [str(path) for path, _ in written],
    }


def _write_artifacts(
    out_dir: Path, inspections: dict[str, Inspection], layer: int, head: int
) -> list[tuple[Path, str]]:
    """Heatmaps of the most telling layer/head and one HTML viewer per sentence."""
    from qkv import viz

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, str]] = []
    big = inspections["trophy-big"]
    path = viz.save_heatmap(big, out_dir / f"trophy-big-layer{layer}.png", layer=layer)
    written.append((path, f"all heads of layer {layer}, trophy sentence"))
    for slug in ("trophy-big", "trophy-small"):
        path = viz.save_heatmap(inspections[slug], out_dir / f"{slug}-layer{layer}-head{head}.png", layer=layer, head=head)
        written.append((path, f"layer {layer} head {head}, the head where 'it' looks at 'trophy' most"))
    for slug in ("apple-fruit", "apple-company"):
        path = viz.save_heatmap(inspections[slug], out_dir / f"{slug}-layer{layer}.png", layer=layer)
        written.append((path, f"all heads of layer {layer}"))
    for slug, insp in inspections.items():
        path = viz.html(insp, out_dir / f"{slug}.html")
        written.append((path, f"attention viewer: {insp.text}"))
    for slug, a, b in COMPARE_PAIRS:
        path = viz.html(inspections[a], out_dir / f"{slug}.html", compare=inspections[b], layer=layer, head=head)
        written.append((path, f"compare viewer: {a} and {b} side by side, with their difference"))
    return written


def _head_roles(encoder: Any) -> dict[str, Any]:
    """The strongest head of each role over the built-in sentences, as JSON-able rows with the
    sentence the tour prints ("layer 0 head 2 sends 86% of its attention to the previous token")."""
    from qkv.cli.heads import role_sentence, strongest_report
    from qkv.models import ROLE_SENTENCES, head_roles

    roles = head_roles(encoder, ROLE_SENTENCES)
    rows = [
        row | {"sentence": role_sentence(row["role"], row["layer"], row["head"], row["share"])}
        for row in strongest_report(roles)
        if row["role"] != "rest"  # "the other tokens" is what is left, not a role
    ]
    return {"texts": roles.texts, "strongest": rows}
