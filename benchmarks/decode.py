"""A decode step at the memory limit, and greedy generation: qkv vs PyTorch SDPA / transformers' sdpa.

    uv run python benchmarks/decode.py [--lengths 8192 32768] [--reps 5] [--paged] [--paged-only] [--portable]
                                       [--softcap 30] [--generate 8192] [--new 16] [--cache dynamic growing]

The step: B=1, Hq=32, G=8, E=128, one query against S cached keys, float32 and bfloat16, with
K + V bytes per second against the read bandwidth measured in the same run (`qkv.bench.decode_steps`
says how). ``--generate N``: greedy generation from an N-token prompt with a random Llama-shaped
model (4 layers, hidden 2,048, 32 / 8 heads of 128), time to first token and tokens/s after it,
``attn_implementation`` qkv vs sdpa (`qkv.bench.generation`), with transformers' DynamicCache
(``--cache dynamic``, the default: it copies the whole cache at every step, for both) and/or
qkv's `growing_cache` (``--cache growing``, appended in place, for both). The same as ``qkv bench --decode``,
plus ``--paged``: the step over a `qkv.PagedKVCache` of 16-position blocks, the sequence in one
run and in a fragmented pool (two sequences taking blocks in turn: a run per block), against the
contiguous cache and SDPA (`qkv.bench._decode.paged_steps`); ``--paged-only``: that table
without the contiguous steps' one; ``--portable``: every table once more with the compiled
decode kernel switched off (``qkv.backends.disabled("native_decode")``), i.e. the decode
backend's PyTorch ops; ``--softcap C``: qkv's steps cap their scores at C (Gemma 2, gpt-oss;
SDPA has none, its column stays the uncapped step). The line above each table names the step's
forward kernel (`qkv.explain`).

Native vs PyTorch ops vs SDPA at S = 32k, softcap and a fragmented pool:

    uv run --frozen python benchmarks/decode.py --lengths 32768 --portable --softcap 30
    uv run --frozen python benchmarks/decode.py --lengths 32768 --portable --paged-only
"""

from __future__ import annotations

import argparse
import os

import torch
from rich.console import Console

import qkv
from qkv.bench import decode_steps, generation
from qkv.bench._decode import GENERATION_CACHES, paged_steps
from qkv.bench._decode_table import print_decode, print_generation, print_paged


def _forward_kernel(softcap: float | None) -> str:
    """The decode step's forward kernel in words, as `qkv.explain` gives it (float32, no gradient)."""
    q, k = torch.zeros(1, 32, 1, 128), torch.zeros(1, 8, 8192, 128)  # (B, H, 1, E), (B, G, S, E)
    report = qkv.explain(q, k, k, qkv.masks.causal(), softcap=softcap)
    return f"decode step forward kernel: {report.kernels[0]}: {report.forward_kernel}"


def _tables(args: argparse.Namespace, console: Console) -> None:
    """The step's tables asked for, with the machine's kernels as they are now."""
    lengths, dtypes = tuple(args.lengths), tuple(args.dtypes)
    console.print(_forward_kernel(args.softcap))
    if not args.paged_only:
        print_decode(decode_steps(lengths, dtypes, args.reps, softcap=args.softcap), console, args.softcap)
    if args.paged or args.paged_only:
        print_paged(paged_steps(lengths, dtypes, args.reps, args.softcap), console, args.softcap)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--paged", action="store_true", help="also the step over a PagedKVCache")
    parser.add_argument("--paged-only", action="store_true", help="only the step over a PagedKVCache")
    parser.add_argument("--portable", action="store_true", help="also the steps without the compiled decode kernel")
    parser.add_argument("--softcap", type=float, default=None, help="qkv's steps cap their scores at this value")
    parser.add_argument("--generate", type=int, default=0, help="prompt tokens for greedy generation (0: none)")
    parser.add_argument("--new", type=int, default=16, help="tokens generated after the first")
    parser.add_argument(
        "--cache", nargs="+", choices=list(GENERATION_CACHES), default=["dynamic"],
        help="generation's cache, the same for qkv and sdpa: transformers' DynamicCache and/or qkv's growing_cache",
    )  # fmt: skip
    args = parser.parse_args()
    console = Console()
    console.print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    _tables(args, console)
    if args.portable:
        with qkv.backends.disabled("native_decode"):
            _tables(args, console)
    if args.generate:
        print_generation(generation(args.generate, args.new, caches=tuple(args.cache)), console)
    console.print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
