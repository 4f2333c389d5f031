"""One decoding step over a long KV cache: what the input checks cost, and the paged cache's gather.

    uv run python benchmarks/decode_checks.py [--length 32768] [--reps 5] [--dtype float32]

B=1, H=32, G=8, E=Ev=128 (a Llama-shaped layer), one query against ``--length`` cached keys,
causal. Rows, timed in rotating rounds of one run (`qkv.bench.fastest`):
- "qkv, full checks": ``qkv.attention`` scanning q, k and v (max |x|, finiteness) every step;
- "qkv, kv_bounds": the same with ``kv_bounds=cache.bounds``, the checks reading q only;
- "checks alone": `qkv.attention.problem.describe_problem` with and without the bounds;
- "PagedKVCache.attend": blocks of 16 positions, gathered per step, then attention;
- "SDPA": ``scaled_dot_product_attention(enable_gqa=True)`` on the contiguous views.
Bytes are those of K and V (the step's physical minimum); GB/s is those bytes over the time, next
to the machine's read bandwidth measured in the same run (a sum over a 512 MiB tensor).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import qkv
from qkv.attention.problem import describe_problem
from qkv.bench import fastest

H, G, E = 32, 8, 128
BLOCK = 16  # positions per block of the paged cache (vLLM's default)
READ_BYTES = 512 * 2**20  # the bandwidth probe's tensor: far beyond any cache level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    S = args.length
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, G, S, E, generator=gen).to(dtype)  # (B, G, S, E)
    v = torch.randn(1, G, S, E, generator=gen).to(dtype)  # (B, G, S, Ev)
    q = torch.randn(1, H, 1, E, generator=gen).to(dtype)  # (B, H, 1, E)
    cache = qkv.KVCache(1, S, G, E, dtype=dtype)
    keys, values = cache.update(k, v)  # (1, G, S, E) views
    paged = qkv.PagedKVCache(S // BLOCK + 1, BLOCK, G, E, dtype=dtype)
    seq = paged.allocate()
    paged.append([seq], [k[0]], [v[0]])
    causal = qkv.masks.causal()
    probe = torch.ones(READ_BYTES // 4)
    with torch.inference_mode():
        times = fastest(
            {
                "read bandwidth probe": lambda: probe.sum(),
                "qkv, full checks": lambda: qkv.attention(q, keys, values, causal),
                "qkv, kv_bounds": lambda: qkv.attention(q, keys, values, causal, kv_bounds=cache.bounds),
                "checks alone, full": lambda: describe_problem(q, keys, values, causal),
                "checks alone, kv_bounds": lambda: describe_problem(q, keys, values, causal, kv_bounds=cache.bounds),
                "PagedKVCache.attend": lambda: paged.attend([seq], [q[0]], causal),
                "SDPA": lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True),
            },
            args.reps,
            warmup=1,
        )
    bandwidth = READ_BYTES / times.pop("read bandwidth probe")
    kv_bytes = (k.numel() + v.numel()) * k.element_size()
    q_bytes = q.numel() * q.element_size()
    # what each row's input checks read, by construction: K and V unless the bounds are given
    checks_read = {
        "qkv, full checks": kv_bytes + q_bytes,
        "qkv, kv_bounds": q_bytes,
        "checks alone, full": kv_bytes + q_bytes,
        "checks alone, kv_bounds": q_bytes,
        "PagedKVCache.attend": q_bytes,
        "SDPA": 0,
    }
    table = Table(title=f"decode step, S={S}, H={H}, G={G}, E={E}, {args.dtype}; CPU tier "
                        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
                        f"read bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    for column in ("", "ms", "checks read", "K+V GB/s", "of bandwidth", "vs SDPA"):
        table.add_column(column, justify="right")
    for name, seconds in times.items():
        rate = kv_bytes / seconds  # the step's physical minimum: K and V read once
        step = not name.startswith("checks alone")
        table.add_row(
            name, f"{seconds * 1e3:.2f}", f"{checks_read[name] / 1e6:.3f} MB", f"{rate / 1e9:.2f}" if step else "",
            f"{rate / bandwidth:.0%}" if step else "", f"{times['SDPA'] / seconds:.2f}x" if step else "",
        )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
