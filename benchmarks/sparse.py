"""Block-sparse attention: qkv's CPU block engine against SDPA and FlexAttention, one run.

B = 1, H = 8, E = 64, float32 (``--dtype bfloat16`` for the CPU's bf16 units). Every
comparison times qkv and its peer in the same process by `qkv.bench.fastest` (rotating
rounds, fastest run kept) and reports the ratio (peer time / qkv time: above 1 means qkv is
faster), qkv's GFLOP/s and their fraction of the dtype's matmul rate measured in the same
run. The cases and goals are listed in `qkv.bench`; `qkv bench` runs the same suite.

Run: ``uv run python benchmarks/sparse.py`` (a few minutes on 2 cores: SDPA's dense masks
cost n^2 work and FlexAttention compiles for tens of seconds), ``--quick`` for a smoke run,
``--threads 1`` to keep one core per process on a shared machine, ``--json FILE`` to keep
the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from rich.console import Console

from qkv.bench import QUICK, STANDARD, run_suite


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, no FlexAttention")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's choice)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles for a while)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per contender (fastest kept)")
    parser.add_argument("--json", type=str, default=None, help="also write the report to this JSON file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of q, k, v and of the matmul rate the GFLOP/s are compared with")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    config = QUICK if args.quick else STANDARD
    if args.no_flex:
        config = dataclasses.replace(config, flex=False)
    if args.repeats is not None:
        config = dataclasses.replace(config, repeats=args.repeats)
    config = dataclasses.replace(config, dtype=args.dtype)
    report = None
    for done, partial in run_suite(config):
        print(f"done: {done}", file=sys.stderr, flush=True)
        report = partial
    assert report is not None
    report.print(Console())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
