"""The block-sparse benchmark behind `qkv bench` and benchmarks/sparse.py.

Every comparison times qkv and its peer in the same process by the one timing rule
(`qkv.bench.fastest`: rotating rounds, fastest run kept) and reports the ratio (machines are
shared and noisy; absolute times are only context). Work is counted with docs/design.md's
formula: forward FLOPs = 4 * B * H * L * S_visited * E, where S_visited counts only the keys
of visited tiles for qkv; backward = 2.5 x forward. Peak memory is the high-water resident
set (`qkv.bench.peak_rss_bytes`) of a fresh subprocess that runs one problem size after
another in increasing order, PyTorch's own footprint included.

Comparisons (``case``: what each one measures, and its goal):
- ``window``: sliding_window(256, 256), n = 16384, vs SDPA with the equivalent dense bool
  mask (>= 20x);
- ``window_flex`` / ``window_flex_first``: the same vs FlexAttention compiled, steady state
  (>= 1.2x), and including its block-mask creation and compilation with an empty inductor
  cache (>= 20x);
- ``documents``: 64 packed documents of random lengths, causal, n = 16384, vs SDPA dense
  mask (>= 20x);
- ``causal``: causal, n = 4096 and 8192, vs SDPA is_causal (>= 0.95x);
- ``window_backward``: forward + backward of the sliding window, n = 16384, vs SDPA dense
  mask (>= 10x);
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
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from qkv import masks
from qkv.attention.functional import attention, explain
from qkv.bench._data import document_ids, random_qkv
from qkv.native.rates import matmul_gflops, matmul_words
from qkv.native.timing import fastest

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "PEAK_RSS_GOAL_BYTES",
    "QUICK",
    "STANDARD",
    "BenchConfig",
    "BenchReport",
    "Comparison",
    "run_suite",
    "steps",
]

PEAK_RSS_GOAL_BYTES = 1.5e9  # the sliding window forward at STANDARD.n_memory stays below this


# Wider than any table: the width a table is measured in to find the width it needs.
_UNBOUNDED_WIDTH = 100_000


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
    matmul: int | None = None  # side of the square matmul (in ``dtype``) that measures the machine's
    # rate; None: its limit, the best over `qkv.bench.LIMIT_SIDES`
    judge: bool = True  # compare speedups with the goals; False for a smoke run, too small to judge
    dtype: str = "float32"  # of q, k, v and of the matmul rate: "float32" or "bfloat16"


STANDARD = BenchConfig()
# window 128: at n = 1,024 a window of 256 either side is near the size where 'auto' estimates
# SDPA with a dense mask faster (`qkv.backends.blocks.crossover`), and the smoke run should
# exercise the block engine
QUICK = BenchConfig(
    n_window=1024, window=128, n_docs=1024, documents=8, n_causal=(512,), n_memory=2048, sweep=(256, 512),
    repeats=2, flex=False, backward=True, matmul=256, judge=False,
)


@dataclass(frozen=True)
class Comparison:
    """qkv against one peer on one problem: fastest times in seconds and the speedup."""

    case: str  # which comparison of the suite (module docstring): "window", "causal", ...
    name: str  # what a reader is shown
    n: int
    qkv_s: float
    peer: str
    peer_s: float
    goal: float | None  # speedup asked for
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

    def comparison(self, case: str) -> Comparison | None:
        """The first comparison of ``case`` (module docstring), or None if it was not run."""
        return next((c for c in self.comparisons if c.case == case), None)

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

    def print(self, console: Console) -> None:
        """The comparisons as a table, then the machine's matmul rate, the FLOP fraction and the
        peak memory; sentences are printed unwrapped and without markup. On a console that is
        not a terminal the table takes the width it needs: no number is ever cut."""
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        def say(message: str) -> None:
            console.print(Text(message), highlight=False, soft_wrap=True)

        config, judge = self.config, self.config.judge
        kind = "" if judge else "smoke run, "
        table = Table(title=f"qkv vs peers ({kind}{config.dtype}, B=1, H={config.heads}, E={config.head_dim}, "
                      f"{self.threads} threads, torch {self.torch_version})")
        columns = ["case", "n", "qkv ms", "peer", "peer ms", "speedup", *(["goal"] if judge else []), "qkv GFLOP/s", "of matmul"]
        for column in columns:
            table.add_column(column, justify="left" if column in ("case", "peer") else "right")
        for c in self.comparisons:
            mark = "" if c.met is None else (" ok" if c.met else " MISSED")
            goal = ["" if c.goal is None else f">= {c.goal:g}x{mark}"] if judge else []
            table.add_row(
                c.name, str(c.n), f"{c.qkv_s * 1e3:.1f}", c.peer, f"{c.peer_s * 1e3:.1f}", f"{c.speedup:.2f}x",
                *goal, f"{c.qkv_gflops:.1f}", f"{c.qkv_gflops / self.matmul_gflops:.0%}",
            )
        # measured without the console's width, which would clamp it
        needed = console.measure(table, options=console.options.update_width(_UNBOUNDED_WIDTH)).maximum
        if console.is_terminal or needed <= console.width:
            console.print(table)
        else:  # a file or a pipe has no width: the whole table, never "42939…" cut to 80 columns
            Console(file=console.file, width=needed, color_system=None).print(table)
        if not judge:
            say("A smoke run (--quick): every comparison runs, on sizes too small and repeats too few "
                "to judge speed against the goals; run `qkv bench` without --quick for that.")
        say(f"{config.dtype} matmul on this machine ({matmul_words(config.matmul)}, same run): {self.matmul_gflops:.1f} GFLOP/s")
        window = self.comparison("window")
        if window is not None:
            say(f"sliding window forward: {window.qkv_gflops:.1f} GFLOP/s on visited tiles = "
                f"{window.qkv_gflops / self.matmul_gflops:.0%} of the matmul rate")
        if self.peak_rss_bytes is not None:
            rss_goal = f" (goal < {PEAK_RSS_GOAL_BYTES / 1e9:g} GB at n={STANDARD.n_memory})" if judge else ""
            say(f"peak RSS, sliding window forward at n={config.n_memory}: "
                f"{self.peak_rss_bytes / 2**30:.2f} GiB{rss_goal}")


def _inputs(n: int, config: BenchConfig, requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return random_qkv(n, heads=config.heads, head_dim=config.head_dim, dtype=getattr(torch, config.dtype),
                      requires_grad=requires_grad)


def _warm_up(config: BenchConfig, n: int = 512) -> None:
    """Run every path once, forward and backward, so that no timing pays for first-call setup."""
    q, k, v = _inputs(n, config, requires_grad=True)
    window = masks.sliding_window(64, 64)
    docs = masks.documents(document_ids(n, 4)) & masks.causal()
    for mask in (window, docs, masks.causal()):
        attention(q, k, v, mask, backend="blocks").sum().backward()
        attention(q, k, v, mask).sum().backward()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to_dense(n, n)).sum().backward()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def _forward_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> int:
    return explain(q, k, v, mask).flops


def _compare_forward(
    case: str, name: str, n: int, mask: Any, peer: str, peer_fn: Callable[..., torch.Tensor],
    config: BenchConfig, goal: float | None,
) -> Comparison:
    q, k, v = _inputs(n, config)
    with torch.no_grad():
        ours = attention(q, k, v, mask)
        theirs = peer_fn(q, k, v)
        err = float((ours - theirs).abs().max())
        times = fastest({"qkv": lambda: attention(q, k, v, mask), "peer": lambda: peer_fn(q, k, v)}, config.repeats)
    flops = _forward_flops(q, k, v, mask)
    return Comparison(case, name, n, times["qkv"], peer, times["peer"], goal, flops / times["qkv"] / 1e9, err)


def _versus_dense(case: str, name: str, n: int, mask: Any, config: BenchConfig, goal: float) -> Comparison:
    """Forward of qkv against SDPA given the same mask as a dense (n, n) bool tensor."""
    dense = mask.to_dense(n, n)
    return _compare_forward(
        case, name, n, mask, "SDPA, dense bool mask",
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), config, goal,
    )


def _compare_backward(name: str, n: int, mask: Any, config: BenchConfig, goal: float | None) -> Comparison:
    dense = mask.to_dense(n, n)
    q, k, v = _inputs(n, config, requires_grad=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)

    def ours() -> None:
        attention(q, k, v, mask).backward(grad)

    def peer() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(grad)

    times = fastest({"qkv": ours, "peer": peer}, config.repeats)
    flops = 3.5 * _forward_flops(q, k, v, mask)  # forward + backward (2.5 x forward)
    return Comparison("window_backward", name, n, times["qkv"], "SDPA fwd+bwd, dense bool mask", times["peer"], goal,
                      flops / times["qkv"] / 1e9, None)


def _flex_comparisons(n: int, config: BenchConfig) -> list[Comparison]:
    """Steady state, and first call including create_block_mask and compilation."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    w = config.window

    def window_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx) <= w) & ((kv_idx - q_idx) <= w)

    mask = masks.sliding_window(w, w)
    q, k, v = _inputs(n, config)
    with torch.no_grad():
        start = time.perf_counter()
        ours = attention(q, k, v, mask)
        ours_first = time.perf_counter() - start
        compiled = torch.compile(flex_attention, dynamic=False)
        start = time.perf_counter()
        block_mask = create_block_mask(window_mod, None, None, n, n, device="cpu")
        theirs = compiled(q, k, v, block_mask=block_mask)
        flex_first = time.perf_counter() - start
        err = float((ours - theirs).abs().max())
        times = fastest(
            {"qkv": lambda: attention(q, k, v, mask), "flex": lambda: compiled(q, k, v, block_mask=block_mask)},
            config.repeats,
        )
    flops = _forward_flops(q, k, v, mask)
    return [
        Comparison("window_flex", f"sliding_window({w}, {w}) forward", n, times["qkv"],
                   "FlexAttention compiled, steady state", times["flex"], 1.2, flops / times["qkv"] / 1e9, err),
        Comparison("window_flex_first", f"sliding_window({w}, {w}) first call", n, ours_first,
                   "FlexAttention incl. create_block_mask + compile", flex_first, 20.0, flops / ours_first / 1e9, err),
    ]


def _peak_rss(path: str, sizes: tuple[int, ...], config: BenchConfig) -> dict[int, int]:
    """Peak RSS in bytes after each size (increasing), in a fresh Python process
    (`qkv.bench._rss_child`)."""
    args = [sys.executable, "-m", "qkv.bench._rss_child", path, str(config.window), str(config.heads),
            str(config.head_dim), config.dtype]
    result = subprocess.run([*args, *map(str, sorted(sizes))], capture_output=True, text=True, check=True)
    return {int(n): int(rss) for n, rss in map(json.loads, result.stdout.splitlines())}


def run_suite(config: BenchConfig) -> Iterator[tuple[str, BenchReport]]:
    """Run the benchmark step by step, yielding (what was just done, the report so far)."""
    # compile FlexAttention from scratch: a warm inductor cache would hide its compile time
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-bench-inductor-"))
    _warm_up(config)
    rate = matmul_gflops(getattr(torch, config.dtype), side=config.matmul, repeats=max(3, config.repeats))
    report = BenchReport(config, torch.get_num_threads(), torch.__version__, rate)
    yield "warm-up and matmul rate", report
    w, n = config.window, config.n_window
    window = masks.sliding_window(w, w)
    report.comparisons.append(_versus_dense("window", f"sliding_window({w}, {w}) forward", n, window, config, 20.0))
    yield "sliding window vs SDPA", report
    if config.flex:
        report.comparisons.extend(_flex_comparisons(n, config))
        yield "sliding window vs FlexAttention", report
    docs = masks.documents(document_ids(config.n_docs, config.documents)) & masks.causal()
    report.comparisons.append(
        _versus_dense("documents", f"documents({config.documents}) & causal forward", config.n_docs, docs, config, 20.0)
    )
    yield "documents vs SDPA", report
    for size in config.n_causal:
        report.comparisons.append(_compare_forward(
            "causal", "causal forward", size, masks.causal(), "SDPA is_causal",
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
    sdpa_rss = _peak_rss("sdpa", config.sweep, config)
    report.sweep["SDPA dense mask peak RSS bytes"] = {n: sdpa_rss[n] for n in config.sweep}
    yield "peak memory", report


def _window_times(n: int, config: BenchConfig) -> tuple[float, float]:
    """Fastest forward of the sliding window: (qkv, SDPA with the dense bool mask) in seconds."""
    q, k, v = _inputs(n, config)
    window = masks.sliding_window(config.window, config.window)
    dense = window.to_dense(n, n)
    with torch.no_grad():
        times = fastest({
            "qkv": lambda: attention(q, k, v, window),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        }, config.repeats)
    return times["qkv"], times["sdpa"]


def steps(config: BenchConfig) -> int:
    """Number of items `run_suite` yields (for a progress bar)."""
    return 6 + int(config.flex) + int(config.backward)
