"""Ring attention on CPU processes: a causal 64k-token sequence split over the ranks.

    torchrun --nproc-per-node 4 examples/ring.py [--tokens 65536] [--layout zigzag] [--no-backward]

Every rank holds 1/P of the sequence; key/value shards travel around the ring
(`qkv.distributed.ring_attention`, Liu et al. 2023), and no rank ever holds the whole
sequence or a (T x T) score matrix. Two parts:

1. check: a small sequence (--check-tokens) in float64, every rank comparing its shard of the
   ring's output and gradients with its shard of single-process `qkv.attention` on the whole
   sequence (the largest difference over all ranks is printed; it must be below 1e-10);
2. run: the long sequence in float32, each rank drawing only its own shard; per-rank time
   (compute vs waiting for transfers), causal work (query-key pairs visited) and the peak
   resident memory the call adds (Linux VmHWM, reset just before the call, minus VmRSS then;
   it includes about 40 MiB of one-time buffers of a process's first large call, which
   benchmarks/ring.py excludes) are printed by rank 0.

B=1, H=2 query heads sharing G=1 key/value head, E=Ev=16 keep the 64k run to minutes on a
small CPU machine.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import qkv
from qkv.distributed import RingStats, positions, ring_attention, shard

B, H, G, E = 1, 2, 1, 16


def check(rank: int, world: int, tokens: int, layout: str) -> float:
    """Largest |ring - single process| over output and gradients, on this rank's shard."""
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(B, H, tokens, E, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, G, tokens, E, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, G, tokens, E, generator=gen, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(B, H, tokens, E, generator=gen, dtype=torch.float64)
    full = qkv.attention(q, k, v, qkv.masks.causal())
    expected = [full, *torch.autograd.grad(full, (q, k, v), d_out)]  # out, dq, dk, dv (whole sequence)

    mine = [shard(x.detach(), rank, world, layout).clone().requires_grad_() for x in (q, k, v)]  # type: ignore[arg-type]
    out = ring_attention(*mine, causal=True, layout=layout)  # type: ignore[arg-type]
    got = [out, *torch.autograd.grad(out, mine, shard(d_out, rank, world, layout))]  # type: ignore[arg-type]
    diffs = [(g.detach() - shard(e.detach(), rank, world, layout)).abs().max() for g, e in zip(got, expected, strict=True)]  # type: ignore[arg-type]
    return float(max(diffs))


def memory_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process, KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_peak_memory() -> None:
    """Restart VmHWM from the current resident size (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536, help="length of the long causal sequence")
    parser.add_argument("--check-tokens", type=int, default=1024, help="length of the float64 check")
    parser.add_argument("--layout", choices=["contiguous", "zigzag"], default="zigzag")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may last")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    error = torch.tensor(check(rank, world, args.check_tokens, args.layout))
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"check: {args.check_tokens} tokens, {world} ranks, {args.layout}, float64: "
              f"max |ring - single process| over output and gradients = {error.item():.2e}", flush=True)
    if not error.item() < 1e-10:
        raise SystemExit(f"rank {rank}: the ring disagrees with single-process attention ({error.item():.2e})")

    # The long sequence: every rank draws its own shard only (RoPE would use `ids`).
    ids = positions(args.tokens, rank, world, args.layout)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1000 + rank)
    backward = not args.no_backward
    q = torch.randn(B, H, len(ids), E, generator=gen).requires_grad_(backward)
    k = torch.randn(B, G, len(ids), E, generator=gen).requires_grad_(backward)
    v = torch.randn(B, G, len(ids), E, generator=gen).requires_grad_(backward)
    stats = RingStats()
    dist.barrier()
    reset_peak_memory()
    before = memory_kib("VmRSS")
    start = time.perf_counter()
    out = ring_attention(q, k, v, causal=True, layout=args.layout, timeout=args.timeout, stats=stats)  # type: ignore[arg-type]
    if backward:
        out.backward(torch.ones_like(out))
    seconds = time.perf_counter() - start
    peak_mib = (memory_kib("VmHWM") - before) / 1024  # peak resident memory added by the call
    shard_mib = sum(x.numel() * x.element_size() for x in (q, k, v)) / 2**20
    finite = bool(torch.isfinite(out).all()) and (not backward or all(bool(torch.isfinite(x.grad).all()) for x in (q, k, v)))  # type: ignore[arg-type]
    row = [rank, len(ids), stats.visited_pairs, stats.forward_compute_s, stats.forward_wait_s,
           stats.backward_compute_s, stats.backward_wait_s, seconds, peak_mib, shard_mib, finite]
    rows: list[list] = [[] for _ in range(world)]
    dist.all_gather_object(rows, row)
    if rank == 0:
        what = "forward + backward" if backward else "forward"
        print(f"run: causal {args.tokens} tokens over {world} ranks ({args.layout}), B={B} H={H} G={G} E=Ev={E}, "
              f"float32, {what}, {torch.get_num_threads()} thread(s) per rank")
        print("rank  tokens  pairs(M)  fwd compute s  fwd wait s  bwd compute s  bwd wait s  total s"
              "  peak +RSS MiB  q,k,v MiB  finite")
        for r in rows:
            print(f"{r[0]:>4}  {r[1]:>6}  {r[2] / 1e6:>8.1f}  {r[3]:>13.2f}  {r[4]:>10.2f}  {r[5]:>13.2f}  {r[6]:>10.2f}"
                  f"  {r[7]:>7.2f}  {r[8]:>13.1f}  {r[9]:>9.1f}  {r[10]}")
        pairs = [r[2] for r in rows]
        print(f"causal work max/min over ranks: {max(pairs) / min(pairs):.3f}; "
              f"pairs sum {sum(pairs)} = T(T+1)/2 = {args.tokens * (args.tokens + 1) // 2}")
    if not all(r[10] for r in rows):
        raise SystemExit("non-finite values in the long run")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
