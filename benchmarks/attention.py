"""Throughput of qkv.attention (auto, fused, math) against PyTorch's SDPA, in one run.

    uv run python benchmarks/attention.py [--quick] [--sizes 1024 2048 ...] [--reps 3]

B=1, H=8, E=64, float32, n in 1k..8k, with and without a causal mask. FLOPs follow
DESIGN.md: 4 * B * H * E per visible (query, key) pair (n^2 pairs, n(n+1)/2 when causal),
forward only. Every implementation is charged the same useful FLOPs, so GFLOP/s compare
directly; the last column is the goal's ratio, qkv auto over SDPA (>= 0.95 wanted).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import matmul_gflops, time_interleaved

import qkv

B, H, E = 1, 8, 64
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n in 1k and 2k, 2 repetitions")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sizes = [1024, 2048] if args.quick else args.sizes
    reps = 2 if args.quick else args.reps

    console = Console()
    mm = matmul_gflops()
    console.print(f"machine: {torch.get_num_threads()} threads, float32 matmul {mm:.1f} GFLOP/s (2048^3)")
    table = Table(title="attention forward, B=1 H=8 E=64 float32 (GFLOP/s; higher is better)")
    for col in ("n", "mask", "SDPA", "qkv auto", "qkv fused", "qkv math", "auto / SDPA", "SDPA / matmul"):
        table.add_column(col, justify="right")
    ratios = []
    for n in sizes:
        q, k, v = (torch.randn(B, H, n, E) for _ in range(3))
        for causal in (False, True):
            fns = _candidates(q, k, v, causal)
            with torch.inference_mode():
                seconds = time_interleaved(fns, reps=reps)
                if n <= MATH_MAX_N:
                    # Timed apart: its n^2 allocations (GiBs) would slow whichever call follows them.
                    math = {"math": lambda: qkv.attention(q, k, v, qkv.masks.causal() if causal else None, backend="math")}  # noqa: B023
                    seconds |= time_interleaved(math, reps=reps)
            pairs = n * (n + 1) // 2 if causal else n * n
            gflops = {name: 4 * B * H * E * pairs / s / 1e9 for name, s in seconds.items()}
            ratio = seconds["sdpa"] / seconds["auto"]
            ratios.append(ratio)
            table.add_row(
                str(n),
                "causal" if causal else "none",
                f"{gflops['sdpa']:.1f}",
                f"{gflops['auto']:.1f}",
                f"{gflops['fused']:.1f}",
                f"{gflops['math']:.1f}" if "math" in gflops else "-",
                f"{ratio:.2f}x",
                f"{gflops['sdpa'] / mm:.2f}",
            )
    console.print(table)
    console.print(f"qkv auto / SDPA: min {min(ratios):.2f}x, max {max(ratios):.2f}x (goal >= 0.95x on every row)")


if __name__ == "__main__":
    main()
