"""float32 against bfloat16 on the same problems, one run: time, GFLOP/s and the fraction of
each dtype's own matrix-multiply rate, measured in the same run.

Cases (B = 1, H = 8, E = 64 unless --head-dim):
- the CPU block engine, sliding_window(256, 256) at n = 16,384: forward, and forward +
  backward; FLOPs on the pairs the engine computes (`qkv.explain`), backward 2.5x forward;
- dense attention without a mask at n = 4,096: qkv auto against SDPA in each dtype.

Every contender of a case is timed with the others by `qkv.bench.fastest` (rotating rounds,
fastest run kept; a forward repeats within its round for 0.25 s, as the limit's products do),
so that a slow spell of a shared machine hits all of them. Each dtype's
matrix-multiply limit (`qkv.bench.matmul_gflops`: the best of 1024^2 and 2048^2 products) is
measured before and after all the cases, and the higher of the two is the denominator of every
"of mm" column, so the tables print at the end. The load average is printed with every table:
compare ratios, not absolute times.

    uv run python benchmarks/dtypes.py [--quick] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qkv
from qkv.bench import FORWARD_ROUND_SECONDS, fastest, matmul_gflops, matmul_words, random_qkv

B, H = 1, 8
DTYPES = (torch.float32, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _inputs(n: int, E: int, dtype: torch.dtype, grad: bool = False) -> tuple[torch.Tensor, ...]:
    return random_qkv(n, heads=H, head_dim=E, dtype=dtype, requires_grad=grad)


Table = Callable[[dict[torch.dtype, float]], None]  # prints a timed case against the rates


def engine(n: int, E: int, window: int, reps: int) -> Table:
    mask = qkv.masks.sliding_window(window, window)
    inputs = {dtype: _inputs(n, E, dtype) for dtype in DTYPES}
    flops = qkv.explain(*inputs[torch.float32], mask).flops
    forward = {_name(d): (lambda x=x: qkv.attention(*x, mask)) for d, x in inputs.items()}
    with torch.inference_mode():
        fwd = fastest(forward, reps, warmup=1, round_seconds=FORWARD_ROUND_SECONDS)
    trained = {dtype: _inputs(n, E, dtype, grad=True) for dtype in DTYPES}
    grads = {dtype: torch.randn(B, H, n, E, generator=torch.Generator().manual_seed(1)).to(dtype) for dtype in DTYPES}

    def step(dtype: torch.dtype) -> None:
        q, k, v = trained[dtype]
        qkv.attention(q, k, v, mask).backward(grads[dtype])

    both = fastest({_name(d): (lambda d=d: step(d)) for d in DTYPES}, reps, warmup=1)
    load = _load()
    return lambda rates: _engine_table(n, E, window, flops, fwd, both, load, rates)


def _engine_table(n: int, E: int, window: int, flops: float, fwd: dict[str, float], both: dict[str, float],
                  load: str, rates: dict[torch.dtype, float]) -> None:
    print(f"\nblock engine, sliding_window({window}, {window}), n={n}, E={E}: {flops / 1e9:.2f} GFLOP forward "
          f"on the computed pairs (load {load} when timed)")
    print(f"{'dtype':<10}{'fwd ms':>9}{'GFLOP/s':>9}{'of mm':>7}{'fwd+bwd ms':>12}{'GFLOP/s':>9}{'of mm':>7}")
    for dtype in DTYPES:
        name = _name(dtype)
        g1, g2 = flops / fwd[name] / 1e9, 3.5 * flops / both[name] / 1e9
        print(f"{name:<10}{fwd[name] * 1e3:>9.1f}{g1:>9.1f}{g1 / rates[dtype]:>7.1%}{both[name] * 1e3:>12.1f}"
              f"{g2:>9.1f}{g2 / rates[dtype]:>7.1%}")
    print(f"bfloat16 over float32: forward {fwd['float32'] / fwd['bfloat16']:.2f}x, "
          f"forward + backward {both['float32'] / both['bfloat16']:.2f}x")


def dense(n: int, E: int, reps: int) -> Table:
    fns = {}
    for dtype in DTYPES:
        q, k, v = _inputs(n, E, dtype)
        fns[f"SDPA {_name(dtype)}"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)
        fns[f"qkv {_name(dtype)}"] = lambda q=q, k=k, v=v: qkv.attention(q, k, v)
    with torch.inference_mode():
        seconds = fastest(fns, reps, warmup=1, round_seconds=FORWARD_ROUND_SECONDS)
    load = _load()
    return lambda rates: _dense_table(n, E, seconds, load, rates)


def _dense_table(n: int, E: int, seconds: dict[str, float], load: str, rates: dict[torch.dtype, float]) -> None:
    flops = 4 * B * H * n * n * E
    print(f"\ndense, no mask, n={n}, E={E}: {flops / 1e9:.2f} GFLOP (load {load} when timed)")
    print(f"{'path':<18}{'ms':>9}{'GFLOP/s':>9}{'of mm':>7}{'vs SDPA':>9}")
    for name, s in seconds.items():
        dtype = getattr(torch, name.split()[1])
        gflops = flops / s / 1e9
        peer = seconds[f"SDPA {name.split()[1]}"]
        print(f"{name:<18}{s * 1e3:>9.1f}{gflops:>9.1f}{gflops / rates[dtype]:>7.1%}{peer / s:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 2048 and 1024, 2 repetitions")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="E values of the dense case")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    reps = 2 if args.quick else args.reps
    n_engine, n_dense = (2048, 1024) if args.quick else (16384, 4096)
    for dtype in DTYPES:  # first calls pick kernels and start threads
        qkv.attention(*_inputs(512, 64, dtype), qkv.masks.sliding_window(64, 64))
    before = {dtype: matmul_gflops(dtype) for dtype in DTYPES}
    load = _load()
    tables = [engine(n_engine, 64, 256, reps)] + [dense(n_dense, E, reps) for E in args.head_dim]
    after = {dtype: matmul_gflops(dtype) for dtype in DTYPES}
    rates = {dtype: max(before[dtype], after[dtype]) for dtype in DTYPES}  # the demanding denominator
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; matmul ({matmul_words()}) before / after "
          "the cases: " + ", ".join(f"{_name(d)} {before[d]:.0f} / {after[d]:.0f}" for d in DTYPES)
          + f" GFLOP/s, the higher counts (load {load} before, {_load()} after)")
    for table in tables:
        table(rates)


if __name__ == "__main__":
    main()
