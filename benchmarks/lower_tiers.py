"""bfloat16 against float32 where qkv's AMX kernels do not run: the lower tiers' kernels and fallbacks.

qkv's compiled bf16 kernels (the fused interval forward and backward, `qkv.native.interval_bf16`
and `interval_bf16_backward`, and the short-sequence kernel, `qkv.native.short_bf16`) are
built for the ``amx`` tier; the interval pair also for ``avx512`` with AVX-512 BF16 (its own
micro-kernel: there this script measures that build, and the short-sequence calls take
`qkv.native.short_wide`). On a lower tier (AVX-512 without BF16, AVX2 + FMA) bf16 products
are emulated, and qkv computes a bf16 request in float32 with bf16 storage: `qkv.attention`
widens q, k and v once per call (into a buffer kept per thread, in each input's own layout,
when no autograd graph can keep the copies) and rounds the output once
(`qkv.attention.functional`); the input checks scan the bf16 tensors, not their float32
copies, in the same pass that writes the copies (`qkv.native.magnitude.widen_bf16`). The
short-sequence calls go to a kernel of their own there, `qkv.native.short_wide`, which reads
the bf16 inputs and computes in float32 in registers.
A lower-tier kernel is not needed when that fallback is as fast as float32 itself on the
same problem: this script measures it, case by case, bf16 over float32 (goal >= 1.0x; the
bf16 run returns bf16, so it also pays the rounding of its output).

Cases (E = 64 unless said), the problems each kernel serves on ``amx``:
- interval forward: sliding_window(256, 256), B = 1, H = 8, n = 16,384; and causal at
  n = 4,096 (on ``amx`` the dense bf16 kernel's problem);
- interval backward: sliding_window(256, 256) forward + backward at n = 8,192;
- short sequence: the encoder's attention, B = 32, H = 12, E = 32, L = S = 128, without a mask
  and with key padding (a quarter of each row's keys hidden); and with key padding as a
  model's layer calls it (heads seen through a transpose of a projection, grad mode on).

Each pair is timed by `qkv.bench.fastest` in one run (rotating rounds, fastest kept), so a
busy spell of a shared machine hits both alike; the load average is printed (``--cpu-time``:
this process's CPU time on one thread, steadier where other processes share the cores). Printed with
the CPU model and the tier qkv uses (`qkv.native.machine.machine_line`). ``--tier avx2`` (with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` in the environment for PyTorch itself)
measures the AVX2 tier on a higher machine.

    QKV_CPU_TIER=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        uv run python benchmarks/lower_tiers.py [--quick] [--threads 2 | --cpu-time] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

import qkv
from qkv.bench import FORWARD_ROUND_SECONDS, fastest, random_qkv
from qkv.native.machine import TIER_VARIABLE, compute_dtype, machine_line

DTYPES = (torch.float32, torch.bfloat16)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _forward(n: int, mask: object, heads: int = 8, head_dim: int = 64) -> dict[torch.dtype, Callable[[], object]]:
    inputs = {d: random_qkv(n, heads=heads, head_dim=head_dim, dtype=d) for d in DTYPES}

    def call(x: tuple[torch.Tensor, ...]) -> object:
        with torch.inference_mode():
            return qkv.attention(*x, mask)

    return {d: (lambda x=x: call(x)) for d, x in inputs.items()}


def _backward(n: int, mask: object) -> dict[torch.dtype, Callable[[], object]]:
    inputs = {d: random_qkv(n, heads=8, head_dim=64, dtype=d, requires_grad=True) for d in DTYPES}
    grads = {d: torch.randn(1, 8, n, 64, generator=torch.Generator().manual_seed(1)).to(d) for d in DTYPES}

    def step(d: torch.dtype) -> object:
        q, k, v = inputs[d]
        q.grad = k.grad = v.grad = None
        qkv.attention(q, k, v, mask).backward(grads[d])
        return q.grad

    return {d: (lambda d=d: step(d)) for d in DTYPES}


def _short(padded: bool, as_a_model: bool = False) -> dict[torch.dtype, Callable[[], object]]:
    """``as_a_model``: as a model's layer calls it, heads seen through a transpose of a
    projection's (B, L, H, E) output, grad mode on (nothing requires grad)."""
    B, H, L, E = 32, 12, 128, 32
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(B, H, L, E, generator=gen) for _ in range(3)]
    if as_a_model:
        base = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in base]  # (B, H, L, E) views of (B, L, H, E)
    valid = torch.arange(L) < torch.randint(L // 2, L + 1, (B, 1), generator=gen)  # (B, L): 3/4 of the keys on average
    mask = valid[:, None, None, :] if padded else None  # (B, 1, 1, L)

    def call(x: list[torch.Tensor]) -> object:
        with torch.inference_mode(not as_a_model):
            return qkv.attention(*x, mask)

    inputs = {d: [t.to(d) for t in base] for d in DTYPES}
    return {d: (lambda x=x: call(x)) for d, x in inputs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the sequence lengths, 2 repetitions")
    parser.add_argument("--tier", default=None, help="force a lower CPU tier (QKV_CPU_TIER), e.g. avx2")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--cpu-time", action="store_true",
        help="time this process's CPU time (time.process_time) on one thread: steadier on a busy machine",
    )  # fmt: skip
    args = parser.parse_args()
    if args.tier is not None:
        os.environ[TIER_VARIABLE] = args.tier
    if args.cpu_time:
        torch.set_num_threads(1)  # CPU time of one thread is the call's work; of several, their sum
    elif args.threads is not None:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    reps = 2 if args.quick else args.reps
    scale = 4 if args.quick else 1
    window = qkv.masks.sliding_window(256, 256)
    cases: dict[str, tuple[str, dict[torch.dtype, Callable[[], object]]]] = {
        f"sliding_window(256) n={16384 // scale}": ("interval forward", _forward(16384 // scale, window)),
        f"causal n={4096 // scale}": ("interval forward", _forward(4096 // scale, qkv.masks.causal())),
        f"sliding_window(256) n={8192 // scale}": ("interval backward", _backward(8192 // scale, window)),
        "B=32 H=12 L=S=128 E=32": ("short sequence", _short(padded=False)),
        "same, key padding": ("short sequence", _short(padded=True)),
        "same, as a model's layer": ("short sequence", _short(padded=True, as_a_model=True)),
    }
    print(machine_line())
    emulated = compute_dtype(torch.bfloat16, torch.device("cpu")) != torch.bfloat16
    print("bf16 products here: " + ("emulated, so qkv computes bf16 in float32 (bf16 storage)" if emulated else "native"))
    print(f"{'problem of amx kernel':<22}{'case':<28}{'f32 ms':>9}{'bf16 ms':>9}{'bf16 / f32':>12}{'goal':>7}")
    for label, (kernel, fns) in cases.items():
        round_seconds = FORWARD_ROUND_SECONDS if kernel != "interval backward" else 0.0
        times = fastest({str(d): fn for d, fn in fns.items()}, reps, warmup=1, round_seconds=round_seconds, clock=clock)
        f32, bf16 = times[str(torch.float32)], times[str(torch.bfloat16)]
        print(f"{kernel:<22}{label:<28}{f32 * 1e3:>9.1f}{bf16 * 1e3:>9.1f}{f32 / bf16:>11.2f}x{1.0:>6.1f}x")
    what = "CPU time, one thread" if args.cpu_time else f"wall time, {torch.get_num_threads()} threads"
    print(f"(load {_load()} after; bf16 / f32 = float32 time / bfloat16 time, same run, {what})")


if __name__ == "__main__":
    main()
