"""transformers on qkv against transformers on sdpa / eager: a Mistral-shaped model on CPU, one run.

The model: MistralModel with random weights, 4 layers, hidden 512, 8 query heads and 2
key/value heads (E = 64), MLP 1,792, sliding window 1,024, float32, batch 1, no cache.

- forward time: qkv and sdpa timed in this process by `qkv.bench.fastest` (rotating rounds,
  fastest run kept); the ratio is sdpa time / qkv time (above 1: qkv is faster). Rates are FLOPs of the
  visible work (projections, MLP, and 4 * H * E per visible (query, key) pair) per second,
  with their fraction of the matrix-multiply rate in the model's dtype (--dtype float32 |
  bfloat16) measured in the same run.
- peak memory: each (implementation, length) runs once in a fresh subprocess, which returns
  freed heap to the system (malloc_trim) and measures with `qkv.bench.peak_growth` (VmHWM -
  VmRSS around the forward, the peak mark reset first): the growth of resident memory at its peak,
  model and inputs excluded. Linux only.
- output_attentions=True: the same subprocess measurement, qkv vs eager (the only transformers
  implementation that returns maps), at a length where the returned maps themselves
  (layers x H x L x L float32) still fit a shared machine.

Run: ``uv run python benchmarks/transformers_backend.py`` (several minutes on 2 cores; the
sdpa runs at 16,384 tokens compute the whole 16k x 16k score matrix), ``--quick`` for a smoke
run, ``--json FILE`` to keep the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from qkv.bench import fastest, matmul_gflops, matmul_words, peak_growth

LAYERS, HIDDEN, HEADS, KV_HEADS, MLP, WINDOW, VOCAB = 4, 512, 8, 2, 1792, 1024, 1000
HEAD_DIM = HIDDEN // HEADS


def build(impl: str, dtype: str = "float32", seed: int = 0) -> torch.nn.Module:
    import transformers

    from qkv.integrations.transformers import register

    register()
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, sliding_window=WINDOW,
        max_position_embeddings=1 << 15,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, attn_implementation=impl)
    return model.to(getattr(torch, dtype)).eval()


def forward_flops(length: int, visible_pairs: int) -> float:
    """Projections (q, k, v, o), MLP (3 matrices) and attention (4 E per visible pair and head)."""
    kv = KV_HEADS * HEAD_DIM
    linear = 2 * length * (HIDDEN * HIDDEN * 2 + HIDDEN * kv * 2 + 3 * HIDDEN * MLP)
    attention = 4 * HEADS * HEAD_DIM * visible_pairs
    return LAYERS * (linear + attention)


def window_pairs(length: int) -> int:
    """(query, key) pairs a causal window of WINDOW keys (the query included) leaves visible."""
    return sum(min(i + 1, WINDOW) for i in range(length))


def measure_memory(impl: str, length: int, output_attentions: bool, dtype: str) -> dict[str, float]:
    """Child mode: one forward; peak RSS growth (MiB) and seconds."""
    model = build(impl, dtype)
    ids = torch.randint(0, VOCAB, (1, length))
    # trim: hand freed heap back first, so that the forward cannot reuse it unseen
    with peak_growth(trim=True) as growth, torch.no_grad():
        start = time.perf_counter()
        out = model(input_ids=ids, output_attentions=output_attentions, use_cache=False)
        seconds = time.perf_counter() - start
    maps = sum(a.numel() * a.element_size() for a in out.attentions) if output_attentions else 0
    return {"peak_mib": growth.bytes / 2**20, "seconds": seconds, "maps_mib": maps / 2**20}


def child(impl: str, length: int, output_attentions: bool, dtype: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", impl, str(length), "1" if output_attentions else "0", dtype]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ})
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,024 and 2,048 tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per implementation (fastest kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards per implementation first")
    parser.add_argument("--json", type=str, default=None, help="also write the numbers to this JSON file")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the model's parameters; GFLOP/s are compared with this dtype's matmul rate")
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "LENGTH", "MAPS", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, length, maps, dtype = args.child
        print(json.dumps(measure_memory(impl, int(length), maps == "1", dtype)))
        return 0
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    lengths = (1024, 2048) if args.quick else (8192, 16384)
    maps_length = 512 if args.quick else 4096
    load = os.getloadavg()
    rate = matmul_gflops(getattr(torch, args.dtype))
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {torch.get_num_threads()} threads; "
          f"{args.dtype} matmul {rate:.0f} GFLOP/s ({matmul_words()}, same run); model in {args.dtype}")
    models = {impl: build(impl, args.dtype) for impl in ("qkv", "sdpa")}
    report: dict[str, object] = {"load_average": load, "matmul_gflops": rate, "forward": [], "output_attentions": []}
    print(f"\n{'tokens':>7} {'qkv s':>8} {'sdpa s':>8} {'speedup':>8} {'qkv GF/s':>9} {'of mm':>6} {'sdpa GF/s':>9}"
          f" {'of mm':>6} {'qkv MiB':>8} {'sdpa MiB':>9} {'mem ratio':>9}")
    for length in lengths:
        ids = torch.randint(0, VOCAB, (1, length))

        def run(impl: str, ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                models[impl](input_ids=ids, use_cache=False)

        seconds = fastest({impl: (lambda impl=impl: run(impl)) for impl in models}, args.repeats, warmup=args.warmup)
        memory = {impl: child(impl, length, False, args.dtype)["peak_mib"] for impl in models}
        useful = forward_flops(length, window_pairs(length))
        row = {
            "tokens": length, "seconds": seconds, "peak_mib": memory,
            "speedup": seconds["sdpa"] / seconds["qkv"], "memory_ratio": memory["sdpa"] / memory["qkv"],
            "gflops": {impl: useful / s / 1e9 for impl, s in seconds.items()},
        }
        report["forward"].append(row)  # type: ignore[union-attr]
        print(f"{length:>7} {seconds['qkv']:>8.2f} {seconds['sdpa']:>8.2f} {row['speedup']:>7.2f}x"
              f" {row['gflops']['qkv']:>9.0f} {row['gflops']['qkv'] / rate:>6.0%} {row['gflops']['sdpa']:>9.0f}"
              f" {row['gflops']['sdpa'] / rate:>6.0%}"
              f" {memory['qkv']:>8.0f} {memory['sdpa']:>9.0f} {row['memory_ratio']:>8.2f}x", flush=True)
    print(f"\noutput_attentions=True at {maps_length} tokens (maps returned: {LAYERS} x {HEADS} x L x L float32)")
    maps = {impl: child(impl, maps_length, True, args.dtype) for impl in ("qkv", "eager")}
    for impl, numbers in maps.items():
        print(f"  {impl:>5}: peak {numbers['peak_mib']:.0f} MiB ({numbers['maps_mib']:.0f} MiB of it the maps), "
              f"{numbers['seconds']:.2f} s")
    print(f"  eager / qkv peak memory: {maps['eager']['peak_mib'] / maps['qkv']['peak_mib']:.2f}x")
    report["output_attentions"] = {"tokens": maps_length, **maps}
    load_after = os.getloadavg()
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    report["load_average_after"] = load_after
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
