"""Example 7, the quadratic cost (first article, detail 4; second article's "double the text,
four times the compute and memory").

Every token scores every token: n^2 scores. Doubling n quadruples the scores exactly, and
with them the memory of the materialized path, the one that writes the whole n x n matrix
down, as `qkv.reference` does, and the arithmetic it performs. The time follows only in the
limit: at these sizes a call also pays costs that do not grow like n^2 (its set-up, caches
that still hold the matrices), so a doubling measures less than x4. Here that is measured,
not just stated: wall time (the
benchmarks' timing rule, `qkv.bench.fastest`) and peak memory (`qkv.bench.traced_peak_bytes`:
Python's tracemalloc, which sees NumPy's allocations) of the reference for n = 256 ... 2048,
one head of width 64.

Next to it, qkv's PyTorch paths on the same inputs: ``backend="math"`` (materialized, in
float32) and a sliding-window mask,
``attention(q, k, v, masks.sliding_window(127))``, where each query sees only the
128 most recent keys: its work grows like n, not n^2, and `qkv.explain` says which path runs
and what it visits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, table

__all__ = ["Result", "SizeRow", "WindowRow", "run"]

NAME = "quadratic"
TITLE = "Quadratic cost: double the sequence, four times the scores and the memory"
SUMMARY = (
    "n tokens make n^2 scores: doubling n makes exactly four times the scores, and the "
    "materialized path's memory grows the same way; its measured time grows toward x4 (less at "
    "small n, where costs that do not grow like n^2 weigh), while a sliding-window mask lets qkv "
    "visit only n x window of the scores."
)

SIZES = (256, 512, 1024, 2048)
HEAD_DIM = 64
WINDOW_LEFT = 127  # each query sees itself and the 127 keys before it
# Rounds over all sizes (a burst of load from other processes spreads over the sizes instead
# of landing on one); the best time is the least disturbed. Within a round a fast call runs
# again until ROUND_SECONDS have passed, so small sizes get more tries.
REPEATS = 3
ROUND_SECONDS = 0.01
SEED = 0
CHECK_N = 512  # the window path is compared with the masked reference at this n (several tiles)


@dataclass(frozen=True)
class SizeRow:
    """The materialized path at one n: n^2 scores, best time and peak memory of the reference."""

    n: int
    scores: int
    reference_seconds: float
    reference_peak_bytes: int
    math_seconds: float  # attention(backend="math"), float32


@dataclass(frozen=True)
class WindowRow:
    """qkv with ``sliding_window(WINDOW_LEFT)`` at one n."""

    n: int
    inside: int  # (query, key) pairs inside the window: the scores that matter
    visited: int  # scores the chosen path computes (whole tiles, or all n^2 on a dense path)
    seconds: float
    path: str  # what qkv.explain says runs
    flops: int
    extra_bytes: int  # qkv.explain's estimate


@dataclass(frozen=True)
class Result(ExampleResult):
    """One SizeRow and one WindowRow per n."""

    head_dim: int
    window_left: int
    sizes: tuple[SizeRow, ...]
    windows: tuple[WindowRow, ...]
    explain_dense: str  # qkv.explain for the largest n, no mask
    explain_window: str  # ... and with the sliding window
    window_max_difference: float  # max |window path - masked reference| at n = CHECK_N

    def headline(self) -> str:
        last = self.sizes[-1]
        first = self.sizes[0]
        grow = last.n // first.n
        return (
            f"n x{grow}: scores x{last.scores // first.scores} (n^2, exact); measured on the reference: "
            f"memory x{fmt(last.reference_peak_bytes / first.reference_peak_bytes, 0)}, time "
            f"x{fmt(last.reference_seconds / first.reference_seconds, 0)} (x{last.scores // first.scores} only in "
            f"the limit); sliding window: qkv computes x{fmt(self.windows[-1].visited / self.windows[0].visited, 1)} scores"
        )

    def render(self) -> RenderableType:
        rows = []
        for i, r in enumerate(self.sizes):
            previous = self.sizes[i - 1] if i else None

            def times(now: float, before: float | None) -> str:
                return "" if before is None else f"x{fmt(now / before, 1)}"

            rows.append([
                str(r.n),
                f"{r.scores:,}",
                times(r.scores, previous.scores if previous else None),
                f"{1e3 * r.reference_seconds:.1f} ms",
                times(r.reference_seconds, previous.reference_seconds if previous else None),
                f"{r.reference_peak_bytes / 2**20:.1f} MiB",
                times(r.reference_peak_bytes, previous.reference_peak_bytes if previous else None),
            ])
        materialized = table(["n", "scores n^2", "", "reference time", "", "peak memory", ""], rows, numeric=True)
        parts: list[RenderableType] = [
            Text(f"The materialized path (qkv.reference, float64, one head, d_k = {self.head_dim})", style="italic"),
            materialized,
            Text(
                "Exact: the scores (n^2) and the n x n matrices' memory grow x4 per doubling of n. Measured: the "
                "time, which grows by less at these sizes (each call also pays costs that do not grow like n^2) "
                "and approaches x4 as n grows."
            ),
        ]
        qkv_rows = [
            [str(s.n), f"{1e3 * s.math_seconds:.1f} ms", f"{w.inside:,}", f"{w.visited:,}", f"{1e3 * w.seconds:.1f} ms", w.path]
            for s, w in zip(self.sizes, self.windows, strict=True)
        ]
        parts += [
            Text(f"qkv (float32): materialized math path vs sliding_window({self.window_left})", style="italic"),
            table(
                ["n", "math time", "window: pairs inside", "scores computed", "window time", "path"], qkv_rows, numeric=True
            ),
            Text(
                "Pairs inside: the (query, key) pairs the window lets through. Scores computed: what the "
                "path visits, from qkv.explain: every tile that touches the window (blocks), or all n^2 "
                "with the mask applied (fused, chosen where the window covers most of the matrix)."
            ),
            Text(f"qkv.explain, n = {self.sizes[-1].n}, no mask:", style="italic"),
            Text(self.explain_dense),
            Text(f"qkv.explain, n = {self.sizes[-1].n}, sliding_window({self.window_left}):", style="italic"),
            Text(self.explain_window),
            Text(f"The window path agrees with the masked reference to {self.window_max_difference:.1g} (n = {CHECK_N}).\n"),
        ]
        return Group(*parts)


def _best_times(calls: list[Callable[[], object]]) -> list[float]:
    """Best wall time of each call, in order, by the benchmarks' timing rule (`qkv.bench.fastest`)."""
    from qkv.bench import fastest  # imports PyTorch, like run()

    best = fastest({str(i): call for i, call in enumerate(calls)}, REPEATS, round_seconds=ROUND_SECONDS)
    return [best[str(i)] for i in range(len(calls))]


def _visible_pairs(n: int, left: int) -> int:
    """Query p sees keys max(0, p - left) .. p."""
    return int(sum(min(p, left) + 1 for p in range(n)))


def run() -> Result:
    """Measure the reference and qkv's paths for every n in SIZES."""
    import torch

    from qkv import masks
    from qkv.attention.functional import attention, explain
    from qkv.bench import traced_peak_bytes

    rng = np.random.default_rng(SEED)
    numpy_inputs = [
        (rng.standard_normal((n, HEAD_DIM)), rng.standard_normal((n, HEAD_DIM)), rng.standard_normal((n, HEAD_DIM)))
        for n in SIZES
    ]  # (n, E) each: q, k, v

    def as_torch(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.float32)[None, None]  # (1, 1, n, E)

    torch_inputs = [(as_torch(q), as_torch(k), as_torch(v)) for q, k, v in numpy_inputs]
    mask = masks.sliding_window(WINDOW_LEFT)

    def materialized(i: int) -> Callable[[], object]:
        return lambda: reference.attention(*numpy_inputs[i])

    def math(i: int) -> Callable[[], object]:
        return lambda: attention(*torch_inputs[i], backend="math")

    def window(i: int) -> Callable[[], object]:
        return lambda: attention(*torch_inputs[i], mask)

    count = len(SIZES)
    # NumPy's and PyTorch's thread pools each spin for a while after a call: timing them
    # interleaved makes them fight over the cores, so each engine gets its own rounds.
    torch_calls = [math(i) for i in range(count)] + [window(i) for i in range(count)]
    threads = torch.get_num_threads()
    # One thread each: on a shared machine a thread pool waits at every barrier for a
    # descheduled worker, which swamps the n^2 growth this example is about.
    torch.set_num_threads(1)
    try:
        times = _best_times([materialized(i) for i in range(count)]) + _best_times(torch_calls)
    finally:
        torch.set_num_threads(threads)
    sizes = tuple(
        SizeRow(
            n=n,
            scores=n * n,
            reference_seconds=times[i],
            reference_peak_bytes=traced_peak_bytes(materialized(i)),
            math_seconds=times[count + i],
        )
        for i, n in enumerate(SIZES)
    )
    largest = torch_inputs[-1]
    windows = []
    for i, n in enumerate(SIZES):
        explanation = explain(*torch_inputs[i], mask)
        windows.append(
            WindowRow(
                n=n,
                inside=_visible_pairs(n, WINDOW_LEFT),
                visited=round(explanation.visited_fraction * n * n),
                seconds=times[2 * count + i],
                path=explanation.path,
                flops=explanation.flops,
                extra_bytes=explanation.peak_extra_bytes,
            )
        )
    q, k, v = numpy_inputs[SIZES.index(CHECK_N)]
    out = attention(*torch_inputs[SIZES.index(CHECK_N)], mask)
    assert isinstance(out, torch.Tensor)
    expected = reference.attention(q, k, v, mask=mask.to_dense(CHECK_N, CHECK_N)[0, 0].numpy()).output  # (n, E)
    window_difference = float(np.abs(out[0, 0].double().numpy() - expected).max())
    return Result(
        head_dim=HEAD_DIM,
        window_left=WINDOW_LEFT,
        sizes=sizes,
        windows=tuple(windows),
        explain_dense=str(explain(*largest, backend="math")),
        explain_window=str(explain(*largest, mask)),
        window_max_difference=window_difference,
    )
