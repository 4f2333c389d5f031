"""qkv on a CUDA GPU: every path checked against the float64 reference, then TFLOP/s.

One prepared script for a machine with a GPU (it exits with status 2 and "no CUDA device"
elsewhere). Within about five minutes it

1. checks every path (auto, fused, math, flex on the GPU; the CPU block engine "blocks" on
   the same inputs) on fresh random bf16 inputs against `qkv.reference` (NumPy, float64),
   forward and gradients, with docs/design.md's rule: error at most 2x (forward) / 3x (gradients)
   that of a naive bf16 implementation, plus a small floor;
2. times qkv.attention (auto dispatch), SDPA (is_causal, or the equivalent dense bool mask)
   and FlexAttention (``create_block_mask`` + ``torch.compile(flex_attention)``) in bf16,
   B = 1, H = 16, E in (64, 128), n in 1k..16k, masks dense / causal /
   sliding_window(256, 256) / 64 packed documents & causal, and prints TFLOP/s.

TFLOP/s use one work count for all three contenders: forward 4 * B * H * n * S_visited * E,
S_visited the keys of the tiles a block-sparse kernel must visit (`qkv.explain`), so the
numbers compare time for the same useful work. Times are CUDA-event medians after warm-up.

Run: ``python benchmarks/gpu.py [--budget SECONDS]``; steps that would exceed the budget
are skipped and listed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import qkv
from qkv import reference as R
from qkv.bench import document_ids

H = 16  # query heads of the timing runs (B = 1)
SIZES = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
WINDOW = 256
DOCUMENTS = 64
# bf16 keeps 8 bits of mantissa: an absolute floor for errors near zero
FLOOR = 2e-3


def masks(n: int, device: str) -> dict[str, Any]:
    return {
        "dense": None,
        "causal": qkv.masks.causal(),
        "sliding": qkv.masks.sliding_window(WINDOW, WINDOW),
        "documents": qkv.masks.documents(document_ids(n, DOCUMENTS).to(device)) & qkv.masks.causal(),
    }


# 1. correctness --------------------------------------------------------------------------------


def check_paths(E: int, n: int = 1024, heads: int = 4) -> list[str]:
    """Every path against the float64 reference; returns the failures."""
    failures = []
    gen = torch.Generator().manual_seed(E)
    q64, k64, v64, d64 = (torch.randn(1, heads, n, E, generator=gen, dtype=torch.float64) for _ in range(4))
    for name, mask in masks(n, "cpu").items():
        dense = None if mask is None else mask.to_dense(n, n)
        trace = R.attention(q64.numpy(), k64.numpy(), v64.numpy(), None if dense is None else dense.numpy())
        want = [trace.output, *R.attention_grads(trace, d64.numpy())]
        naive = _naive_errors(q64, k64, v64, d64, dense, want)
        for path in ("auto", "fused", "math", "flex", "blocks"):
            device = "cpu" if path == "blocks" else "cuda"
            q, k, v = (t.to(device, torch.bfloat16).requires_grad_(True) for t in (q64, k64, v64))
            m = None if mask is None else mask.to(device)
            out = qkv.attention(q, k, v, m, backend=path)
            got = [out, *torch.autograd.grad(out, (q, k, v), d64.to(device, torch.bfloat16))]
            errors = [_err(g, w) for g, w in zip(got, want, strict=True)]
            limits = [2 * naive[0] + FLOOR, *(3 * e + FLOOR for e in naive[1:])]
            ok = all(e <= lim for e, lim in zip(errors, limits, strict=True)) and not any(torch.isnan(g).any() for g in got)
            chosen = qkv.explain(q, k, v, m, backend=path).path
            line = (f"  E={E:3d} {name:9s} {path:6s} ({chosen:6s}) out err {errors[0]:.2e} (naive {naive[0]:.2e}), "
                    f"grad err {max(errors[1:]):.2e} (naive {max(naive[1:]):.2e})  {'ok' if ok else 'FAIL'}")
            print(line, flush=True)
            if not ok:
                failures.append(line)
    return failures


def _err(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.abs(got.detach().double().cpu().numpy() - want).max())


def _naive_errors(q64, k64, v64, d64, dense, want) -> list[float]:
    """Errors of softmax(q k^T / sqrt(E)) v computed step by step in bf16 on the GPU."""
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_(True) for t in (q64, k64, v64))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if dense is not None:
        scores = scores.masked_fill(~dense.cuda(), float("-inf"))
    out = torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v
    got = [out, *torch.autograd.grad(out, (q, k, v), d64.to("cuda", torch.bfloat16))]
    return [_err(g, w) for g, w in zip(got, want, strict=True)]


# 2. speed ----------------------------------------------------------------------------------------


def cuda_time(fn: Callable[[], object], warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of fn over reps, measured with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def flex_mod(name: str, ids: torch.Tensor | None) -> Callable[..., torch.Tensor] | None:
    """FlexAttention's own mask_mod for each case (the way its users write it)."""
    if name == "causal":
        return lambda b, h, q, kv: q >= kv
    if name == "sliding":
        return lambda b, h, q, kv: (q - kv <= WINDOW) & (kv - q <= WINDOW)
    if name == "documents":
        assert ids is not None
        return lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)
    return None


def time_case(name: str, mask: Any, n: int, E: int, flex: Callable[..., Any]) -> dict[str, float]:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = (torch.randn(1, H, n, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    work = qkv.explain(q, k, v, mask).flops if mask is not None else 4 * H * n * n * E
    result = {"qkv": cuda_time(lambda: qkv.attention(q, k, v, mask))}
    if name == "dense":
        result["sdpa"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    elif name == "causal":
        result["sdpa"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    else:
        dense = mask.to_dense(n, n, device="cuda")
        result["sdpa"] = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense))
        del dense
    ids = mask.left.ids[0] if name == "documents" else None
    mod = flex_mod(name, ids)
    block_mask = None if mod is None else create_block_mask(mod, None, None, n, n, device="cuda")
    result["flex"] = cuda_time(lambda: flex(q, k, v, block_mask=block_mask))
    return {key: work / seconds / 1e12 for key, seconds in result.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=280.0, help="seconds; later steps are skipped past it")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: benchmarks/gpu.py measures qkv on a GPU; run it on a machine with one", file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    began = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B=1", flush=True)
    print("1. every path against the float64 reference (n=1024, H=4):", flush=True)
    failures = []
    for E in HEAD_DIMS:
        failures += check_paths(E)
    flex = torch.compile(flex_attention)
    print(f"\n2. TFLOP/s on visited work (H={H}); columns qkv / SDPA / FlexAttention:", flush=True)
    print(f"{'mask':10s} {'E':>4s} {'n':>6s} {'qkv':>8s} {'SDPA':>8s} {'Flex':>8s}  qkv path", flush=True)
    skipped = []
    for E in HEAD_DIMS:
        for n in SIZES:
            for name, mask in masks(n, "cuda").items():
                if time.perf_counter() - began > args.budget:
                    skipped.append(f"{name} E={E} n={n}")
                    continue
                rates = time_case(name, mask, n, E, flex)
                path = qkv.explain(*(torch.empty(1, H, n, E, device="cuda", dtype=torch.bfloat16),) * 3, mask).path
                print(f"{name:10s} {E:4d} {n:6d} {rates['qkv']:8.1f} {rates['sdpa']:8.1f} {rates['flex']:8.1f}  {path}",
                      flush=True)
                torch.cuda.empty_cache()
    if skipped:
        print(f"\nskipped past the {args.budget:.0f} s budget: {', '.join(skipped)}")
    print(f"\n{len(failures)} correctness failure(s); {time.perf_counter() - began:.0f} s in all")
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
