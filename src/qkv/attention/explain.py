"""`qkv.explain`'s answer: a `qkv.attention.dispatch.Plan` described, its work counted, its memory estimated.

No kernel runs here. The work is the (query, key) pairs the Plan's path computes; the extra
memory is what its kernel module says it allocates (`math_extra_bytes`, `fused_extra_bytes`,
`engine_extra_bytes`, `flex_extra_bytes`) plus the tensors the Plan makes for it (a dense mask,
a rendered bias, returned weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.attention.dispatch import BLOCKS, Plan, mask_heads
from qkv.attention.problem import AttentionProblem
from qkv.backends.blocks.engine import engine_extra_bytes
from qkv.backends.flex import FLEX_BLOCK, flex_extra_bytes
from qkv.backends.protocol import BACKENDS, COMPILED_KERNELS, flex_cpu_elements, kernel_words
from qkv.backends.query_chunks import chunk_spans, chunked_extra_bytes, chunked_pairs
from qkv.backends.softmax import accumulation_bytes
from qkv.masks import FULL, Mask
from qkv.native.machine import compute_dtype, cpu_features, emulation_note

__all__ = ["Explanation", "explanation"]


@dataclass(frozen=True)
class Explanation:
    """Which path `qkv.attention` takes for given inputs, why, and what it costs.

    flops counts 2 * (E + Ev) FLOPs per visited (query, key) pair and head (E multiply-adds
    for the score and Ev for the output, two FLOPs each), the docs/design.md rule
    4 * B * H * L * S * E when E == Ev. peak_extra_bytes is an estimate of the memory the
    path allocates beyond inputs and output.
    """

    path: str
    reason: str
    shape: str
    mask: str
    flops: int
    visited_fraction: float
    peak_extra_bytes: int
    blocks_visited: float | None = None  # blocks / flex: fraction of tiles not skipped
    tiles: str | None = None  # blocks / flex: tile size and counts
    # how the mask and the score terms reach the kernel, and where weights and lse come from
    # (the Plan's routes, `qkv.attention.dispatch`)
    route: str = ""
    scores: str = ""  # the score terms beyond scale * q.k (softcap, bias, score_mod), '' for none
    score_flops: int = 0  # their operations on the visited pairs, not included in flops
    # the mask's tiles were not evaluated (Plan.deferred): flops, the visited fraction and
    # score_flops count every pair, an upper bound
    upper_bound: bool = False
    # the Plan's forward kernel in words where it is a compiled one or the Plan says why a
    # compiled one does not run (low-precision inputs on the fused path and on the block engine
    # without score terms); '' otherwise.
    forward_kernel: str = ""
    backward_kernel: str = ""  # the same for the backward
    # (forward, backward): the Plan's kernels by their short names (`Plan.forward_kernel`,
    # `qkv.backends.protocol.FORWARD_KERNELS`), whether or not a line above describes them
    kernels: tuple[str, str] = ("", "")
    notes: tuple[str, ...] = ()  # warnings about this machine (a dtype without native products)
    # (dtype name, GFLOP/s) of this machine's matrix multiply, measured when explain(measure=True)
    matmul_rates: tuple[tuple[str, float], ...] = ()
    matmul_threads: int = 0  # the intra-op threads those rates were measured with
    cpu_tier: str = ""  # CPU inputs: the tier qkv uses on this machine (`qkv.native.machine`)

    def __str__(self) -> str:
        lines = [
            f"path: {self.path}",
            f"why: {self.reason}",
            f"problem: {self.shape}, mask: {self.mask}",
            f"work: {self.flops / 1e9:.3f} GFLOP forward ({self.visited_fraction:.1%} of the score matrix visited)"
            if not self.upper_bound
            else f"work: at most {self.flops / 1e9:.3f} GFLOP forward (the mask's tiles are not evaluated here)",
        ]
        if self.scores:
            lines.append(f"scores: {self.scores}, {self.score_flops / 1e9:.3f} GFLOP on the visited pairs")
        if self.route:
            lines.append(f"route: {self.route}")
        if self.tiles is not None:
            lines.append(f"tiles: {self.tiles}")
        if self.forward_kernel:
            lines.append(f"forward kernel: {self.forward_kernel}")
        if self.backward_kernel:
            lines.append(f"backward kernel: {self.backward_kernel}")
        lines.append(f"extra memory: {_format_bytes(self.peak_extra_bytes)} (estimate)")
        if self.cpu_tier:
            lines.append(f"cpu tier: {self.cpu_tier}")
        lines += [f"note: {note}" for note in self.notes]
        if self.matmul_rates:
            rates = ", ".join(f"{name} {rate:.0f}" for name, rate in self.matmul_rates)
            name, rate = self.matmul_rates[-1]
            lines.append(
                f"machine: matmul {rates} GFLOP/s (measured, {self.matmul_threads} threads); "
                f"this work takes {'at most ' if self.upper_bound else ''}{self.flops / rate / 1e6:.2f} ms "
                f"at the {name} matmul rate"
            )
        return "\n".join(lines)


_MASK_ROUTES = {
    "none": "no mask is passed",
    "is_causal": "the mask is SDPA's is_causal",
    "causal_offset": "the causal mask is applied by the formula",
    "dense": "the mask is a dense tensor",
    "tiles": "the mask reaches the kernel as tiles",
    "chunks": "the mask is applied chunk by chunk",
}
_SCORE_ROUTES = {
    "dense_mask": "the bias joins SDPA's float mask",
    "formula": "the score terms are applied by the formula",
    "tiles": "the score terms are applied tile by tile",
    "kernel": "the score terms are applied inside the fused kernel",
    "score_mod": "the score terms are FlexAttention's score_mod",
    "chunks": "the score terms (softcap, then bias) are applied to each key chunk",
}
_SOURCES = {"kernel": "the kernel", "dense": "the dense formula", "tiles": "the tiles"}


def describe_route(problem: AttentionProblem, plan: Plan) -> str:
    """The Plan's routes in words: how the mask and score terms reach the kernel, and where
    the weights and the lse come from (only those the call returns or needs)."""
    parts = [_MASK_ROUTES[plan.mask]]
    if plan.scores != "none":
        parts.append(_SCORE_ROUTES[plan.scores])
    if plan.weights != "none":
        parts.append(f"weights from {_SOURCES[plan.weights]}")
    if plan.lse != "none" and (plan.path == "fused" or plan.lse != "kernel"):
        parts.append(f"lse from {_SOURCES[plan.lse]}")  # the other kernels always give their lse
    return "; ".join(parts)


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def explanation(
    problem: AttentionProblem, plan: Plan, measure: bool = False, stored: torch.dtype | None = None
) -> Explanation:
    """Describe ``plan`` for ``problem``: path, reason, work and memory; with ``measure`` this
    machine's matmul rates too (`qkv.native.rates.machine_matmul_gflops`). ``stored``: the caller's
    dtype when the problem was widened to float32 for this CPU (`qkv.native.machine`)."""
    NH = problem.N * problem.H
    L, S, E, Ev = problem.L, problem.S, problem.E, problem.Ev
    pairs = _visible_pairs(problem, plan)
    blocks_visited = tiles = None
    if plan.deferred:
        points = problem.mask.evaluated_points(L, S) if isinstance(problem.mask, Mask) else 0
        if points:
            tiles = f"not evaluated: the layout takes {points:,} evaluations of the mask, done when attention runs"
        else:  # traced (torch.compile, torch.export): the engine's operator plans them
            tiles = "planned when the traced graph runs, from the mask's values"
    if plan.layout is not None:
        layout = plan.layout
        blocks_visited = layout.visited_block_fraction
        tiles = (
            f"{layout.block_q}x{layout.block_k}: {layout.states.numel() - layout.count(0)} of "
            f"{layout.states.numel()} visited ({blocks_visited:.1%}), {layout.count(FULL)} of them full"
        )
    q = problem.q
    batch = "x".join(str(b) for b in problem.batch_shape) or "()"
    # the stored dtype, and the one its products run in where this CPU emulates it: the call
    # was widened first, or its path widens it itself (a decode step, `short_wide`)
    shown, computed = stored or q.dtype, compute_dtype(stored or q.dtype, q.device)
    dtype_text = str(shown).removeprefix("torch.")
    if computed != shown:
        dtype_text += f" computed in {str(computed).removeprefix('torch.')}"
    shape = f"B={batch} H={problem.H} G={problem.G} L={L} S={S} E={E} Ev={Ev} {dtype_text} on {q.device}"
    note = emulation_note(stored or q.dtype, q.device)
    # a kernel line where the Plan chose a compiled kernel (or the float32 backward for bf16) or
    # says why one does not run
    forward_kernel = backward_kernel = ""
    if plan.forward_kernel in COMPILED_KERNELS or plan.forward_absent is not None:
        forward_kernel = kernel_words(plan.forward_kernel, plan.forward_absent, plan.forward_absent_kernel)
    if plan.backward_kernel in COMPILED_KERNELS or plan.backward_absent is not None or plan.backward_kernel == "sdpa_wide":
        backward_kernel = kernel_words(plan.backward_kernel, plan.backward_absent)
    rates: tuple[tuple[str, float], ...] = ()
    threads = 0
    if measure and q.device.type == "cpu":
        from qkv.native.rates import (
            machine_matmul_gflops,  # measured once per dtype and thread count
        )

        threads = torch.get_num_threads()
        rates = tuple(
            (str(dtype).removeprefix("torch."), machine_matmul_gflops(dtype, threads))
            for dtype in dict.fromkeys((torch.float32, stored or q.dtype))
        )
    return Explanation(
        path=plan.path,
        reason=plan.reason,
        shape=shape,
        mask=problem.mask_kind,
        flops=int(2 * (E + Ev) * pairs * NH),
        visited_fraction=pairs / (L * S),
        peak_extra_bytes=extra_bytes(problem, plan),
        blocks_visited=blocks_visited,
        tiles=tiles,
        route=describe_route(problem, plan),
        scores=problem.terms.describe(),
        score_flops=int(problem.terms.flops_per_pair() * pairs * NH),
        upper_bound=plan.deferred,
        forward_kernel=forward_kernel,
        backward_kernel=backward_kernel,
        kernels=(plan.forward_kernel, plan.backward_kernel),
        notes=() if note is None else (note,),
        matmul_rates=rates,
        matmul_threads=threads,
        cpu_tier=cpu_features().describe() if q.device.type == "cpu" else "",
    )


def _visible_pairs(problem: AttentionProblem, plan: Plan) -> float:
    """(query, key) pairs the path computes, per batch row and head."""
    L, S = problem.L, problem.S
    if plan.deferred:
        return L * S  # the tiles are not known: every pair, an upper bound
    if plan.path == "blocks":
        assert plan.tiles is not None
        return plan.tiles.computed_pairs() / problem.N
    if plan.path == "flex":
        assert plan.layout is not None
        return plan.layout.visited_pairs()
    if plan.forward_kernel == "math_chunks":
        return chunked_pairs(_spans(problem, plan))
    if plan.mask == "is_causal":
        m = min(L, S)  # row i (top-left causal) sees min(S, i + 1) keys: a triangle, then full rows
        return m * (m + 1) // 2 + (L - m) * S
    return L * S


def _spans(problem: AttentionProblem, plan: Plan) -> list[tuple[int, int, int, int]]:
    """The query chunks of a ``math_chunks`` plan and the keys each computes (`chunk_spans`)."""
    assert plan.chunk_rows is not None
    mask = problem.mask if plan.mask == "chunks" else None
    return chunk_spans(mask, plan.causal_offset, problem.L, problem.S, plan.chunk_rows)


def _tile_path_bytes(problem: AttentionProblem, plan: Plan) -> int:
    """The blocks / flex kernels' own estimates; a deferred plan's layout size is counted from
    the mask's batch and heads (its tiles are not evaluated)."""
    q, N, H, L, S, mask = problem.q, problem.N, problem.H, problem.L, problem.S, problem.mask
    if plan.layout is not None:
        n_tiles = plan.layout.states.numel()
    else:
        assert plan.deferred
        block_q, block_k = (BLOCKS.block_q, BLOCKS.block_k) if plan.path == "blocks" else (FLEX_BLOCK, FLEX_BLOCK)
        layers = (mask.batch or 1) * (mask.heads or 1) if isinstance(mask, Mask) else 1
        n_tiles = layers * -(-L // block_q) * -(-S // block_k)
    if plan.path == "flex":
        return flex_extra_bytes(q.dtype, N=N, H=H, L=L, n_tiles=n_tiles, cpu_elements=flex_cpu_elements(problem))
    return engine_extra_bytes(
        q.dtype, N=N, H=H, G=problem.G, L=L, S=S, E=problem.E, Ev=problem.Ev,
        plan=plan.tiles, call_bytes=plan.tiles.config.call_bytes if plan.tiles is not None else BLOCKS.call_bytes,
        n_tiles=n_tiles, mask_heads=mask_heads(problem),
        reuses_tiles=isinstance(mask, Mask) and mask.shift_invariant, score_terms=plan.scores not in ("none", "kernel"),
        interval_kernel=plan.forward_kernel == "interval_bf16",
    )


def extra_bytes(problem: AttentionProblem, plan: Plan) -> int:
    """Memory beyond inputs and output (an estimate): the kernel's own, and what the Plan makes for it."""
    q, N, H, L, S = problem.q, problem.N, problem.H, problem.L, problem.S
    acc = accumulation_bytes(q.dtype)
    weights = N * H * L * S * acc if plan.weights != "none" else 0
    if plan.forward_kernel == "math_chunks":
        return chunked_extra_bytes(q.dtype, _spans(problem, plan), N=N, H=H, L=L, Ev=problem.Ev)
    if plan.path in ("math", "decode"):
        return BACKENDS[plan.path].extra_memory(problem)  # the math path's weights are among its intermediates
    if plan.path in ("blocks", "flex"):
        return _tile_path_bytes(problem, plan) + weights
    extra = BACKENDS["fused"].extra_memory(problem) + weights
    if plan.mask == "dense" and problem.mask is not None:
        extra += L * S * (q.element_size() if plan.lse == "kernel" else 1)  # the mask; float for the lse kernel
    if plan.scores == "dense_mask":
        extra += (N if problem.terms.batch_varies else 1) * H * L * S * acc  # the rendered bias
    return extra
