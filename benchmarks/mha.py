"""qkv.MultiHeadAttention against torch.nn.MultiheadAttention, forward + backward.

Self-attention, B=8, D=512, H=8 (E = 64), float32 and bfloat16 (one table each, --dtypes),
L from 128 to 2048, dropout 0, training mode. Every contender runs in the same process, timed by `qkv.bench.fastest` (rotating rounds,
so that load from other processes on a shared machine hits all of them alike); the table
reports the best of the reps (the run least disturbed by other load, as `timeit` advises) and
ratios of those (peer time / qkv time: above 1 means qkv is faster).

Contenders:
- nn(nw=False): ``m(x, x, x, need_weights=False)``: PyTorch's SDPA path.
- nn(default):  ``m(x, x, x)``: need_weights=True, weights averaged over heads (PyTorch's
  default call: the explicit softmax path, paid for without asking).
- nn(per-head): ``m(x, x, x, average_attn_weights=False)``: per-head weights (B, H, L, S).
- qkv:          ``mha(x)``.
- qkv(weights): ``mha(x, return_weights=True)``: exact per-head weights (B, H, L, S).

Goals (issue 3): qkv >= 1.0x nn(nw=False) everywhere; qkv >= 1.5x nn(default) at L >= 1024;
qkv(weights) >= 0.9x nn(per-head).

Work (FLOPs, docs/design.md): attention forward 4*B*H*L^2*E, backward 2.5x that; the four D x D
projections 8*B*L*D^2 forward, backward 2x that. GFLOP/s is printed for qkv with its
fraction of one large matrix multiply's rate in the same dtype, measured in the same run.

Run: ``uv run python benchmarks/mha.py`` (several minutes on 2 cores) or ``--quick``. On a
shared, busy machine ``--threads 1 --cpu-time`` gives steadier ratios.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import qkv
from qkv.bench import fastest, matmul_gflops, matmul_words

B, D, H = 8, 512, 8
E = D // H


@dataclass(frozen=True)
class Settings:
    lengths: tuple[int, ...]  # sequence lengths L to time
    reps: int  # timed repetitions per contender (after one warm-up)


FULL = Settings(lengths=(128, 256, 512, 1024, 2048), reps=5)
QUICK = Settings(lengths=(128, 512, 1024), reps=5)


def step_flops(L: int) -> float:
    """Forward + backward FLOPs of one multi-head self-attention layer (formula above)."""
    attention = 4 * B * H * L * L * E * (1 + 2.5)
    projections = 8 * B * L * D * D * (1 + 2)
    return float(attention + projections)


def contenders(theirs: nn.MultiheadAttention, ours: qkv.MultiHeadAttention) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each maps x (B, L, D) to the output (B, L, D); their weights stay in the graph."""
    return {
        "nn(nw=False)": lambda x: theirs(x, x, x, need_weights=False)[0],
        "nn(default)": lambda x: theirs(x, x, x)[0],
        "nn(per-head)": lambda x: theirs(x, x, x, average_attn_weights=False)[0],
        "qkv": lambda x: ours(x),
        "qkv(weights)": lambda x: ours(x, return_weights=True)[0],
    }


def train_step(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``fn`` on x, as a call to time."""

    def step() -> None:
        fn(x).sum().backward()

    return step


def run(settings: Settings, dtype: torch.dtype = torch.float32, clock: Callable[[], float] = time.perf_counter) -> None:
    """The table for one dtype: parameters and inputs in ``dtype`` (nn.MultiheadAttention cast
    with ``.to(dtype)``, qkv's module converted from it), GFLOP/s against that dtype's matmul rate."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(D, H, batch_first=True).to(dtype)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    theirs.train()
    ours.train()
    fns = contenders(theirs, ours)
    name = str(dtype).removeprefix("torch.")
    rate = matmul_gflops(dtype, clock=clock)
    print(f"\nB={B} D={D} H={H} E={E} {name}, forward+backward, {torch.get_num_threads()} threads, "
          f"best of {settings.reps}; {name} matmul rate {rate:.0f} GFLOP/s ({matmul_words()}, same run)")
    names = list(fns)
    header = f"{'L':>5} " + " ".join(f"{n:>13}" for n in names)
    header += f" {'qkv GFLOP/s':>12} {'of matmul':>10} {'vs nw=False':>12} {'vs default':>11} {'weights vs per-head':>20}"
    print(header + "\n" + "-" * len(header))
    for L in settings.lengths:
        x = torch.randn(B, L, D).to(dtype).requires_grad_(True)
        # rotating rounds: no contender always runs after the same one (the weight-returning
        # calls leave large allocations behind them)
        best = fastest({n: train_step(fn, x) for n, fn in fns.items()}, settings.reps, warmup=1, clock=clock)
        achieved = step_flops(L) / best["qkv"] / 1e9
        row = f"{L:>5} " + " ".join(f"{best[n] * 1e3:>11.1f}ms" for n in names)
        row += f" {achieved:>12.1f} {achieved / rate:>10.1%}"
        row += f" {best['nn(nw=False)'] / best['qkv']:>11.2f}x"
        row += f" {best['nn(default)'] / best['qkv']:>10.2f}x"
        row += f" {best['nn(per-head)'] / best['qkv(weights)']:>19.2f}x"
        print(row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and reps (about 1-2 minutes)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per contender")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths L (default: by --quick)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"],
                        help="one table per dtype (parameters and inputs), each against its own matmul rate")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: torch's choice); 1 is least disturbed by other load on a shared machine",
    )
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="time with the process's CPU clock instead of the wall clock: with --threads 1, "
        "time spent by other processes is not counted",
    )
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads <= 0:
            parser.error(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.cpu_time and torch.get_num_threads() != 1:
        parser.error("--cpu-time needs --threads 1 (CPU time summed over threads includes their waits)")
    settings = QUICK if args.quick else FULL
    if args.reps is not None:
        if args.reps <= 0:
            parser.error(f"--reps must be positive, got {args.reps}")
        settings = Settings(settings.lengths, args.reps)
    if args.lengths is not None:
        if min(args.lengths) <= 0:
            parser.error(f"--lengths must be positive, got {args.lengths}")
        settings = Settings(tuple(args.lengths), settings.reps)
    for dtype in args.dtypes:
        run(settings, getattr(torch, dtype), time.process_time if args.cpu_time else time.perf_counter)


if __name__ == "__main__":
    main()
