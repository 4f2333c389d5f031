"""`qkv inspect` and `qkv context`: look inside a real pretrained model's attention.

    qkv inspect "The trophy did not fit into the suitcase because it was too big." --token it
    qkv context bank "I sat on the bank of the river." "I paid at the bank."

Layers and heads are numbered from 0, like the tensors of `qkv.inspect.Inspection`. The
model (PyTorch included) is imported inside the commands so that `qkv --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from qkv.cli._app import app, check_output_file, console, fail, print_whole, say
from qkv.cli._model import inspect_or_fail, load_or_fail
from qkv.cli._options import BUILTIN_MODEL, DtypeOption, JsonOption, ModelOption, TruncateOption
from qkv.cli._progress import QuietOption, progress

if TYPE_CHECKING:
    from qkv.inspect.inspection import Inspection

__all__ = ["context_command", "inspect_command"]


def _check_index(value: int | None, count: int, name: str) -> range:
    if value is None:
        return range(count)
    if not 0 <= value < count:
        fail(f"--{name} {value} is out of range: the model has {count} {name}s, numbered 0 to {count - 1}")
    return range(value, value + 1)


def head_report(
    inspection: Inspection, query: list[int], layers: range, heads: range, top: int
) -> list[dict[str, Any]]:
    """For each (layer, head): the ``top`` tokens that the query tokens attend to, with weights."""
    rows = []
    for layer in layers:
        for head in heads:
            attended = inspection.top_attended(query, layer, head, k=top)
            rows.append({
                "layer": layer,
                "head": head,
                "top": [{"index": i, "token": inspection.tokens[i], "weight": round(w, 6)} for i, w in attended],
            })
    return rows


def token_report(inspection: Inspection) -> list[dict[str, Any]]:
    return [
        {"index": i, "token": token, "word_id": word, "offsets": list(span)}
        for i, (token, word, span) in enumerate(
            zip(inspection.tokens, inspection.word_ids, inspection.offsets, strict=True)
        )
    ]


def _print_tokens(inspection: Inspection) -> None:
    table = Table(title=Text(f"{len(inspection.tokens)} tokens ({inspection.model_name})", "table.title"))
    for column in ("index", "token", "word", "characters"):
        table.add_column(column)
    for row in token_report(inspection):
        start, end = row["offsets"]
        word = "" if row["word_id"] is None else str(row["word_id"])
        table.add_row(str(row["index"]), Text(row["token"]), word, f"{start}..{end}" if end > start else "")
    print_whole(table)


def _print_heads(
    inspection: Inspection, token: str, occurrence: int, query: list[int], rows: list[dict[str, Any]]
) -> None:
    pieces = " ".join(inspection.tokens[i] for i in query)
    which = f"occurrence {occurrence} of " if occurrence else ""
    table = Table(title=Text(f"where each head looks from {which}{token!r} (tokens {pieces}; weights sum to 1 per head)", "table.title"))
    table.add_column(f"layer (0-{inspection.num_layers - 1})", justify="right")
    table.add_column(f"head (0-{inspection.num_heads - 1})", justify="right")
    table.add_column("most attended tokens")
    for row in rows:
        looks = Text(",  ").join(Text.assemble(f"{t['token']} ", (f"{t['weight']:.3f}", "bold")) for t in row["top"])
        table.add_row(str(row["layer"]), str(row["head"]), looks)
    print_whole(table)


@app.command("inspect")
def inspect_command(
    text: Annotated[str, typer.Argument(help="The text to run through the model.")],
    model: ModelOption = BUILTIN_MODEL,
    token: Annotated[
        str | None, typer.Option("--token", help="Show where each head looks from this word (case-insensitive).")
    ] = None,
    occurrence: Annotated[
        int,
        typer.Option("--occurrence", help="Which occurrence of --token, numbered from 0 (0 = the first)."),
    ] = 0,
    layer: Annotated[int | None, typer.Option("--layer", help="Only this layer (from 0).")] = None,
    head: Annotated[int | None, typer.Option("--head", help="Only this head (from 0).")] = None,
    top: Annotated[int, typer.Option("--top", help="How many attended tokens to list per head.")] = 3,
    as_json: JsonOption = False,
    steps: Annotated[
        bool,
        typer.Option(
            "--steps",
            help=(
                "With --token: the four steps (q.k, scale, exp, softmax, mix) of --layer/--head (default 0) for "
                "the word's first token. For the built-in encoder, BERT directories, and transformers models "
                "(decoders included) whose scores are scale * q.k plus their mask; a model that soft-caps or "
                "adds a position bias (Gemma 2, T5) is refused with the reason."
            ),
        ),
    ] = False,
    dtype: DtypeOption = "float32",
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write the standalone attention viewer (one HTML file) here. It opens at --layer/--head; "
            "what is not given is the head whose rows (--token's, else every word's) look hardest at another word.",
        ),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option("--compare", help="With --html: a second text shown next to TEXT in the viewer, with a difference view."),
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option(
            "--png",
            help="Write a heatmap here (.png or .svg): all heads of --layer (default 0), or one head with --head.",
        ),
    ] = None,
    truncate: TruncateOption = False,
    quiet: QuietOption = False,
) -> None:
    """Run TEXT through the model: its tokens, and where every head looks from --token.

    Layers, heads, tokens and occurrences are numbered from 0.
    """
    if top < 1:
        fail(f"--top must be at least 1, got {top}")
    if occurrence < 0:
        fail(f"--occurrence must be 0 or more (0 = the first), got {occurrence}")
    if occurrence and token is None:
        fail("--occurrence picks an occurrence of --token; give --token WORD too")
    if compare is not None and html is None:
        fail("--compare needs --html FILE: the comparison is drawn in the viewer")
    if steps and token is None:
        fail("--steps needs --token WORD: the word whose query row is traced")
    check_output_file(html, "--html", (".html", ".htm"))
    check_output_file(png, "--png", (".png", ".svg"))
    stages = 2 + (compare is not None) + (html is not None or png is not None)
    with progress("inspect", stages, shown=not (quiet or as_json)) as moved:
        moved(0, "loading the model")
        encoder = load_or_fail(model, dtype)
        moved(1, "running the text")
        inspection = inspect_or_fail(encoder, text, truncate=truncate)
        other = None
        if compare is not None:
            moved(2, "running the --compare text")
            other = inspect_or_fail(encoder, compare, truncate=truncate, name="the --compare text")
        layers = _check_index(layer, inspection.num_layers, "layer")
        heads = _check_index(head, inspection.num_heads, "head")
        query: list[int] | None = None
        if token is not None:
            query = _find_or_fail(inspection, token, occurrence)
        rows = head_report(inspection, query, layers, heads, top) if query is not None else None
        trace = None
        if steps:
            assert query is not None
            try:
                trace = inspection.steps(layers[0] if layer is not None else 0, heads[0] if head is not None else 0, query[0])
            except ValueError as error:
                fail(str(error))
        if html is not None or png is not None:
            moved(stages - 1, "writing the files")
        written = _write_artifacts(inspection, html, png, layer, head, compare=other, query=query)

    if as_json:
        report: dict[str, Any] = {
            "model": inspection.model_name,
            "text": inspection.text,
            "num_layers": inspection.num_layers,
            "num_heads": inspection.num_heads,
            "tokens": token_report(inspection),
        }
        if query is not None:
            report["query"] = {"word": token, "occurrence": occurrence, "indices": query}
            report["heads"] = rows
        if trace is not None:
            from qkv.cli.steps import steps_json

            report["steps"] = steps_json(inspection, trace)
        report["files"] = [str(path) for path in written]
        typer.echo(json.dumps(report, ensure_ascii=False, indent=2))
        return
    _print_tokens(inspection)
    if query is None:
        console.print("Pass --token WORD to see where each head looks from that word.")
    else:
        assert token is not None and rows is not None
        _print_heads(inspection, token, occurrence, query, rows)
    if trace is not None:
        from qkv.cli.steps import render_steps

        assert token is not None
        print_whole(render_steps(inspection, trace, token))
    for path in written:
        say(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def _find_or_fail(inspection: Inspection, token: str, occurrence: int) -> list[int]:
    """The token indices of the ``occurrence``-th ``token`` (from 0), or exit 2 saying how many there are."""
    try:
        matches = inspection.occurrences(token)
        if not matches:
            inspection.find(token)  # raises with the text's words listed
    except ValueError as error:
        fail(str(error))
    if occurrence >= len(matches):
        fail(
            f"--token {token!r} occurs {len(matches)} time(s) in the text, numbered 0 to {len(matches) - 1}; "
            f"--occurrence {occurrence} is out of range"
        )
    return matches[occurrence]


def _write_artifacts(
    inspection: Inspection,
    html: Path | None,
    png: Path | None,
    layer: int | None,
    head: int | None,
    *,
    compare: Inspection | None = None,
    query: list[int] | None = None,
) -> list[Path]:
    """The viewer (opened at --layer/--head, or by `qkv.viz.viewer.opening_head` for the
    --token's tokens; comparing with --compare) and the heatmap that --html and --png ask for."""
    written = []
    if html is not None:
        from qkv.viz import html as write_html

        # opened at --layer / --head; what is not given, at the head that looks hardest from --token
        written.append(write_html(inspection, html, compare=compare, layer=layer, head=head, query=query))
    if png is not None:
        from qkv.viz import save_heatmap

        written.append(save_heatmap(inspection, png, layer=0 if layer is None else layer, head=head))
    return written


@app.command("context")
def context_command(
    word: Annotated[str, typer.Argument(help="The word to follow through the layers.")],
    text1: Annotated[str, typer.Argument(help="A first text containing WORD.")],
    text2: Annotated[str, typer.Argument(help="A second text containing WORD.")],
    model: ModelOption = BUILTIN_MODEL,
    as_json: JsonOption = False,
    truncate: TruncateOption = False,
    dtype: DtypeOption = "float32",
) -> None:
    """How similar WORD's vectors are in two texts, layer by layer (cosine similarity).

    Attention mixes each context into the word: the vectors start close and drift apart with
    depth. Layers are numbered from 0: "layer 0" is the vector after layer 0.
    """
    if not word.strip():
        fail("WORD is empty")
    encoder = load_or_fail(model, dtype)
    from qkv.inspect.inspection import context_similarity

    first = inspect_or_fail(encoder, text1, truncate=truncate, name="TEXT1")
    second = inspect_or_fail(encoder, text2, truncate=truncate, name="TEXT2")
    for name, inspection in (("TEXT1", first), ("TEXT2", second)):
        try:
            inspection.find(word)
        except ValueError as error:
            fail(f"{name}: {error}")
    similarity = context_similarity(first, second, word).tolist()
    labels = ["embeddings", *(f"layer {i}" for i in range(len(similarity) - 1))]
    if as_json:
        typer.echo(json.dumps({
            "model": first.model_name,
            "word": word,
            "texts": [text1, text2],
            "similarity": [{"after": label, "cosine": round(c, 6)} for label, c in zip(labels, similarity, strict=True)],
        }, ensure_ascii=False, indent=2))
        return
    table = Table(title=Text(f"cosine similarity of {word!r} in the two texts", "table.title"))
    table.add_column("after (layers from 0)")
    table.add_column("cosine", justify="right")
    table.add_column("")
    for label, cosine in zip(labels, similarity, strict=True):
        table.add_row(label, f"{cosine:.4f}", "█" * max(0, round(20 * cosine)))
    print_whole(table)
