"""The input check's magnitude scan alone: the compiled scan against torch.aminmax, in GB/s.

Every attention call reads q, k and v once before any work for their largest |x| (the overflow
refusal and the NaN rule, `qkv.attention.problem._check_magnitudes`). Measured here for
B = 1, H = 8, n = 4,096, E = 64 (three 8 MiB float32 tensors, 4 MiB in bf16 / fp16), per dtype:

- ``scan <tier>``: `qkv.native.magnitude.largest_magnitudes` on q, k, v in one call, for each
  build that runs here (``avx2`` is forced on a higher machine with ``tier=``);
- ``aminmax``: `qkv.attention.bounds.largest_magnitude` (one ``torch.aminmax`` per tensor),
  the fallback;
- bf16 only (its GB/s count the bf16 bytes read): ``widen+scan <tier>`` (`qkv.native.magnitude.widen_bf16`: the scan writing the
  float32 copies of an emulated call) against ``copy+scan`` (torch's ``copy_`` into the same
  buffers, then the scan), the two ways an emulated bf16 call gets its checked float32 copies.

The inputs live in main memory, not in the cache, when each call starts: a buffer twice the
size of the last-level cache is written before every timed call (``--warm`` skips that: the
inputs then stay in the cache between repetitions). Contenders alternate in rotating rounds
and the median of each is kept (noisy on a shared machine: compare within one run).

    uv run --frozen python benchmarks/magnitude_scan.py [--threads 2] [--reps 9] [--warm]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from qkv.attention.bounds import largest_magnitude
from qkv.bench import random_qkv
from qkv.native import magnitude
from qkv.native.machine import machine_line

FLUSH_BYTES = 1 << 30  # twice the largest last-level cache seen on the machines this runs on


def _median_times(fns: dict[str, Callable[[], object]], reps: int, flush: torch.Tensor | None) -> dict[str, float]:
    """Median seconds of each function over ``reps`` rotating rounds, the cache flushed before each call."""
    names = list(fns)
    for fn in fns.values():
        fn()  # builds, thread pools, first touches
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(reps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if flush is not None:
                flush.add_(1)
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warm", action="store_true", help="keep the inputs in the cache (no flush)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flush = None if args.warm else torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32)
    tiers = [t for t in magnitude.TIERS if magnitude.kernel_reason(torch.float32, tier=t) is None]
    print(f"{machine_line()}\n{torch.get_num_threads()} threads, q, k, v of (1, 8, 4096, 64), "
          f"{'warm cache' if args.warm else 'inputs in main memory'}, median of {args.reps}")
    if not tiers:
        print(f"(the compiled scan does not run here: {magnitude.kernel_reason(torch.float32)})")
    print(f"{'dtype':<10}{'contender':<22}{'ms':>8}{'GB/s':>8}{'vs aminmax':>12}")
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            qkv = list(random_qkv(4096, heads=8, head_dim=64, dtype=dtype))
            nbytes = sum(t.numel() * t.element_size() for t in qkv)
            fns: dict[str, Callable[[], object]] = {"aminmax": lambda x=qkv: [largest_magnitude(t) for t in x]}
            for tier in tiers:
                fns[f"scan {tier}"] = lambda x=qkv, t=tier: magnitude.largest_magnitudes(x, tier=t)
            if dtype == torch.bfloat16 and tiers:
                wide = [torch.empty(t.shape) for t in qkv]
                for tier in tiers:
                    fns[f"widen+scan {tier}"] = lambda x=qkv, w=wide, t=tier: magnitude.widen_bf16(x, w, tier=t)
                fns["copy+scan"] = lambda x=qkv, w=wide: (
                    [o.copy_(t) for o, t in zip(w, x, strict=True)], magnitude.largest_magnitudes(x),
                )  # fmt: skip
            times = _median_times(fns, args.reps, flush)
            for name, seconds in times.items():
                ratio = "" if name == "aminmax" else f"{times['aminmax'] / seconds:.2f}x"
                print(f"{str(dtype).removeprefix('torch.'):<10}{name:<22}{seconds * 1e3:>8.2f}{nbytes / seconds / 1e9:>8.1f}{ratio:>12}")


if __name__ == "__main__":
    main()
