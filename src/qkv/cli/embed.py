"""`qkv embed`: sentence embeddings from the command line, with a progress bar on a terminal.

    qkv embed "I ate an apple." "Apple released a phone."       cosine similarities
    qkv embed --file sentences.txt --json > vectors.json          one text per line

The model and PyTorch are imported inside the command so that `qkv --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from qkv.cli._app import app, fail, print_whole, say
from qkv.cli._model import load_or_fail, too_long_message
from qkv.cli._options import BUILTIN_MODEL, DtypeOption, ModelOption
from qkv.cli._progress import QuietOption, progress
from qkv.cli._text import read_text_lines

__all__ = ["embed_command"]

# Up to this many texts the table of pairwise cosine similarities is printed.
SIMILARITY_TABLE_UP_TO = 8


def _read_texts(texts: list[str], file: Path | None) -> list[str]:
    if file is not None:
        texts = [*texts, *read_text_lines(file, "--file", allow_none=True)]
    if not texts:
        fail("give at least one text (as arguments or with --file)")
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:
        fail(f"text {empty[0]} is empty")
    return texts


@app.command("embed")
def embed_command(
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to embed.")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="A UTF-8 file with one text per line.")] = None,
    model: ModelOption = BUILTIN_MODEL,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Texts per forward pass.")] = 32,
    truncate: Annotated[bool, typer.Option("--truncate", help="Cut texts longer than the model's positions.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the embeddings as JSON.")] = False,
    dtype: DtypeOption = "float32",
    quiet: QuietOption = False,
) -> None:
    """Sentence embeddings (mean pooling + L2 normalisation, as sentence-transformers computes them)."""
    if batch_size < 1:
        fail(f"--batch-size must be at least 1, got {batch_size}")
    all_texts = _read_texts(list(texts or []), file)
    encoder = load_or_fail(model, dtype)
    from qkv.models import TextTooLongError

    if not hasattr(encoder, "encode"):
        fail(f"--model {model}: sentence embeddings come from BERT-family encoders only (mean pooling of "
             "their last layer); a transformers model's directory serves qkv inspect and qkv heads")
    try:
        with progress("texts embedded", len(all_texts), shown=not (quiet or as_json)) as report:
            vectors = encoder.encode(
                all_texts, batch_size=batch_size, truncate=truncate, progress=lambda done, total: report(done)
            )
    except TextTooLongError as error:
        others = f" ({error.count} texts are too long)" if error.count > 1 else ""
        fail(too_long_message(error, f"text {error.index}") + others)
    except ValueError as error:
        fail(str(error))
    if as_json:
        typer.echo(json.dumps({"model": encoder.name, "texts": all_texts, "embeddings": vectors.tolist()}))
        return
    say(f"{len(all_texts)} embeddings of width {vectors.shape[1]} ({encoder.name})")  # the name may be a path
    if len(all_texts) <= SIMILARITY_TABLE_UP_TO:
        similarity = vectors @ vectors.T  # (N, N): cosine similarity, the vectors have unit norm
        table = Table(title="cosine similarity")
        table.add_column("")
        for i in range(len(all_texts)):
            table.add_column(str(i), justify="right")
        for i, text in enumerate(all_texts):
            table.add_row(Text(f"{i}: {text}"), *(f"{float(s):.3f}" for s in similarity[i]))  # Text: no markup from users
        print_whole(table)
