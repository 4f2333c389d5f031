"""The block-sparse benchmark behind `qkv bench` and benchmarks/sparse.py.

Every comparison times qkv and its peer in the same process, alternating them ``repeats``
times and keeping each one's fastest run, and reports the ratio (machines are shared and
noisy; absolute times are only context). Work is counted with DESIGN.md's formula:
forward FLOPs = 4 * B * H * L * S_visited * E, where S_visited counts only the keys of
visited tiles for qkv; backward = 2.5 x forward. Peak memory is the high-water resident set
(Linux VmHWM; ru_maxrss elsewhere) of a fresh subprocess that runs one problem size after
another in increasing order, PyTorch's own footprint included.

Comparisons (goals from issue 7):
- sliding_window(256, 256), n = 16384: vs SDPA with the equivalent dense bool mask (>= 20x),
  vs FlexAttention compiled, steady state (>= 1.2x) and including its block-mask creation
  and compilation with an empty inductor cache (>= 20x);
- 64 packed documents of random lengths, causal, n = 16384: vs SDPA dense mask (>= 20x);
- causal, n = 4096 and 8192: vs SDPA is_causal (>= 0.95x);
- forward + backward of the sliding window, n = 16384: vs SDPA dense mask (>= 10x);
- peak RSS of the sliding window forward at n = 65536 (< 1.5 GB);
- achieved GFLOP/s on visited tiles as a fraction of this machine's matmul rate in the
  same dtype (float32 by default; ``dtype="bfloat16"`` for the CPU's bf16 units).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["QUICK", "STANDARD", "BenchConfig", "BenchReport", "Comparison", "run_suite", "steps"]


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one benchmark run (B = 1, one dtype throughout)."""

    heads: int = 8  # H
    head_dim: int = 64  # E = Ev
    n_window: int = 16384  # sliding-window and documents comparisons
    window: int = 256  # sliding_window(window, window)
    n_docs: int = 16384
    documents: int = 64
    n_causal: tuple[int, ...] = (4096, 8192)
    n_memory: int = 65536  # peak RSS of the sliding window
    sweep: tuple[int, ...] = (2048, 4096, 8192, 16384)  # time and memory versus n, for the plot
    repeats: int = 3
    flex: bool = True  # FlexAttention comparisons (compiles for tens of seconds on CPU)
    backward: bool = True
    matmul: int = 2048  # side of the square matmul (in ``dtype``) that measures the machine's rate
    judge: bool = True  # compare speedups with the goals; False for a smoke run, too small to judge
    dtype: str = "float32"  # of q, k, v and of the matmul rate: "float32" or "bfloat16"


STANDARD = BenchConfig()
QUICK = BenchConfig(
    n_window=1024, n_docs=1024, documents=8, n_causal=(512,), n_memory=2048, sweep=(256, 512),
    repeats=2, flex=False, backward=True, matmul=256, judge=False,
)


@dataclass(frozen=True)
class Comparison:
    """qkv against one peer on one problem: fastest times in seconds and the speedup."""

    name: str
    n: int
    qkv_s: float
    peer: str
    peer_s: float
    goal: float | None  # speedup asked for by the issue
    qkv_gflops: float  # forward (+ backward) FLOPs of qkv's path per second / 1e9
    max_abs_err: float | None  # qkv against the peer's output where both are exact

    @property
    def speedup(self) -> float:
        return self.peer_s / self.qkv_s

    @property
    def met(self) -> bool | None:
        return None if self.goal is None else self.speedup >= self.goal


@dataclass
class BenchReport:
    """Everything one run measured."""

    config: BenchConfig
    threads: int
    torch_version: str
    matmul_gflops: float
    comparisons: list[Comparison] = field(default_factory=list)
    peak_rss_bytes: int | None = None  # sliding-window forward at n_memory
    sweep: dict[str, dict[int, float]] = field(default_factory=dict)  # series -> n -> seconds or bytes

    def to_json(self) -> dict[str, Any]:
        judge = self.config.judge
        comparisons = [
            {**asdict(c), "speedup": c.speedup, "met": c.met if judge else None} for c in self.comparisons
        ]
        return {
            "smoke_run": not judge,  # goals are not judged from a smoke run's small sizes
            "config": asdict(self.config),
            "threads": self.threads,
            "torch": self.torch_version,
            "matmul_gflops": self.matmul_gflops,
            "comparisons": comparisons,
            "peak_rss_bytes": self.peak_rss_bytes,
            "sweep": {k: {str(n): v for n, v in series.items()} for k, series in self.sweep.items()},
        }


def _fastest(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Fastest wall time of each function, the functions alternating round by round."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _warm_up(config: BenchConfig, n: int = 512) -> None:
    """Run every path once, forward and backward, so that no timing pays for first-call setup."""
    import torch
    import torch.nn.functional as F

    import qkv

    q, k, v = _inputs(n, config, requires_grad=True)
    window = qkv.masks.sliding_window(64, 64)
    docs = qkv.masks.documents(_document_ids(n, 4)) & qkv.masks.causal()
    for mask in (window, docs, qkv.masks.causal()):
        qkv.attention(q, k, v, mask, backend="blocks").sum().backward()
        qkv.attention(q, k, v, mask).sum().backward()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to_dense(n, n)).sum().backward()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.randn(64, 64) @ torch.randn(64, 64)


def _matmul_gflops(side: int, repeats: int, dtype: str = "float32") -> float:
    import torch

    a, b = (torch.randn(side, side).to(getattr(torch, dtype)) for _ in range(2))
    a @ b  # warm up the BLAS threads
    seconds = _fastest({"mm": lambda: a @ b}, max(3, repeats))["mm"]
    return 2 * side**3 / seconds / 1e9


def _inputs(n: int, config: BenchConfig, requires_grad: bool = False, seed: int = 0) -> tuple[Any, Any, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (1, config.heads, n, config.head_dim)
    dtype = getattr(torch, config.dtype)
    return tuple(torch.randn(shape, generator=gen).to(dtype).requires_grad_(requires_grad) for _ in range(3))  # type: ignore[return-value]


def _document_ids(n: int, count: int, seed: int = 0) -> Any:
    """ids (n,) of ``count`` packed documents with random lengths (at least 1 token each)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(n - 1, generator=gen)[: count - 1].sort().values + 1  # count - 1 distinct cut points
    starts = torch.zeros(n, dtype=torch.long)
    starts[cuts] = 1
    return torch.cumsum(starts, dim=0)  # (n,)


def _forward_flops(q: Any, k: Any, v: Any, mask: Any) -> int:
    import qkv

    return qkv.explain(q, k, v, mask).flops


def _compare_forward(
    name: str, n: int, mask: Any, peer: str, peer_fn: Callable[..., Any], config: BenchConfig, goal: float | None
) -> Comparison:
    import torch

    import qkv

    q, k, v = _inputs(n, config)
    with torch.no_grad():
        ours = qkv.attention(q, k, v, mask)
        theirs = peer_fn(q, k, v)
        err = float((ours - theirs).abs().max())
        times = _fastest({"qkv": lambda: qkv.attention(q, k, v, mask), "peer": lambda: peer_fn(q, k, v)}, config.repeats)
    flops = _forward_flops(q, k, v, mask)
    return Comparison(name, n, times["qkv"], peer, times["peer"], goal, flops / times["qkv"] / 1e9, err)


def _versus_dense(name: str, n: int, mask: Any, config: BenchConfig, goal: float) -> Comparison:
    """Forward of qkv against SDPA given the same mask as a dense (n, n) bool tensor."""
    import torch.nn.functional as F

    dense = mask.to_dense(n, n)
    return _compare_forward(
        name, n, mask, "SDPA, dense bool mask",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), config, goal,
    )


def _compare_backward(name: str, n: int, mask: Any, config: BenchConfig, goal: float | None) -> Comparison:
    import torch
    import torch.nn.functional as F

    import qkv

    dense = mask.to_dense(n, n)
    q, k, v = _inputs(n, config, requires_grad=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)

    def ours() -> None:
        qkv.attention(q, k, v, mask).backward(grad)

    def peer() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(grad)

    times = _fastest({"qkv": ours, "peer": peer}, config.repeats)
    flops = 3.5 * _forward_flops(q, k, v, mask)  # forward + backward (2.5 x forward)
    return Comparison(name, n, times["qkv"], "SDPA fwd+bwd, dense bool mask", times["peer"], goal,
                      flops / times["qkv"] / 1e9, None)


def _flex_comparisons(n: int, config: BenchConfig) -> list[Comparison]:
    """Steady state, and first call including create_block_mask and compilation."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import qkv

    w = config.window

    def window_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx) <= w) & ((kv_idx - q_idx) <= w)

    mask = qkv.masks.sliding_window(w, w)
    q, k, v = _inputs(n, config)
    with torch.no_grad():
        start = time.perf_counter()
        ours = qkv.attention(q, k, v, mask)
        ours_first = time.perf_counter() - start
        compiled = torch.compile(flex_attention, dynamic=False)
        start = time.perf_counter()
        block_mask = create_block_mask(window_mod, None, None, n, n, device="cpu")
        theirs = compiled(q, k, v, block_mask=block_mask)
        flex_first = time.perf_counter() - start
        err = float((ours - theirs).abs().max())
        times = _fastest(
            {"qkv": lambda: qkv.attention(q, k, v, mask), "flex": lambda: compiled(q, k, v, block_mask=block_mask)},
            config.repeats,
        )
    flops = _forward_flops(q, k, v, mask)
    return [
        Comparison(f"sliding_window({w}, {w}) forward", n, times["qkv"], "FlexAttention compiled, steady state",
                   times["flex"], 1.2, flops / times["qkv"] / 1e9, err),
        Comparison(f"sliding_window({w}, {w}) first call", n, ours_first,
                   "FlexAttention incl. create_block_mask + compile", flex_first, 20.0, flops / ours_first / 1e9, err),
    ]


# Peak resident memory of the child itself: Linux's VmHWM is the high-water mark of this
# process's memory map, reset by exec; ru_maxrss would also count the parent's peak, which
# Linux carries across fork and exec.
_RSS_SCRIPT = """
import json, os, resource, sys, torch, torch.nn.functional as F, qkv
def peak():
    if os.path.exists("/proc/self/status"):
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
path, w, H, E, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), getattr(torch, sys.argv[5])
torch.manual_seed(0)
for n in map(int, sys.argv[6:]):
    q, k, v = (torch.randn(1, H, n, E).to(dtype) for _ in range(3))
    mask = qkv.masks.sliding_window(w, w)
    with torch.no_grad():
        if path == "qkv":
            out = qkv.attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to_dense(n, n))
    del q, k, v, out
    print(json.dumps([n, peak()]), flush=True)
"""


def _peak_rss(path: str, sizes: tuple[int, ...], config: BenchConfig) -> dict[int, int]:
    """Peak RSS in bytes after each size (increasing), in a fresh Python process."""
    args = [sys.executable, "-c", _RSS_SCRIPT, path, str(config.window), str(config.heads), str(config.head_dim), config.dtype]
    result = subprocess.run([*args, *map(str, sorted(sizes))], capture_output=True, text=True, check=True)
    return {int(n): int(rss) for n, rss in map(json.loads, result.stdout.splitlines())}


def run_suite(config: BenchConfig) -> Iterator[tuple[str, BenchReport]]:
    """Run the benchmark step by step, yielding (what was just done, the report so far)."""
    # compile FlexAttention from scratch: a warm inductor cache would hide its compile time
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-bench-inductor-"))
    import torch
    import torch.nn.functional as F

    import qkv

    _warm_up(config)
    rate = _matmul_gflops(config.matmul, config.repeats, config.dtype)
    report = BenchReport(config, torch.get_num_threads(), torch.__version__, rate)
    yield "warm-up and matmul rate", report
    w, n = config.window, config.n_window
    window = qkv.masks.sliding_window(w, w)
    report.comparisons.append(_versus_dense(f"sliding_window({w}, {w}) forward", n, window, config, 20.0))
    yield "sliding window vs SDPA", report
    if config.flex:
        report.comparisons.extend(_flex_comparisons(n, config))
        yield "sliding window vs FlexAttention", report
    docs = qkv.masks.documents(_document_ids(config.n_docs, config.documents)) & qkv.masks.causal()
    report.comparisons.append(_versus_dense(f"documents({config.documents}) & causal forward", config.n_docs, docs, config, 20.0))
    yield "documents vs SDPA", report
    for size in config.n_causal:
        report.comparisons.append(_compare_forward(
            "causal forward", size, qkv.masks.causal(), "SDPA is_causal",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), config, 0.95,
        ))
    yield "causal vs SDPA", report
    if config.backward:
        report.comparisons.append(_compare_backward(f"sliding_window({w}, {w}) forward + backward", n, window, config, 10.0))
        yield "backward vs SDPA", report
    for size in config.sweep:
        ours, theirs = _window_times(size, config)
        report.sweep.setdefault("qkv seconds", {})[size] = ours
        report.sweep.setdefault("SDPA dense mask seconds", {})[size] = theirs
    yield "time versus n", report
    rss = _peak_rss("qkv", (*config.sweep, config.n_memory), config)
    report.peak_rss_bytes = rss[config.n_memory]
    report.sweep["qkv peak RSS bytes"] = {n: rss[n] for n in config.sweep}
    report.sweep["SDPA dense mask peak RSS bytes"] = _peak_rss("sdpa", config.sweep, config)
    yield "peak memory", report


def _window_times(n: int, config: BenchConfig) -> tuple[float, float]:
    """Fastest forward of the sliding window: (qkv, SDPA with the dense bool mask) in seconds."""
    import torch
    import torch.nn.functional as F

    import qkv

    q, k, v = _inputs(n, config)
    window = qkv.masks.sliding_window(config.window, config.window)
    dense = window.to_dense(n, n)
    with torch.no_grad():
        times = _fastest({
            "qkv": lambda: qkv.attention(q, k, v, window),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        }, config.repeats)
    return times["qkv"], times["sdpa"]


def steps(config: BenchConfig) -> int:
    """Number of items `run_suite` yields (for a progress bar)."""
    return 6 + int(config.flex) + int(config.backward)
