"""`qkv examples [NAME] [--json]`: the seed articles' worked examples, step by step.

    qkv examples                 every example, in the order the articles teach them
    qkv examples address-book    one example
    qkv examples apple --json    every intermediate, unrounded, as JSON on stdout

The tables round as the articles do; the JSON keeps float64 values unrounded.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.rule import Rule
from rich.text import Text

from qkv.cli._app import app, console, fail

if TYPE_CHECKING:
    from qkv.examples import Example, ExampleResult

__all__ = ["example_json", "examples_command", "render_example", "select_examples"]


def select_examples(name: str | None) -> list[Example]:
    """The example called ``name``, or all of them; exit 2 listing the names if it is unknown."""
    from qkv import examples

    if name is None:
        return list(examples.EXAMPLES.values())
    if name not in examples.EXAMPLES:
        fail(f"unknown example {name!r}; choose one of: {', '.join(examples.names())}")
    return [examples.get(name)]


def render_example(out: Console, example: Example, result: ExampleResult, quiet: bool = False) -> None:
    """Title, explanation and every step; with ``quiet`` one line with the main finding."""
    if quiet:
        out.print(Text.assemble((f"{example.name}: ", "bold"), result.headline()))
        return
    out.print(Rule(Text(example.name, style="bold")))
    out.print(Text(example.title, style="bold"))
    out.print(Text(example.summary + "\n"))
    out.print(result.render())


def example_json(example: Example, result: ExampleResult) -> dict[str, Any]:
    """The example's title and summary with every intermediate of its result, unrounded."""
    return {"title": example.title, "summary": example.summary, "result": result.to_json()}


@app.command("examples")
def examples_command(
    name: Annotated[
        str | None, typer.Argument(help="One example (address-book, apple, scaling, ...); all when omitted.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every intermediate, unrounded, as JSON.")] = False,
) -> None:
    """Run the seed articles' worked examples and print every step."""
    selected = select_examples(name)
    collected: dict[str, Any] = {}
    for example in selected:
        result = example.run()
        if as_json:
            collected[example.name] = example_json(example, result)
        else:
            render_example(console, example, result)
    if as_json:
        typer.echo(json.dumps({"examples": collected}, ensure_ascii=False, allow_nan=False))
