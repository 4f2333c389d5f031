"""Attention sinks, forward + backward: the block engine (qkv's 'auto') vs the math path.

    uv run python benchmarks/sinks.py [--n 16384] [--heads 2] [--window 128] [--reps 2] [--threads 2]

B=1, H query heads (= kv heads), E=64, float32, sliding_window(window) & causal, sinks (H,)
requiring grad; loss = sum(out * dO) with a fixed random dO. Each path runs in a fresh child
process so that its peak resident memory (ru_maxrss, inputs included) is its own. The math path
materializes its scores, exponentials and weights, 3 x H x n^2 x 4 bytes (12 GiB at n = 16,384,
H = 2), plus their gradients in the backward: keep H small. One run on a shared machine is
noisy: compare the ratio within a run, not the seconds across runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time


def _measure(path: str, n: int, heads: int, window: int, reps: int, threads: int, queue: mp.Queue) -> None:
    import torch

    import qkv

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, heads, n, 64, generator=gen) for _ in range(4))
    sinks = torch.randn(heads, generator=gen)
    mask = qkv.masks.sliding_window(window) & qkv.masks.causal()
    backend = "auto" if path == "qkv auto" else "math"
    chosen = qkv.explain(q, k, v, mask, sinks=sinks.requires_grad_(True), backend=backend).path
    times = []
    for _ in range(reps):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
        start = time.perf_counter()
        out = qkv.attention(*leaves[:3], mask, sinks=leaves[3], backend=backend)
        middle = time.perf_counter()
        (out * d_out).sum().backward()
        end = time.perf_counter()
        times.append((middle - start, end - middle))
        del out, leaves
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    queue.put((chosen, min(t[0] for t in times), min(t[1] for t in times), peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(f"n={args.n:,} H={args.heads} E=64 float32 sliding_window({args.window}) & causal, sinks requiring grad, "
          f"{args.threads} threads, best of {args.reps}; load average before: {os.getloadavg()[0]:.2f}")  # fmt: skip
    ctx = mp.get_context("spawn")
    results = {}
    for path in ("qkv auto", "math"):
        queue: mp.Queue = ctx.Queue()
        child = ctx.Process(target=_measure, args=(path, args.n, args.heads, args.window, args.reps, args.threads, queue))
        child.start()
        results[path] = queue.get()
        child.join()
        chosen, fwd, bwd, peak = results[path]
        print(f"{path:9s} (path {chosen:6s}): forward {fwd:8.3f} s, backward {bwd:8.3f} s, peak RSS {peak / 2**30:6.2f} GiB")
    auto, math = results["qkv auto"], results["math"]
    print(f"math / auto: forward {math[1] / auto[1]:.1f}x, backward {math[2] / auto[2]:.1f}x, "
          f"forward + backward {(math[1] + math[2]) / (auto[1] + auto[2]):.1f}x, peak RSS {math[3] / auto[3]:.1f}x; "
          f"load average after: {os.getloadavg()[0]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
