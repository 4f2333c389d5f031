"""Where the CPU block engine starts to beat SDPA with a dense mask, and whether 'auto' knows.

For each shape (N, H, E, L = S) and sliding window this times `qkv.attention` with
backend="blocks" and backend="fused" (SDPA with the mask rendered as an L x S bool tensor) in
one run by `qkv.bench.fastest` (rotating rounds, fastest run kept), then prints which one
'auto' chose (`qkv.explain`), the cost model's two estimates
(`qkv.backends.blocks.crossover`) and whether 'auto' chose the faster. The last lines fit the
model's constants to this run by least squares, for comparison with the ones in the source,
and count the shapes where 'auto' ran the slower backend, with the time that cost.

The engine's runs here use PyTorch's flash kernel per tile: float32, or another dtype where the
fused bf16 interval kernel cannot run (the cost model does not apply to that kernel). Every
table is printed with the CPU and qkv's tier, and the float32 matmul rate of this run.

    uv run python benchmarks/engine_crossover.py [--grad] [--threads 2] [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

import qkv
from qkv.backends.blocks import crossover
from qkv.bench import fastest, matmul_gflops
from qkv.native.machine import machine_line

SHAPES = ((1, 4, 32), (1, 8, 64), (4, 8, 64), (1, 32, 128), (2, 12, 64))  # (N, H, E)
LENGTHS = (256, 384, 512, 768, 1024)
WINDOWS = (32, 128)


def _computed_share(q: torch.Tensor, mask: qkv.masks.Mask) -> float:
    """The share of the score matrix the engine's tiles compute, from its plan."""
    return qkv.explain(q, q, q, mask=mask, backend="blocks").visited_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grad", action="store_true", help="time forward and backward (q, k, v require grad)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=5, help="rotating rounds per shape (fastest kept)")
    parser.add_argument("--quick", action="store_true", help="two shapes and three lengths")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes, lengths = (SHAPES[:2], LENGTHS[::2]) if args.quick else (SHAPES, LENGTHS)
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"float32 matmul {matmul_gflops(torch.float32):.0f} GFLOP/s, {'forward + backward' if args.grad else 'forward'}")
    print(f"{'N':>2} {'H':>3} {'E':>4} {'n':>5} {'w':>4} {'share':>6} {'blocks ms':>10} {'sdpa ms':>9} "
          f"{'sdpa/blocks':>12} {'model':>6} {'auto':>7}  verdict")
    rows: list[tuple[int, int, int, int, float, float, float]] = []
    wrong, lost_ms = 0, 0.0
    gen = torch.Generator().manual_seed(0)
    for N, H, E in shapes:
        for n in lengths:
            for window in WINDOWS:
                q, k, v = (torch.randn(N, H, n, E, generator=gen).requires_grad_(args.grad) for _ in range(3))
                mask = qkv.masks.sliding_window(window)

                def call(backend: str, q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                         mask: qkv.masks.Mask = mask) -> None:
                    with torch.set_grad_enabled(args.grad):
                        out = qkv.attention(q, k, v, mask=mask, backend=backend)
                        if args.grad:
                            out.sum().backward()

                times = fastest({"blocks": lambda: call("blocks"), "fused": lambda: call("fused")}, args.reps, warmup=1)
                blocks_ms, fused_ms = times["blocks"] * 1e3, times["fused"] * 1e3
                share = _computed_share(q.detach(), mask)
                model = crossover.dense_ms(N, H, n, n, E) / crossover.engine_ms(N, H, n, n, E, share)
                chosen = qkv.explain(q, k, v, mask=mask).path
                faster = "blocks" if blocks_ms < fused_ms else "fused"
                right = chosen == faster
                if not right:
                    wrong += 1
                    lost_ms += abs(blocks_ms - fused_ms)
                rows.append((N, H, E, n, share, blocks_ms, fused_ms))
                print(f"{N:>2} {H:>3} {E:>4} {n:>5} {window:>4} {share:>6.1%} {blocks_ms:>10.3f} {fused_ms:>9.3f} "
                      f"{fused_ms / blocks_ms:>11.2f}x {model:>5.2f}x {chosen:>7}  {'faster' if right else 'SLOWER'}", flush=True)
    # the model's constants fitted to this run (each row weighted by its own time: relative errors)
    dense = np.array([[1.0, N * H * n * n * E / 1e6, N * H * n * n / 1e6] for N, H, E, n, *_ in rows])
    engine = np.array([[1.0, share * N * H * n * n * E / 1e6, N * H * n / 1e3] for N, H, E, n, share, *_ in rows])
    engine_times = np.array([r[5] for r in rows])
    dense_times = np.array([r[6] for r in rows])
    dense_fit = np.linalg.lstsq(dense / dense_times[:, None], np.ones(len(rows)), rcond=None)[0]
    engine_fit = np.linalg.lstsq(engine / engine_times[:, None], np.ones(len(rows)), rcond=None)[0]
    print(f"fitted to this run: SDPA {dense_fit[0]:.2f} ms + {dense_fit[1]:.4f} per M multiply-adds + {dense_fit[2]:.3f} per M pairs; "
          f"engine {engine_fit[0]:.2f} ms + {engine_fit[1]:.4f} per M computed multiply-adds + {engine_fit[2]:.3f} per 1000 rows")
    print(f"'auto' ran the slower backend in {wrong} of {len(rows)} shapes, {lost_ms:.2f} ms lost in all")


if __name__ == "__main__":
    main()
