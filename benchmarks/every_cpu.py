"""The every-CPU figures: float32 against SDPA, and bfloat16 against float32 on the same machine.

Cases (B = 1, H = 8, E = 64), each timed against its peers in one run by `qkv.bench.fastest`
(rotating rounds, fastest run kept), so a slow spell of the shared machine hits all alike:
- float32, n = 4,096: qkv auto against SDPA, no mask and causal (goal >= 1.0x);
- float32, sliding_window(256, 256) at n = 16,384: qkv against SDPA with the equivalent dense
  bool mask (goal >= 15x);
- bfloat16 against float32 on the same problems through qkv.attention (goal >= 1.0x: where
  bf16 products are emulated, qkv computes them in float32), and on causal n = 4,096 with score
  terms: a softcap of 30, ALiBi, and a window of 256 with a relative bias table (32 buckets);
- the encoder (all-MiniLM-L6-v2, `load_encoder`): 256 sentences of 5-120 tokens, bf16 against
  float32 (goal >= 1.0x).

Every table is printed with the CPU model and the tier qkv uses (`qkv.native.machine`), and
each dtype's GFLOP/s is given as a fraction of the matmul rate, measured in the same run, of
the dtype its products run in (float32 for bf16 where bf16 is emulated; both rates printed).
A dtype whose products are emulated (bf16 on AVX2, about a GFLOP/s) has its rate measured on
a product of at most a second (`qkv.native.rates.affordable_side`; the sides are printed), so
that the run takes minutes there too. ``--tier avx2`` makes qkv behave as on an AVX2 machine
(QKV_CPU_TIER); PyTorch itself follows with the variables below, set before it starts:

    uv run python benchmarks/every_cpu.py [--quick] [--tier avx2] [--threads 2] [--reps 3]
    QKV_CPU_TIER=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        uv run python benchmarks/every_cpu.py --tier avx2
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.nn.functional as F

import qkv
from qkv.bench import FORWARD_ROUND_SECONDS, LIMIT_SIDES, fastest, matmul_gflops, random_qkv
from qkv.native.machine import TIER_VARIABLE, compute_dtype, machine_line
from qkv.native.rates import affordable_side

B, H, E = 1, 8, 64
DTYPES = (torch.float32, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _rate(dtype: torch.dtype) -> tuple[float, str]:
    """The dtype's matmul limit (GFLOP/s), the best over `LIMIT_SIDES`, and the sides measured.
    A dtype whose products are emulated here (bf16 on AVX2, ~0.3 GFLOP/s: a 2048^2 product
    takes a minute) is measured on the largest side whose product takes at most a second."""
    sides = sorted({affordable_side(dtype, n) for n in LIMIT_SIDES})
    rate = max(matmul_gflops(dtype, side=n) for n in sides)
    return rate, ", ".join(f"{n}^2" for n in sides)


def _flops(n: int, mask: object, **terms: object) -> int:
    q = torch.zeros(B, H, n, E)  # explain validates the values too
    return qkv.explain(q, q, q, mask, **terms).flops  # type: ignore[arg-type]  # the terms' own keywords


def versus_sdpa(n_dense: int, n_window: int, reps: int) -> None:
    """float32: qkv auto against SDPA (dense, causal) and against SDPA's dense mask (window)."""
    q, k, v = random_qkv(n_dense, heads=H, head_dim=E)
    window = qkv.masks.sliding_window(256, 256)
    qw, kw, vw = random_qkv(n_window, heads=H, head_dim=E)
    dense_window = window.to_dense(n_window, n_window)  # (n, n) bool
    with torch.inference_mode():
        times = fastest({
            "qkv dense": lambda: qkv.attention(q, k, v),
            "SDPA dense": lambda: F.scaled_dot_product_attention(q, k, v),
            "qkv causal": lambda: qkv.attention(q, k, v, qkv.masks.causal()),
            "SDPA causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }, reps, warmup=1, round_seconds=FORWARD_ROUND_SECONDS)  # fmt: skip
        window_times = fastest({
            "qkv window": lambda: qkv.attention(qw, kw, vw, window),
            "SDPA window": lambda: F.scaled_dot_product_attention(qw, kw, vw, attn_mask=dense_window),
        }, max(2, reps - 1), warmup=1)  # fmt: skip
    load = _load()
    print(f"\nfloat32 vs SDPA, B={B} H={H} E={E} (load {load} when timed)\n{machine_line()}")
    print(f"{'case':<28}{'qkv ms':>10}{'SDPA ms':>10}{'qkv/SDPA':>10}{'goal':>7}")
    rows = [(f"dense n={n_dense}", "dense", 1.0), (f"causal n={n_dense}", "causal", 1.0),
            (f"sliding_window(256) n={n_window}", "window", 15.0)]  # fmt: skip
    times.update(window_times)
    for label, key, goal in rows:
        ours, theirs = times[f"qkv {key}"], times[f"SDPA {key}"]
        print(f"{label:<28}{ours * 1e3:>10.1f}{theirs * 1e3:>10.1f}{theirs / ours:>9.2f}x{goal:>6.1f}x")


def bf16_attention(n_dense: int, n_window: int, reps: int, rates: dict[torch.dtype, float]) -> None:
    """bfloat16 against float32 through qkv.attention on the same problems."""
    causal, window = qkv.masks.causal(), qkv.masks.sliding_window(256, 256)
    table = torch.randn(H, 32, generator=torch.Generator().manual_seed(0)) * 0.5  # (H, buckets)
    cases: dict[str, tuple[int, object, dict[str, object]]] = {
        f"dense n={n_dense}": (n_dense, None, {}),
        f"causal n={n_dense}": (n_dense, causal, {}),
        f"sliding_window(256) n={n_window}": (n_window, window, {}),
        f"causal+softcap n={n_dense}": (n_dense, causal, {"softcap": 30.0}),
        f"causal+alibi n={n_dense}": (n_dense, causal, {"bias": qkv.bias.alibi()}),
        f"window+relative n={n_dense}": (n_dense, window, {"bias": qkv.bias.relative(table)}),
    }
    print(f"\nbfloat16 vs float32 through qkv.attention, B={B} H={H} E={E}\n{machine_line()}")
    print(f"{'case':<28}{'dtype':<10}{'ms':>9}{'GFLOP/s':>9}{'of mm':>8}{'bf16 speed-up':>15}")
    for label, (n, mask, terms) in cases.items():
        inputs = {d: random_qkv(n, heads=H, head_dim=E, dtype=d) for d in DTYPES}
        with torch.inference_mode():
            times = fastest(
                {_name(d): (lambda x=x, m=mask, t=terms: qkv.attention(*x, m, **t)) for d, x in inputs.items()},  # type: ignore[arg-type]
                reps, warmup=1, round_seconds=FORWARD_ROUND_SECONDS,
            )  # fmt: skip
        flops = _flops(n, mask, **terms)
        for dtype in DTYPES:
            seconds = times[_name(dtype)]
            gflops = flops / seconds / 1e9
            ratio = f"{times['float32'] / times['bfloat16']:.2f}x" if dtype == torch.bfloat16 else ""
            rate = rates[compute_dtype(dtype, torch.device("cpu"))]  # of the dtype the products run in
            print(f"{label:<28}{_name(dtype):<10}{seconds * 1e3:>9.1f}{gflops:>9.1f}{gflops / rate:>8.1%}{ratio:>15}")
    if compute_dtype(torch.bfloat16, torch.device("cpu")) != torch.bfloat16:
        print(f"(bf16 products are emulated here, so qkv computes bf16 in float32: its 'of mm' is of the float32 rate; "
              f"the bf16 matmul rate is {rates[torch.bfloat16]:.1f} GFLOP/s)")
    print(f"(load {_load()} after)")


def _sentences(count: int, seed: int = 0) -> list[str]:
    words = ["the", "a", "trophy", "suitcase", "river", "bank", "apple", "phone", "it", "was", "too", "big", "small", "lends", "ate", "released"]
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 100))) for _ in range(count)]


def encoder(count: int, reps: int) -> None:
    """The encoder in bf16 against float32: sentences per second."""
    from qkv.models import load_encoder

    texts = _sentences(count)
    encoders = {_name(d): load_encoder(dtype=d) for d in DTYPES}
    with torch.inference_mode():
        times = fastest({name: (lambda e=e: e.encode(texts, batch_size=32)) for name, e in encoders.items()}, reps, warmup=1)
    print(f"\nencoder (all-MiniLM-L6-v2), {count} sentences of 5-120 tokens, batch 32\n{machine_line()}")
    for name, seconds in times.items():
        print(f"{name:<10}{seconds:>8.2f} s {count / seconds:>8.1f} sentences/s")
    print(f"bfloat16 over float32: {times['float32'] / times['bfloat16']:.2f}x (load {_load()} after)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n = 1024 and 2048, 64 sentences, 2 repetitions")
    parser.add_argument("--tier", default=None, help="force a lower CPU tier (QKV_CPU_TIER), e.g. avx2")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.tier is not None:
        os.environ[TIER_VARIABLE] = args.tier
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    reps = 2 if args.quick else args.reps
    n_dense, n_window, sentences = (1024, 2048, 64) if args.quick else (4096, 16384, 256)
    print(machine_line())
    measured = {dtype: _rate(dtype) for dtype in DTYPES}
    rates = {dtype: rate for dtype, (rate, _) in measured.items()}
    print("matmul rates: " + ", ".join(f"{_name(d)} {r:.1f} GFLOP/s (best of {sides})" for d, (r, sides) in measured.items())
          + f" (load {_load()})")
    versus_sdpa(n_dense, n_window, reps)
    bf16_attention(n_dense, n_window, reps, rates)
    encoder(sentences, reps)


if __name__ == "__main__":
    main()
