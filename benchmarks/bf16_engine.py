"""The CPU block engine in bfloat16 against float32, one run: issue 15's engine goals.

sliding_window(256, 256) at n = 16,384, B = 1, H = 8, E = 64 (2 threads unless --threads):
- forward and forward + backward in float32 and bfloat16, each with GFLOP/s on the pairs the
  engine computes (`qkv.explain`, backward 2.5x forward) and on the mask's visible pairs, and
  the fraction of that dtype's own matrix-multiply limit (`qkv.bench.matmul_gflops`: the best
  of 1024^2 and 2048^2 products, measured before and after the timings; the higher counts);
- the bfloat16 forward twice: with the fused bf16 interval kernel (`qkv.native.interval_bf16`,
  the default where it builds: AMX, a compiler) and with the per-tile flash path it replaces;
- bfloat16 forward + backward three times: with the fused bf16 interval backward kernel
  (`qkv.native.interval_bf16_backward`, the default where it builds), and with the two routes
  it replaces: the matrix-product backward (`qkv.backends.blocks.matmul_backward`, the engine's
  default on one thread without the kernel) and the flash kernel in float32 on exact copies
  (its default on more threads, `matmul_backward.MAX_THREADS`), compared in the same run.

Goals: bf16 forward >= 30 % of the bf16 matmul rate on the visited pairs (the pairs the engine
computes, `qkv.explain`'s work; the mask's visible pairs alone are printed too, the stricter
figure); bf16 forward + backward >= 2x float32.
Every contender is timed by `qkv.bench.fastest` (rotating rounds, fastest run kept; a forward
repeats within its round for 0.25 s, as the limit's products do) and the load average is printed: on a shared machine compare ratios, and note that many short
parallel operations (the matrix-product backward) suffer more from a busy machine than one
long kernel call.

    uv run python benchmarks/bf16_engine.py [--n 16384] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os

import torch

import qkv
from qkv.backends.blocks import matmul_backward
from qkv.bench import FORWARD_ROUND_SECONDS, fastest, matmul_gflops, matmul_words

B, H, E, WINDOW = 1, 8, 64, 256


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.n
    mask = qkv.masks.sliding_window(WINDOW, WINDOW)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, n, E, generator=gen) for _ in range(4)]
    inputs = {d: [x.to(d).requires_grad_(True) for x in base[:3]] for d in (torch.float32, torch.bfloat16)}
    grads = {d: base[3].to(d) for d in inputs}
    computed = qkv.explain(*inputs[torch.float32], mask).flops
    lo, hi = mask.row_intervals(n, n)  # (1, n) each: the keys lo..hi of every query
    visible = 4 * B * H * E * int((hi - lo + 1).clamp(min=0).sum())
    before = {d: matmul_gflops(d) for d in inputs}

    def forward(d: torch.dtype, fused: bool = True) -> None:
        with qkv.backends.disabled(*(() if fused else ("interval_bf16",))), torch.no_grad():
            qkv.attention(*inputs[d], mask)

    default_bound = matmul_backward.MAX_THREADS

    def both(d: torch.dtype, route: str = "default") -> None:
        """Forward + backward; ``route``: "default", "products" or "flash" (the fused backward off)."""
        matmul_backward.MAX_THREADS = {"products": 1 << 20, "flash": 0}.get(route, default_bound)
        try:
            with qkv.backends.disabled(*(() if route == "default" else ("interval_bf16_backward",))):
                qkv.attention(*inputs[d], mask).backward(grads[d])
        finally:
            matmul_backward.MAX_THREADS = default_bound

    both(torch.bfloat16)  # builds the fused kernels (once per machine) outside the timing
    said = qkv.explain(*inputs[torch.bfloat16], mask)  # which kernels, or why not
    fwd = fastest({
        "float32": lambda: forward(torch.float32),
        "bfloat16": lambda: forward(torch.bfloat16),
        "bfloat16, per-tile flash": lambda: forward(torch.bfloat16, fused=False),
    }, args.reps, warmup=1, round_seconds=FORWARD_ROUND_SECONDS)
    train = fastest({
        "float32": lambda: both(torch.float32),
        "bfloat16": lambda: both(torch.bfloat16),
        "bfloat16, product backward": lambda: both(torch.bfloat16, "products"),
        "bfloat16, flash backward": lambda: both(torch.bfloat16, "flash"),
    }, args.reps, warmup=1)
    after = {d: matmul_gflops(d) for d in inputs}
    rates = {d: max(before[d], after[d]) for d in inputs}  # the demanding denominator
    print(f"{args.threads} threads, torch {torch.__version__}; matmul ({matmul_words()}) before / after the timings: "
          + ", ".join(f"{str(d).removeprefix('torch.')} {before[d]:.0f} / {after[d]:.0f}" for d in inputs)
          + f" GFLOP/s, the higher counts (load {_load()})")
    print(f"sliding_window({WINDOW}, {WINDOW}), n={n}, B={B} H={H} E={E}: {computed / 1e9:.2f} GFLOP forward on the "
          f"computed pairs, {visible / 1e9:.2f} on the visible pairs")
    print(f"bfloat16 forward kernel: {said.forward_kernel}")
    print(f"bfloat16 backward kernel: {said.backward_kernel}")
    print(f"{'':<34}{'ms':>9}{'GF/s comp':>11}{'GF/s vis':>10}{'vis of mm':>11}")
    for name, seconds, factor in [(f"forward {k}", v, 1.0) for k, v in fwd.items()] + [
        (f"fwd+bwd {k}", v, 3.5) for k, v in train.items()
    ]:
        dtype = torch.bfloat16 if "bfloat16" in name else torch.float32
        g_comp, g_vis = factor * computed / seconds / 1e9, factor * visible / seconds / 1e9
        print(f"{name:<34}{seconds * 1e3:>9.1f}{g_comp:>11.1f}{g_vis:>10.1f}{g_vis / rates[dtype]:>11.1%}")
    products, flash, default = train["bfloat16, product backward"], train["bfloat16, flash backward"], train["bfloat16"]
    bf16_rate = rates[torch.bfloat16]
    print(f"bfloat16 forward: fused kernel {fwd['bfloat16, per-tile flash'] / fwd['bfloat16']:.2f}x the per-tile flash "
          f"path; of the bf16 matmul rate: {computed / fwd['bfloat16'] / 1e9 / bf16_rate:.1%} on the visited pairs "
          f"(qkv.explain's work, the goal's measure: >= 30 %), {visible / fwd['bfloat16'] / 1e9 / bf16_rate:.1%} on "
          "the mask's visible pairs alone")
    print(f"bfloat16 backward: fused kernel {(products - fwd['bfloat16']) / (default - fwd['bfloat16']):.2f}x the product "
          f"backward, {(flash - fwd['bfloat16']) / (default - fwd['bfloat16']):.2f}x the flash backward (fwd+bwd minus the forward)")
    print(f"bfloat16 over float32: forward {fwd['float32'] / fwd['bfloat16']:.2f}x; forward + backward {train['float32'] / default:.2f}x with the default route at "
          f"{args.threads} threads (goal >= 2x): without the fused backward, product backward {train['float32'] / products:.2f}x, "
          f"flash backward {train['float32'] / flash:.2f}x (load {_load()})")


if __name__ == "__main__":
    main()
