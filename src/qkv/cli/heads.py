"""`qkv heads`: what every head of the model does, measured on many texts.

    qkv heads                        the built-in sentences (qkv.models.ROLE_SENTENCES)
    qkv heads --texts FILE           one text per line of a UTF-8 file
    qkv heads --json                 one record per (layer, head) with every share
    qkv heads --png heads.png        the layers x heads grid coloured by dominant role

The seeds claim that in trained models "some heads track grammatical relations, some track
neighbouring words, some rare long-distance links". This command answers with the model's
numbers, in the categories of Clark et al. (2019): the share of attention that each head gives
to the previous token, the next token, itself, [CLS], [SEP], punctuation and the rest, and
the entropy of its rows. Layers and heads are numbered from 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from qkv.cli._app import app, check_output_file, fail, print_whole, say
from qkv.cli._model import load_or_fail, too_long_message
from qkv.cli._options import BUILTIN_MODEL, JsonOption, ModelOption, TruncateOption
from qkv.cli._progress import QuietOption, progress
from qkv.cli._text import read_text_lines

if TYPE_CHECKING:
    from qkv.inspect.inspection import HeadRoles

__all__ = ["heads_command", "role_sentence", "strongest_report"]

ROLE_NAMES = ("previous", "next", "self", "cls", "sep", "punctuation", "rest")  # qkv.inspect.roles.ROLES, without torch
# One letter per role in the grid, so that twelve heads fit an 80-column terminal.
CODES = {"previous": "P", "next": "N", "self": "S", "cls": "C", "sep": "E", "punctuation": ".", "rest": "-"}
CODE_LEGEND = "P previous token, N next token, S itself, C [CLS], E [SEP] (end), . punctuation, - the rest"


def role_sentence(role: str, layer: int, head: int, share: float) -> str:
    """"layer 0 head 2 sends 86% of its attention to the previous token"."""
    from qkv.inspect.roles import ROLE_TEXT

    return f"layer {layer} head {head} sends {100 * share:.0f}% of its attention to {ROLE_TEXT[role]}"


def strongest_report(roles: HeadRoles) -> list[dict[str, Any]]:
    """For each role, the head that gives it the largest share."""
    rows = []
    for role in ROLE_NAMES:
        layer, head, share = roles.strongest(role)
        rows.append({"role": role, "layer": layer, "head": head, "share": share})
    return rows


def _grid_table(roles: HeadRoles) -> Table:
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, caption=Text(CODE_LEGEND))
    table.add_column("layer", justify="right", no_wrap=True, min_width=5)
    for head in range(roles.num_heads):
        table.add_column(str(head), justify="right")
    dominant = roles.dominant()
    for layer in range(roles.num_layers):
        cells = []
        for head in range(roles.num_heads):
            index = int(dominant[layer, head])
            cells.append(f"{CODES[ROLE_NAMES[index]]}{100 * float(roles.shares[layer, head, index]):.0f}")
        table.add_row(str(layer), *cells)
    return table


@app.command("heads")
def heads_command(
    texts_file: Annotated[
        Path | None,
        typer.Option("--texts", help="A UTF-8 file with one text per line (default: qkv's built-in sentences)."),
    ] = None,
    model: ModelOption = BUILTIN_MODEL,
    truncate: TruncateOption = False,
    as_json: JsonOption = False,
    png: Annotated[
        Path | None, typer.Option("--png", help="Write the layers x heads grid coloured by dominant role here (.png or .svg).")
    ] = None,
    quiet: QuietOption = False,
) -> None:
    """What each head looks at: previous / next token, itself, [CLS], [SEP], punctuation, the rest."""
    check_output_file(png, "--png", (".png", ".svg"))
    texts = read_text_lines(texts_file, "--texts") if texts_file is not None else None
    encoder = load_or_fail(model)
    from qkv.models import ROLE_SENTENCES, TextTooLongError, head_roles

    texts = list(ROLE_SENTENCES) if texts is None else texts
    try:
        with progress("texts run through the model", len(texts), shown=not (quiet or as_json)) as report:
            roles = head_roles(encoder, texts, truncate=truncate, progress=lambda done, total: report(done))
    except TextTooLongError as error:
        fail(too_long_message(error, f"text {error.index} of --texts"))
    except ValueError as error:
        fail(str(error))
    strongest = strongest_report(roles)
    written = []
    if png is not None:
        from qkv.viz import save_role_grid

        written.append(save_role_grid(roles, png))
    if as_json:
        typer.echo(json.dumps({
            "model": encoder.name,
            "texts": len(texts),
            "roles": list(ROLE_NAMES),
            "entropy_unit": "nats",
            "heads": roles.records(),
            "strongest": strongest,
            "files": [str(path) for path in written],
        }, ensure_ascii=False, allow_nan=False))
        return
    source = "qkv's built-in sentences" if texts_file is None else str(texts_file)
    say(f"{encoder.name}: attention of every head, averaged over {len(texts)} texts ({source})")
    best = Table(title=Text("the strongest head of each role", "table.title"))
    for column in ("role", "layer (from 0)", "head (from 0)", "share"):
        best.add_column(column, justify="left" if column == "role" else "right")
    for row in strongest:
        best.add_row(row["role"], str(row["layer"]), str(row["head"]), f"{100 * row['share']:.1f}%")
    print_whole(best)
    for row in strongest:
        say(role_sentence(row["role"], row["layer"], row["head"], row["share"]))
    say("dominant role of each head and its % of the head's attention (rows: layers, columns: heads, both from 0)")
    print_whole(_grid_table(roles))
    for path in written:
        say(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
