"""Ring attention on CPU: per-rank memory, compute vs waiting, causal balance of the layouts.

    uv run python benchmarks/ring.py [--tokens 16384] [--worlds 1 2 4] [--heads 4] [--dim 32]
        [--dtype float32|bfloat16]

For a fixed total length T, causal, forward + backward, every world size P in --worlds and
both layouts run in one spawned gloo world each (127.0.0.1, one thread per rank). Per rank:

- memory: peak resident memory the call adds (the second of two identical calls, so that
  one-time buffers are excluded). Each rank starts with MALLOC_MMAP_THRESHOLD_
  fixed at 64 KiB, so glibc serves every tensor of 64 KiB or more with its own mapping and
  unmaps it when freed: the resident size then follows the live tensors instead of keeping
  freed heap. `qkv.bench.peak_growth` resets the peak counter just before the call and
  reports VmHWM - VmRSS(before) after it: the peak extra memory. The
  inputs (q, k, v shards) were allocated before and are listed apart. It must fall like 1/P.
- time: `RingStats` (second call) splits each rank's wall time into compute (blocks and merges) and wait
  (for k/v blocks, dk/dv accumulators and the shape exchange). With more ranks than cores,
  compute time is inflated by sharing and waits include peers that run late.
- causal work: (query, key) pairs visited per rank, and the measured compute time, max/min
  over ranks, contiguous vs zigzag.

GFLOP/s count 2 (E + Ev) FLOPs per visited pair and head forward, 2.5x that backward
(docs/design.md), with their fraction ("of mm") of this machine's one-thread matmul rate in the
same dtype, measured in the same run; one dtype per run (--dtype float32 | bfloat16).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from qkv.bench import matmul_gflops, peak_growth

_HOST = "127.0.0.1"
_MMAP_THRESHOLD = str(64 * 1024)  # bytes: tensors this large get their own mapping


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    from qkv.distributed import RingStats, ring_attention, shard

    store = dist.TCPStore(_HOST, port, world, False, timeout=timedelta(minutes=10))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    T, H, G, E, layout = cfg["tokens"], cfg["heads"], cfg["kv_heads"], cfg["dim"], cfg["layout"]
    gen = torch.Generator().manual_seed(rank)
    length = len(shard(torch.empty(T), rank, world, layout, dim=0))
    dtype = getattr(torch, cfg["dtype"])
    q = torch.randn(1, H, length, E, generator=gen).to(dtype).requires_grad_(True)
    k = torch.randn(1, G, length, E, generator=gen).to(dtype).requires_grad_(True)
    v = torch.randn(1, G, length, E, generator=gen).to(dtype).requires_grad_(True)
    # Warm-up: the very same call once, unmeasured. The first calls allocate buffers that
    # stay for the life of the process (about 40 MiB here: BLAS work space and the like),
    # which are no part of the ring's memory.
    o = ring_attention(q, k, v, causal=True, layout=layout, timeout=600.0)
    o.backward(torch.ones_like(o))  # the same gradient layout as below: kernels differ on it
    del o
    q.grad = k.grad = v.grad = None
    dist.barrier()
    stats = RingStats()
    with peak_growth() as growth:
        start = time.perf_counter()
        o = ring_attention(q, k, v, causal=True, layout=layout, timeout=600.0, stats=stats)
        o.backward(torch.ones_like(o))
        seconds = time.perf_counter() - start
    result = {
        "rank": rank, "seconds": seconds, "peak_mib": growth.bytes / 2**20,
        "inputs_mib": sum(x.numel() * x.element_size() for x in (q, k, v)) / 2**20,
        "stats": stats,
    }
    if world == 1 and cfg["with_sdpa"]:
        # the same problem through single-process qkv.attention (PyTorch's fused kernel)
        import qkv

        del o
        q.grad = k.grad = v.grad = None
        with peak_growth() as growth:
            start = time.perf_counter()
            o = qkv.attention(q, k, v, qkv.masks.causal())
            o.backward(torch.ones_like(o))
            seconds = time.perf_counter() - start
        result["sdpa"] = {"seconds": seconds, "peak_mib": growth.bytes / 2**20}
    out.put(result)
    dist.destroy_process_group()


def run_world(world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = dist.TCPStore(_HOST, 0, None, True, wait_for_workers=False, timeout=timedelta(minutes=10))
    os.environ["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD  # read by glibc when each rank starts
    procs = [ctx.Process(target=_rank_main, args=(r, world, store.port, cfg, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise SystemExit(f"a rank of the {world}-rank world failed (exit codes {failed})")
    rows = [out.get() for _ in range(world)]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="total sequence length T")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32, help="E = Ev")
    # one dtype per invocation: this process spawns one gloo world per (P, layout), and past
    # four or five of them a world has been seen to hang here (a pre-existing hang, not understood yet)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of q, k, v; GFLOP/s are compared with this dtype's matmul rate")
    args = parser.parse_args()
    run_dtype(args, args.dtype)


def run_dtype(args: argparse.Namespace, dtype: str) -> None:
    """Every world size and layout in one dtype, then the memory and balance summaries."""
    T, H, E = args.tokens, args.heads, args.dim
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' own setting
    rate = matmul_gflops(getattr(torch, dtype), side=1024)
    torch.set_num_threads(threads)
    print(f"causal T={T}, B=1, H={H}, G={args.kv_heads}, E=Ev={E}, {dtype}, forward + backward, "
          f"gloo on {os.cpu_count()} CPU core(s), 1 thread per rank; one-thread {dtype} matmul rate {rate:.1f} GFLOP/s")
    flops_per_pair = 2 * (E + E) * H * 3.5  # forward + 2.5x backward, per visited pair

    summary: dict[tuple[int, str], list[dict[str, Any]]] = {}
    header = ("P  layout      rank  pairs(M)  fwd comp s  fwd wait s  bwd comp s  bwd wait s  GFLOP/s  of mm"
              "  peak +MiB  inputs MiB")
    print(header)
    for world in args.worlds:
        for layout in ("contiguous", "zigzag") if world > 1 else ("contiguous",):
            cfg = {"tokens": T, "heads": H, "kv_heads": args.kv_heads, "dim": E, "layout": layout,
                   "with_sdpa": world == 1, "dtype": dtype}
            rows = run_world(world, cfg)
            summary[(world, layout)] = rows
            for r in rows:
                s = r["stats"]
                compute = s.forward_compute_s + s.backward_compute_s
                achieved = s.visited_pairs * flops_per_pair / compute / 1e9
                print(f"{world}  {layout:<10}  {r['rank']:>4}  {s.visited_pairs / 1e6:>8.1f}  {s.forward_compute_s:>10.2f}"
                      f"  {s.forward_wait_s:>10.2f}  {s.backward_compute_s:>10.2f}  {s.backward_wait_s:>10.2f}"
                      f"  {achieved:>7.1f}  {achieved / rate:>5.0%}  {r['peak_mib']:>9.1f}"
                      f"  {r['inputs_mib']:>10.1f}")
            if "sdpa" in rows[0]:
                sd = rows[0]["sdpa"]
                print(f"1  qkv.attention (one process, fused SDPA): {sd['seconds']:.2f} s, peak +{sd['peak_mib']:.1f} MiB")

    print("\nmemory per rank (mean peak extra MiB; ideal falls like 1/P):")
    base = None
    for world in args.worlds:
        layout = "zigzag" if world > 1 else "contiguous"
        rows = summary[(world, layout)]
        mean = sum(r["peak_mib"] for r in rows) / len(rows)
        base = mean if base is None else base
        inputs = sum(r["inputs_mib"] for r in rows) / len(rows)
        print(f"  P={world}: {mean:7.1f} MiB extra (+{inputs:.1f} MiB inputs), x{mean / base:.2f} of P={args.worlds[0]}"
              f" (1/P = {args.worlds[0] / world:.2f})")

    print("\ntime split (sum over ranks) and causal balance, max/min over ranks:")
    for (world, layout), rows in summary.items():
        if world == 1:
            continue
        stats = [r["stats"] for r in rows]
        compute = [s.forward_compute_s + s.backward_compute_s for s in stats]
        wait = [s.forward_wait_s + s.backward_wait_s for s in stats]
        pairs = [s.visited_pairs for s in stats]
        print(f"  P={world} {layout:<10}: compute {sum(compute):6.2f} s, wait {sum(wait):6.2f} s "
              f"({sum(wait) / (sum(compute) + sum(wait)):.0%} waiting); pairs max/min {max(pairs) / min(pairs):.2f}, "
              f"compute time max/min {max(compute) / min(compute):.2f}; chunk pairs computed per rank "
              f"{[s.chunk_pairs for s in stats]}")


if __name__ == "__main__":
    main()
