"""Throughput of qkv.attention (auto, fused, math) against PyTorch's SDPA, in one run.

    uv run python benchmarks/attention.py [--quick] [--sizes 1024 2048 ...] [--reps 3]
        [--dtype float32 bfloat16] [--head-dim 64 128 ...]

B=1, H=8, E=64, float32 and bfloat16 (one table each; --dtype, --head-dim), n in 1k..8k, with and without a causal mask. FLOPs follow
docs/design.md: 4 * B * H * E per visible (query, key) pair (n^2 pairs, n(n+1)/2 when causal),
forward only. Every implementation is charged the same useful FLOPs, so GFLOP/s compare
directly; "auto / SDPA" is the goal's ratio (>= 0.95 wanted), and the last two columns are
SDPA's and qkv auto's GFLOP/s as fractions of a square matrix multiply in the same dtype,
measured in the same run (the machine's limit for that dtype).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import qkv
from qkv.bench import fastest, matmul_gflops, matmul_words, random_qkv

B, H = 1, 8
# The math path holds three (B, H, n, n) float32 tensors: 6 GiB at n = 8192. Past this it is skipped.
MATH_MAX_N = 8192


def _candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> dict[str, Callable[[], object]]:
    """The fused implementations compared on one problem, by name, timed interleaved."""
    mask = qkv.masks.causal() if causal else None
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "auto": lambda: qkv.attention(q, k, v, mask),
        "fused": lambda: qkv.attention(q, k, v, mask, backend="fused"),
    }


def _table(console: Console, dtype: torch.dtype, sizes: list[int], head_dims: list[int], reps: int) -> list[float]:
    """One dtype's table; returns the auto / SDPA ratios of its rows."""
    name = str(dtype).removeprefix("torch.")
    mm = matmul_gflops(dtype)
    console.print(f"machine: {torch.get_num_threads()} threads, {name} matmul {mm:.1f} GFLOP/s ({matmul_words()}, same run)")
    table = Table(title=f"attention forward, B=1 H=8 {name} (GFLOP/s; higher is better)")
    for col in ("n", "E", "mask", "auto ms", "SDPA", "qkv auto", "qkv fused", "qkv math", "auto / SDPA", "SDPA / matmul",
                "auto / matmul"):
        table.add_column(col, justify="right")
    ratios = []
    for n, E in [(n, E) for E in head_dims for n in sizes]:
        q, k, v = random_qkv(n, heads=H, head_dim=E, dtype=dtype)  # (B=1, H, n, E), seeded
        for causal in (False, True):
            fns = _candidates(q, k, v, causal)
            with torch.inference_mode():
                seconds = fastest(fns, reps, warmup=1)
                if n <= MATH_MAX_N:
                    # Timed apart: its n^2 allocations (GiBs) would slow whichever call follows them.
                    math = {"math": lambda: qkv.attention(q, k, v, qkv.masks.causal() if causal else None, backend="math")}  # noqa: B023
                    seconds |= fastest(math, reps, warmup=1)
            pairs = n * (n + 1) // 2 if causal else n * n
            gflops = {name: 4 * B * H * E * pairs / s / 1e9 for name, s in seconds.items()}
            ratio = seconds["sdpa"] / seconds["auto"]
            ratios.append(ratio)
            table.add_row(
                str(n),
                str(E),
                "causal" if causal else "none",
                f"{seconds['auto'] * 1e3:.1f}",
                f"{gflops['sdpa']:.1f}",
                f"{gflops['auto']:.1f}",
                f"{gflops['fused']:.1f}",
                f"{gflops['math']:.1f}" if "math" in gflops else "-",
                f"{ratio:.2f}x",
                f"{gflops['sdpa'] / mm:.2f}",
                f"{gflops['auto'] / mm:.2f}",
            )
    console.print(table)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n in 1k and 2k, 2 repetitions")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"],
                        help="one table per dtype, each against its own matmul rate")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64], help="E = Ev values to run")
    args = parser.parse_args()
    sizes = [1024, 2048] if args.quick else args.sizes
    reps = 2 if args.quick else args.reps
    console = Console()
    ratios = []
    for dtype_name in args.dtype:
        ratios += _table(console, getattr(torch, dtype_name), sizes, args.head_dim, reps)
    console.print(f"qkv auto / SDPA: min {min(ratios):.2f}x, max {max(ratios):.2f}x (goal >= 0.95x on every row)")


if __name__ == "__main__":
    main()
