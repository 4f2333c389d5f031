"""`qkv bench`: block-sparse attention against PyTorch's SDPA and FlexAttention, on this machine.

    qkv bench --quick              # a smoke run of every comparison on small sizes (seconds)
    qkv bench --json > bench.json  # the full run (minutes), machine-readable
    qkv bench --plot bench.png     # and draw time and peak memory versus sequence length
    qkv bench decode               # the decode step (same as --decode); --generate N adds generation

Each line compares qkv with its peer in the same process (fastest of rotating rounds) and
prints the speedup next to its goal. The suite is library code: `qkv.bench` lists the cases.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from qkv.cli._app import app, check_output_file, console, fail, say
from qkv.cli._options import check_dtype
from qkv.cli._progress import QuietOption, progress

if TYPE_CHECKING:
    from qkv.bench import BenchReport

__all__ = ["bench_command"]

# Formats matplotlib writes without extra dependencies.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


# the benchmarks that `qkv bench WHAT` names; "suite" is the default run
WHATS = ("suite", "decode")


@app.command("bench")
def bench_command(
    what: Annotated[
        str,
        typer.Argument(help="suite (the default: block-sparse attention vs SDPA and FlexAttention) or decode.", show_default=False),
    ] = "suite",
    quick: Annotated[
        bool,
        typer.Option("--quick", help="Small sizes, no FlexAttention: a smoke run in seconds, which judges no goal."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Also draw time and peak memory versus n into this .png/.svg/.pdf.")
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="float32 or bfloat16: the dtype of q, k, v and of the matmul rate compared with.")
    ] = "float32",
    quiet: QuietOption = False,
    decode: Annotated[
        bool,
        typer.Option(
            "--decode",
            help="Instead: a decode step (S = 8,192 and 32,768; with --quick 2,048) in float32 and bfloat16, "
            "qkv vs SDPA, with the read bandwidth; then greedy generation (qkv vs sdpa) with --generate.",
        ),
    ] = False,
    generate: Annotated[
        int, typer.Option("--generate", help="With --decode: prompt tokens for greedy generation (0: none).", min=0)
    ] = 0,
) -> None:
    """Time qkv's block-sparse attention against SDPA and FlexAttention (ratios from one run)."""
    if what not in WHATS:
        fail(f"unknown benchmark {what!r}: choose one of {', '.join(WHATS)}", code=2)
    decode = decode or what == "decode"
    if generate and not decode:
        fail("--generate goes with the decode benchmark: qkv bench decode --generate N", code=2)
    if decode:
        _decode(quick, generate)
        return
    # checked before the run (minutes), not found out when the plot is saved after it
    check_output_file(plot, "--plot", PLOT_SUFFIXES)
    check_dtype(dtype)
    import dataclasses

    from qkv.bench import QUICK, STANDARD, run_suite, steps

    config = dataclasses.replace(QUICK if quick else STANDARD, dtype=dtype)
    report = None
    done = "starting"
    try:
        with progress("benchmark steps", steps(config), shown=not (quiet or as_json)) as moved:
            for count, (done, partial) in enumerate(run_suite(config), start=1):
                moved(count, done)
                report = partial
    except subprocess.CalledProcessError as error:
        # the peak-memory child process failed: its own message is the useful part
        last = (error.stderr or "").strip().splitlines()[-1:] or [f"exit status {error.returncode}"]
        fail(f"the peak-memory measurement failed after step {done!r}: {last[0]}", code=1)
    except (RuntimeError, OSError) as error:
        # e.g. FlexAttention cannot compile on this machine (no C compiler), or out of memory
        fail(f"the benchmark failed after step {done!r}: {type(error).__name__}: {error}", code=1)
    assert report is not None  # run_suite yields at least once
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        report.print(console)
    if plot is not None:
        try:
            _plot(report, plot)
        except OSError as error:
            fail(f"--plot: could not write {str(plot)!r}: {error}", code=1)
        if not as_json:
            say(f"plot written to {plot}")


def _decode(quick: bool, prompt: int) -> None:
    """`qkv bench --decode`: the decode step's table, then generation when ``prompt`` > 0."""
    from qkv.bench import decode_steps, generation
    from qkv.bench._decode_table import print_decode, print_generation

    lengths = (2048,) if quick else (8192, 32768)
    rows = decode_steps(lengths, ("float32", "bfloat16"), reps=2 if quick else 5, probe_bytes=(16 if quick else 512) * 2**20)
    print_decode(rows, console)
    if prompt:
        layers, hidden, head_dim, new = (1, 256, 8, 2) if quick else (4, 2048, 128, 16)
        print_generation(generation(prompt, new, layers=layers, hidden=hidden, head_dim=head_dim), console)


def _plot(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    for name, series in report.sweep.items():
        ns = sorted(series)
        values = [series[n] for n in ns]
        if name.endswith("seconds"):
            ax_time.plot(ns, values, marker="o", label=name.removesuffix(" seconds"))
        else:
            ax_mem.plot(ns, [b / 2**20 for b in values], marker="o", label=name.removesuffix(" peak RSS bytes"))
    w = report.config.window
    for ax, ylabel in ((ax_time, "forward time (s)"), (ax_mem, "peak resident memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"sliding_window({w}, {w}): qkv block engine vs SDPA with a dense mask")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
