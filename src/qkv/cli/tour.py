"""`qkv tour`: the whole of qkv in one run, section by section.

A section is a function that renders itself (unless the tour prints JSON) and returns its
results as JSON-compatible data; the tour runs `SECTIONS` in order. The first section runs
the seed articles' worked examples, starting with the address book, and shows that
`qkv.reference`, `qkv.attention` and PyTorch's SDPA agree on it. The second loads the
embedded pretrained model, inspects the seeds' sentences and writes heatmaps and HTML
viewers (`qkv.cli.tour_model`).

    qkv tour                every step of every section, files into ./qkv-out/
    qkv tour --out DIR      files into DIR
    qkv tour --quiet        one line per step
    qkv tour --json         every result, unrounded, as JSON on stdout
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.rule import Rule
from rich.text import Text

from qkv.cli._app import app, console, fail
from qkv.cli.examples import example_json, render_example
from qkv.cli.tour_context import TourContext
from qkv.cli.tour_model import model_section

__all__ = ["SECTIONS", "Section", "TourContext", "examples_section", "run_tour", "tour_command"]


@dataclass(frozen=True)
class Section:
    """One part of the tour: ``run`` prints (through the context) and returns JSON-able data."""

    name: str
    title: str
    run: Callable[[TourContext], dict[str, Any]]


def examples_section(context: TourContext) -> dict[str, Any]:
    """Every worked example in order (the address book's three-way agreement comes second)."""
    from qkv import examples

    out = context.out
    results: dict[str, Any] = {}
    for example in examples.EXAMPLES.values():
        result = example.run()
        results[example.name] = example_json(example, result)
        if out is not None:
            render_example(out, example, result, quiet=context.quiet)
    return {"examples": results}


SECTIONS: list[Section] = [
    Section("examples", "The seed articles' worked examples", examples_section),
    Section("model", "A real pretrained model: all-MiniLM-L6-v2 on qkv's attention", model_section),
]


def run_tour(context: TourContext, sections: list[Section] | None = None) -> dict[str, Any]:
    """Run ``sections`` (default: all of SECTIONS) in order; their results by name."""
    results: dict[str, Any] = {}
    for section in SECTIONS if sections is None else sections:
        if context.out is not None:
            context.out.print(Rule(Text(section.title, style="bold reverse")))
        results[section.name] = section.run(context)
    return results


@app.command("tour")
def tour_command(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line per step instead of every table.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print every result, unrounded, as JSON.")] = False,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Directory for the heatmaps and HTML viewers (created if missing).")
    ] = Path("qkv-out"),
) -> None:
    """A guided run through qkv: the articles' examples, then a real model's attention, drawn."""
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--out {out_dir} exists and is not a directory")
    try:  # now, not after the model has run: a folder that cannot be made is a usage error
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fail(f"--out {out_dir} cannot be created: {error.strerror or error}")
    results = run_tour(TourContext(out=None if as_json else console, quiet=quiet, out_dir=out_dir))
    if as_json:
        typer.echo(json.dumps({"sections": results}, ensure_ascii=False, allow_nan=False))
