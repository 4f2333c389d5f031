"""The one place where a path is chosen: `choose_path` returns a `Plan`, and nothing else decides.

A `Plan` holds every decision of one attention call: the path (``fused``: PyTorch's SDPA;
``math``: the explicit formula; ``blocks``: the CPU block engine; ``flex``: FlexAttention with
qkv's BlockMask; ``decode``: the split-key decode kernel), how the mask reaches that kernel, how the score terms (softcap, bias,
score_mod) reach it, where the weights and the log-sum-exp come from, and the kernels that run
forward and backward inside the path (`Plan.forward_kernel`, `Plan.backward_kernel`, chosen from
the compiled kernels' ``unavailable_reason`` and `qkv.backends.disabled`). `qkv.attention`
executes a Plan (`qkv.attention.execute`), `qkv.explain` describes one (`qkv.attention.explain`) and runs no
kernel; both read the Plan only.

`choose_path` reads top to bottom: an explicit backend first, then attention sinks (which SDPA
cannot apply: the decode kernel, the tile paths or the math path take them), the score terms, dropout,
a wide float mask under autograd, and finally whether the structured engines pay off for a
structured mask. A `predicate` mask beyond `POINTWISE_BUDGET` points is not evaluated to
decide: it goes to the structured engine with a deferred Plan, which `complete` fills in when
attention runs. `weights_plan` is the rule of `qkv.attention_weights`, and `ring_block_path`
the sub-rule for one block of ring attention (`qkv.distributed.blockwise`).

While torch.compile or torch.export trace (`_compile_tracing`), the mask's values do not exist:
the block engine's Plan is deferred the same way and runs as its operators
(`qkv.backends.blocks.ops`), chosen from the mask's Python parameters (`_traced_sparse`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from qkv._private import spec as spec_codec
from qkv._private import torch as private_torch
from qkv.attention.problem import AttentionProblem, compact
from qkv.backends import decode
from qkv.backends.blocks import crossover
from qkv.backends.blocks.diagonals import (
    TABLE_REFUSAL,
    DiagonalTable,
    diagonal_table,
    fused_terms_reason,
)
from qkv.backends.blocks.ops import encodable, kept_layout, kept_plan, planned_share
from qkv.backends.blocks.planner import (
    BlockConfig,
    BlockPlan,
    BlockSizes,
    plan_intervals,
    plan_layout,
)
from qkv.backends.blocks.scored import closes_over_grad
from qkv.backends.dense import (
    WIDE_BACKWARD_MAX_HEAD_DIM,
    flash_kernel_available,
    fused_lse_available,
    wide_backward_wins,
)
from qkv.backends.flex import FLEX_BLOCK, FLEX_NEEDS, cpu_kernel_reason, flex_available, flex_suits
from qkv.backends.protocol import BACKWARD_KERNELS, FORWARD_KERNELS, decode_kernel, decode_reason
from qkv.backends.query_chunks import chunk_rows
from qkv.masks import (
    FULL,
    POINTWISE_BUDGET,
    BlockLayout,
    Causal,
    Combined,
    Dense,
    KeyPadding,
    Mask,
    Predicate,
)
from qkv.native import interval_bf16, interval_bf16_backward, short_bf16, short_wide, switches
from qkv.native.machine import compute_dtype, cpu_features

__all__ = [
    "BACKENDS",
    "BLOCKS",
    "Backend",
    "MaskRoute",
    "Path",
    "Plan",
    "ScoreRoute",
    "Source",
    "choose_path",
    "complete",
    "decode_plan",
    "decode_widens_itself",
    "key_padding",
    "mask_heads",
    "needs_grad",
    "ring_block_path",
    "short_kernel",
    "short_kernel_reason",
    "short_widens_itself",
    "weights_plan",
]

Backend = Literal["auto", "fused", "math", "blocks", "flex", "decode"]
BACKENDS: tuple[str, ...] = ("auto", "fused", "math", "blocks", "flex", "decode")
Path = Literal["fused", "math", "blocks", "flex", "decode"]
# How the mask reaches the kernel: not at all (no mask, or one that hides nothing here);
# SDPA's is_causal flag; a causal offset the formula applies itself (query i sees keys
# j <= i + offset); a dense (N | 1, H | 1, L, S) tensor; the mask's tiles; chunk by chunk (the
# decode kernel's key positions; the math path's query chunks, evaluated or sliced per chunk).
MaskRoute = Literal["none", "is_causal", "causal_offset", "dense", "tiles", "chunks"]
# How the score terms reach the kernel: there are none; the bias rendered into SDPA's float
# mask; the explicit formula applies them; the block engine applies them tile by tile; the
# fused bf16 interval kernels apply them (a softcap, a bias by diagonal) in their own pass;
# FlexAttention applies them as its score_mod; the decode kernel adds the bias chunk by chunk.
ScoreRoute = Literal["none", "dense_mask", "formula", "tiles", "kernel", "score_mod", "chunks"]
# Where the weights or the lse come from: nowhere (not needed); the kernel itself; the dense
# formula recomputing them (`kernels.dense`); the tiles recomputing them (`kernels.blocks`).
Source = Literal["none", "kernel", "dense", "tiles"]

# The CPU block engine's tile and call sizes (see BlockConfig for why).
BLOCKS = BlockConfig()
# "auto" sends a structured mask to the block engine / FlexAttention when they compute at
# most this fraction of the score matrix: the engine's tiles run at about 60-80 % of the
# dense kernel's rate per FLOP (benchmarks/sparse.py), and SDPA with a dense mask pays for
# building and reading the L x S mask on top.
_SPARSE_MAX_VISITED = 0.6
# ... and when the problem has at least this many (query, key) pairs per head: below it the
# few microseconds of SDPA beat planning and launching tiles. Above it, the block engine's cost
# model (`qkv.backends.blocks.crossover`, `_engine_refusal`) weighs its fixed cost against the
# work it skips, by the whole problem's size.
_SPARSE_MIN_PAIRS = 256 * 256

# 'auto' sends dense bfloat16 attention on CPU (no mask, or causal with L == S) that needs no
# gradient to the block engine, whose fused bf16 interval kernel (`kernels.interval_bf16`)
# beats PyTorch's CPU flash kernel there, for head dims up to this. Measured through
# qkv.attention, input checks included (n = 4,096, H = 8, 2 threads, interleaved, load 1.1-1.3;
# SDPA time / engine time): E = 64 no mask 1.39x, causal 1.37x; E = 128 no mask 1.24x, causal
# 1.30x. Gradients stay on SDPA: its flash backward is faster than the engine's. Without a
# mask, up to `short_bf16.MAX_KEYS` keys belong to the short-sequence kernel.
_DENSE_BF16_KERNEL_MAX_HEAD_DIM = 128
# ... and for at least this many queries: each task of the kernel packs its head's keys and
# values for 64 queries, which few queries do not repay (measured the same way, no mask: L, S =
# 16, 8192 0.58x; 64, 8192 0.97x; 256, 4096 (E = 128) 1.10x; 1024, 4096 1.16x)
_DENSE_BF16_KERNEL_MIN_QUERIES = 256
# Where the interval kernels run on AVX-512 BF16 without AMX (their avx512 build), PyTorch's
# bf16 flash kernel reaches a fifth of the bf16 matrix-multiply rate, and the engine wins with
# gradients too, up to heads of 256 and from 128 queries (AMD EPYC, tier avx512, 2 threads,
# H = 8, load 1.1-1.5; SDPA time / engine time): inference n = 256-4,096, E = 32-256, no mask
# and causal 2.8-5.6x (L, S = 64, 8192: 3.5x; 16, 8192: 1.3x); forward + backward 2.4-4.5x
# (16, 8192: 1.4x). Below `short_bf16.MAX_KEYS` keys it beats the short-sequence kernel with
# float32 products as well (n = 128-512: 1.4-2.0x).
_DENSE_BF16_DOT_MAX_HEAD_DIM = 256
_DENSE_BF16_DOT_MIN_QUERIES = 128

# 'auto' sends a float32 problem that needs gradients to the math path when its float mask's
# finite values span more than this: PyTorch's CPU flash backward then misses docs/design.md's
# tolerance rule (3x the naive error plus 1e-6). Measured (L = S = 128..1024, E = 64): ALiBi-like
# ramps spanning 5e3..3e4 gave 1.2x..3.4x the allowed error, random spreads of 1e4 1.4x; spans up
# to 2e3 stayed below 0.9x, and two-valued padding masks (0 / -1e4, 0 / finfo.min) below 0.3x but
# are routed too, for simplicity. bfloat16 / float16 stayed below 0.7x everywhere.
_FLASH_GRAD_MAX_MASK_SPAN = 1e3

# 'auto' sends L <= decode.MAX_QUERIES queries on CPU to the decode kernel from this many keys:
# below it one thread reads the cache in microseconds and the split does not repay its set-up
# (benchmarks/decode.py). Re-measured at the threshold (H 32 / G 8, E 128, causal, kv_bounds
# given, 2 busy cores, best of 100): float32's decode kernel ties the fused path at 1,024 keys
# (0.96-0.99x its time) and leads from 1,280 (1.07-1.19x), so the threshold stays; bfloat16's
# (chunks widened to float32) trails the fused path up to about 3,000 keys (0.80-0.91x at
# 1,024-2,048), which a native bfloat16 decode kernel, not a later threshold, should settle.
DECODE_MIN_KEYS = 1024


@dataclass(frozen=True)
class Plan:
    """Every decision of one attention call, and why (``reason``, which `qkv.explain` prints)."""

    path: Path
    reason: str
    mask: MaskRoute = "none"
    scores: ScoreRoute = "none"
    weights: Source = "none"  # where the returned weights come from; "none" when not asked for
    lse: Source = "none"  # where the lse comes from when the call needs one (returned, or for tile weights)
    # the causal rule the dense formulas apply themselves when no mask tensor carries it: the
    # math path's causal mask, SDPA's is_causal (0) for recomputed weights / lse, and the
    # weights with gradient of the blocks / flex paths
    causal_offset: int | None = None
    layout: BlockLayout | None = None  # blocks / flex: the mask's tiles
    tiles: BlockPlan | None = None  # blocks: the engine's calls; flex: the calls that recompute lse / weights
    # blocks with score terms on the fused interval kernels (``scores="kernel"``): the bias as
    # the table of diagonals they read, built here once (None: no bias, or a traced plan, whose
    # table is built when the graph runs)
    diagonals: DiagonalTable | None = None
    # blocks / flex: layout and tiles are found when attention runs (`complete`: a predicate too
    # large to evaluate for a decision or an explanation); layout and tiles are None until then
    deferred: bool = False
    # the kernel that runs forward and the one autograd runs backward, by their names in
    # `qkv.backends.protocol.FORWARD_KERNELS` / `BACKWARD_KERNELS` ("none": no backward; such a
    # kernel is chosen only without a gradient). Decided here once; execution runs these. A
    # compiled kernel whose build or self-check fails at its first use falls back to its path's
    # portable kernel for that call (`qkv.backends.protocol`).
    forward_kernel: str = ""
    backward_kernel: str = ""
    # why the faster compiled kernel of this path does not run forward / backward: low-precision
    # inputs on the fused path (the short-sequence kernel) and the block engine without score
    # terms (the interval kernels); None where it runs or does not apply. `qkv.explain` prints it.
    forward_absent: str | None = None
    backward_absent: str | None = None
    # the compiled kernel ``forward_absent`` speaks of, where it is not the one the forward
    # kernel usually stands in for (`qkv.backends.protocol.kernel_words`): SDPA in place of
    # short_wide on a CPU without AMX
    forward_absent_kernel: str | None = None
    # the math path by query chunks (``forward_kernel="math_chunks"``): the query rows per chunk
    chunk_rows: int | None = None

    def __post_init__(self) -> None:
        if self.forward_kernel not in FORWARD_KERNELS or self.backward_kernel not in BACKWARD_KERNELS:
            raise AssertionError(f"a Plan names unknown kernels: {self.forward_kernel!r}, {self.backward_kernel!r}")


def _traced(problem: AttentionProblem) -> bool:
    """Whether torch.compile, torch.export or a functorch transform (vmap, grad) is tracing this
    call: the host cannot read the mask's values to plan tiles, and the compiled extensions are
    not traceable, so 'auto' keeps to the dense paths, whose graphs are pure tensor operations."""
    return private_torch.host_unreadable(problem.q, problem.k, problem.v)


def _compile_tracing(problem: AttentionProblem) -> bool:
    """Whether torch.compile or torch.export (not vmap, grad, or an ONNX export) is tracing this
    call: the block engine may then stand in the graph as its operators
    (`qkv.backends.blocks.ops`), which plan the tiles when the graph runs."""
    if not _traced(problem) or private_torch.onnx_exporting():
        return False
    return torch.compiler.is_compiling() or not private_torch.under_torch_func(problem.q)


def _traced_engine_refusal(problem: AttentionProblem, return_weights: bool) -> str | None:
    """Why the block engine's operators cannot take this traced problem, or None when they can."""
    if not _compile_tracing(problem):
        return "vmap, grad and ONNX exports trace the tile plan's host code, which they cannot"
    if problem.q.device.type != "cpu" or not flash_kernel_available() or switches.is_off("blocks"):
        return "the CPU block engine does not run here"
    if isinstance(problem.mask, torch.Tensor) or problem.dropout > 0.0:
        return "it takes no tensor mask and no dropout"
    if return_weights:
        return "its weights come from tiles planned on the host"
    if problem.terms.score_mod is not None:
        return "a score_mod is a Python function, which cannot enter its operator"
    if not encodable(problem.mask, problem.terms):
        return "a predicate mask is a Python function, which cannot enter its operator"
    return None


_TRACED_OPERATOR = (
    "traced: the CPU block engine runs as the qkv::blocks_forward operator (qkv::blocks_backward for "
    "gradients), which plans its tiles from the mask's values when the graph runs"
)


_TRACED_REFUSAL = (
    "plans its tiles from the mask's values on the host, which torch.compile, torch.export and "
    "vmap do not give while they trace; use backend='auto' there (the dense paths), or call it outside "
    "the traced region"
)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}; got {backend!r}")


def _causal_offset(problem: AttentionProblem) -> int | None:
    mask = problem.mask
    return mask.offset(problem.L, problem.S) if isinstance(mask, Causal) else None


def choose_path(problem: AttentionProblem, backend: str, return_weights: bool, return_lse: bool) -> Plan:
    """The one place where a path is chosen. Read top to bottom: the first rule that fires wins."""
    _check_backend(backend)
    mask = problem.mask
    causal_offset = _causal_offset(problem)
    # SDPA's is_causal is top-left; it equals ours when the offset is zero.
    sdpa_causal = causal_offset == 0
    terms = problem.terms
    scored = terms.softcap is not None or terms.score_mod is not None  # beyond an additive bias
    if backend == "math":
        return _math_plan(problem, "backend='math' was requested", return_weights, return_lse)
    if backend == "auto" and not torch.compiler.is_compiling() and private_torch.under_torch_func(problem.q):
        # SDPA's CPU kernels have no batching rule (vmap would loop over them, warning)
        return _math_plan(problem, "torch.func (vmap, grad, jacrev): the explicit formula, whose operators "
                          "all have batching rules", return_weights, return_lse)
    if backend in ("decode", "auto"):
        decode = decode_plan(problem, backend, return_weights)
        if decode is not None:
            return decode
    if problem.sinks is not None and backend in ("auto", "fused"):
        return _sinks_plan(problem, backend, return_weights, return_lse)
    if backend in ("blocks", "flex"):
        return _sparse_plan(problem, backend, f"backend={backend!r} was requested", return_weights, return_lse)  # type: ignore[arg-type]  # mypy does not narrow a Literal through `in`
    if scored and backend == "fused":
        raise ValueError(
            "backend='fused' (PyTorch's SDPA) takes no softcap or score_mod; use 'auto', 'math' or 'blocks'"
        )
    if backend == "auto" and terms.active and problem.dropout == 0.0:
        engine = _scored_engine(problem, return_weights, return_lse)
        if engine is not None:
            return engine
    if scored:
        return _math_plan(problem, f"SDPA cannot apply {terms.describe()}; the explicit formula can", return_weights, return_lse)
    if return_weights and problem.dropout > 0.0:
        if backend == "fused":
            raise ValueError(
                "return_weights=True with dropout > 0 needs the weights that produced the output, "
                "which only backend='math' (or 'auto') can return"
            )
        return _math_plan(problem, "the weights after dropout must be the ones that produced the output", return_weights, return_lse)
    if return_lse and problem.dropout > 0.0:
        if backend == "fused":
            raise ValueError("return_lse=True with dropout > 0 is only available with backend='math' (or 'auto')")
        return _math_plan(problem, "the fused kernel returns no log-sum-exp under dropout", return_weights, return_lse)
    if backend == "auto" and _wide_float_mask_with_grad(problem):
        return _math_plan(
            problem,
            f"the float mask's values span more than {_FLASH_GRAD_MAX_MASK_SPAN:g} and gradients are needed: "
            "PyTorch's CPU flash backward is less accurate than the tolerance rule allows there",
            return_weights,
            return_lse,
        )
    engine_refusal = None
    if backend == "auto" and isinstance(mask, Mask) and not sdpa_causal and problem.dropout == 0.0:
        sparse = _sparse_if_it_wins(problem, return_weights, return_lse)
        if isinstance(sparse, Plan):
            return sparse
        engine_refusal = sparse
    if backend == "auto" and (mask is None or sdpa_causal):
        kernel = _dense_bf16_kernel(problem, return_weights, return_lse)
        if kernel is not None:
            return kernel
    return _fused_plan(problem, backend, return_weights, return_lse, engine_refusal)


def _sinks_plan(problem: AttentionProblem, backend: str, return_weights: bool, return_lse: bool) -> Plan:
    """Attention sinks with 'auto' (or 'fused', which raises). SDPA has no sink logit and returns
    no differentiable lse to fold one into; the tile paths fold it into each row's merged lse
    (`qkv.backends.sinks`), the math path adds it to the softmax denominator."""
    if backend == "fused":
        raise ValueError(
            "sinks: backend='fused' (PyTorch's SDPA) has no attention-sink logit; use 'auto', 'math', 'blocks' or 'flex'"
        )
    why = "sinks: SDPA has no attention-sink logit"
    mask, terms = problem.mask, problem.terms
    if isinstance(mask, torch.Tensor):
        return _math_plan(problem, f"{why} and the tile paths take no tensor mask; the math path applies them", return_weights, return_lse)
    if problem.dropout > 0.0:
        return _math_plan(problem, f"{why} and the tile paths have no dropout; the math path applies them", return_weights, return_lse)
    if terms.score_mod is not None and needs_grad(problem) and closes_over_grad(terms.score_mod):
        return _math_plan(problem, f"{why}; the score_mod reads tensors that require grad, which only the math path differentiates", return_weights, return_lse)
    if problem.L * problem.S < _SPARSE_MIN_PAIRS:
        return _math_plan(problem, f"{why}; below {_SPARSE_MIN_PAIRS:,} pairs per head the math path applies them faster than tiles", return_weights, return_lse)
    if private_torch.onnx_exporting():
        return _math_plan(problem, f"{why}; ONNX has no operator for the tile paths' kernels, the math path applies them", return_weights, return_lse)
    if _traced(problem):
        if _traced_engine_refusal(problem, return_weights) is None:
            return _sparse_plan(problem, "blocks", f"{why}; {_TRACED_OPERATOR}; it folds each row's sink into the merged lse",
                                return_weights, return_lse, deferred=True)
        return _math_plan(problem, f"{why}; while tracing the tile paths cannot plan from the mask, the math path applies them", return_weights, return_lse)
    device = problem.q.device
    what = "no mask" if mask is None else mask.describe()
    if device.type == "cuda" and flex_available() and flex_suits(problem.q.dtype, (problem.E, problem.Ev)):
        reason = f"{why}; FlexAttention with qkv's BlockMask runs {what} and the sink is folded into its lse"
        return _sparse_plan(problem, "flex", reason, return_weights, return_lse)
    if device.type != "cpu" or not flash_kernel_available():
        return _math_plan(problem, f"{why}; the math path applies them", return_weights, return_lse)
    engine = "the CPU block engine"
    if _too_large_to_evaluate(problem):
        return _sparse_plan(problem, "blocks", f"{why}; {_deferred_reason(problem, engine)}", return_weights, return_lse, deferred=True)
    layout, tiles, visited = _engine_tiles(problem)
    reason = (
        f"{why}; {engine} computes {visited:.1%} of the score matrix ({what}) and folds each row's "
        "sink into its merged lse, never an L x S tensor"
    )
    return _sparse_plan(problem, "blocks", reason, return_weights, return_lse, layout, tiles)


def decode_plan(problem: AttentionProblem, backend: str, return_weights: bool) -> Plan | None:
    """The decode kernel (`qkv.backends.decode`) for a few queries against many keys. With
    ``backend="decode"`` it raises a ValueError naming what it cannot take; with "auto" it
    returns None unless the problem is a decode step on CPU (L <= `decode.MAX_QUERIES`,
    S >= `DECODE_MIN_KEYS`)."""
    L, S = problem.L, problem.S
    refusal = decode_reason(problem)
    if refusal is None and return_weights:
        refusal = "it returns no weights (return_weights=True)"
    if _traced(problem):
        if backend == "decode":
            raise ValueError(f"backend='decode' splits the keys by a plan made on the host; it {_TRACED_REFUSAL}")
        return None
    if backend == "decode":
        if refusal is not None:
            raise ValueError(f"backend='decode': {refusal}; use 'auto'")
        return _decode_plan(problem, "backend='decode' was requested")
    if refusal is not None or problem.q.device.type != "cpu" or S < DECODE_MIN_KEYS:
        return None
    reason = (
        f"a decode step ({L} queries <= {decode.MAX_QUERIES}, {S:,} keys >= {DECODE_MIN_KEYS:,}) on CPU: "
        "the decode kernel splits the keys into chunks across threads, reads each K/V chunk once for "
        "all query heads of its group and merges the chunks by lse"
    )
    return _decode_plan(problem, reason)


def _decode_plan(problem: AttentionProblem, reason: str) -> Plan:
    """The decode path's Plan: the compiled kernel forward where it runs (it has no backward:
    it runs only without a gradient), else the PyTorch ops both ways."""
    kernel, absent = decode_kernel(problem)
    return Plan("decode", reason, mask="chunks" if problem.mask is not None else "none",
                scores="chunks" if problem.terms.active else "none", lse="kernel", forward_kernel=kernel,
                backward_kernel="none" if kernel == "native_decode" else "decode", forward_absent=absent)


def decode_widens_itself(
    q: torch.Tensor, k: torch.Tensor, mask: object, backend: str, *, scored: bool, dropout: float, return_weights: bool
) -> bool:
    """Whether a call in an emulated low-precision dtype will take the decode path, which widens
    its keys and values to float32 one wave of chunks at a time: then `qkv.attention` does not
    copy the whole cache to float32 first. The shape-level conditions of `decode_plan` (``scored``:
    a score_mod is given); the checks that need the validated problem stay there."""
    if backend not in ("auto", "decode") or q.device.type != "cpu" or q.dim() < 2 or k.dim() < 2:
        return False
    if switches.is_off("decode"):
        return False
    if backend == "auto" and k.shape[-2] < DECODE_MIN_KEYS:
        return False
    return (
        q.shape[-2] <= decode.MAX_QUERIES and decode.supports_mask(mask) and not scored
        and dropout == 0.0 and not return_weights
    )  # fmt: skip


def _dense_bf16_kernel(problem: AttentionProblem, return_weights: bool, return_lse: bool) -> Plan | None:
    """'auto' for dense bf16 on CPU (no mask, or causal with L == S): the block engine with its
    fused bf16 interval kernel where that beats SDPA, else None. On the ``amx`` tier for
    inference (`_DENSE_BF16_KERNEL_MAX_HEAD_DIM`); with AVX-512 BF16 and no AMX for training
    too (`_DENSE_BF16_DOT_MAX_HEAD_DIM`)."""
    q = problem.q
    if q.dtype != torch.bfloat16 or problem.dropout > 0.0 or return_weights or problem.terms.active:
        return None
    # the shape's rules first (cheap), then whether the kernels can run
    amx, trains = cpu_features().amx, needs_grad(problem)
    if trains and amx:
        return None  # on AMX, SDPA's flash backward is faster than the engine's
    max_dim = _DENSE_BF16_KERNEL_MAX_HEAD_DIM if amx else _DENSE_BF16_DOT_MAX_HEAD_DIM
    min_queries = _DENSE_BF16_KERNEL_MIN_QUERIES if amx else _DENSE_BF16_DOT_MIN_QUERIES
    if max(problem.E, problem.Ev) > max_dim or min_queries > problem.L:
        return None
    if amx and problem.mask is None and problem.S <= short_bf16.MAX_KEYS:
        return None  # the short-sequence kernel's problems (`short_kernel_reason`)
    if not flash_kernel_available() or switches.is_off("blocks") or interval_bf16.unavailable_reason(q.dtype, q.device) is not None:
        return None
    if trains and interval_bf16_backward.unavailable_reason(q.dtype, q.device) is not None:
        return None
    if private_torch.onnx_exporting():
        return None  # an ONNX export (either exporter) keeps to the dense paths
    traced = _traced(problem)
    if traced and _traced_engine_refusal(problem, return_weights) is not None:
        return None
    what = "no mask" if problem.mask is None else "causal (L == S)"
    gradient = "with or without a gradient" if not amx else "no gradient"
    reason = (
        f"dense bfloat16 on CPU with {what}, head dims <= {max_dim}, at least {min_queries} queries and "
        f"{gradient}: the block engine's {interval_bf16.KERNEL_NAME} beats PyTorch's CPU flash kernel here"
    )
    if traced:
        reason += f"; {_TRACED_OPERATOR}"
    return _sparse_plan(problem, "blocks", reason, False, return_lse, deferred=traced)


def _fused_plan(problem: AttentionProblem, backend: str, return_weights: bool, return_lse: bool,
                engine_refusal: str | None = None) -> Plan:
    """SDPA: the mask as is_causal, a dense tensor or nothing; a bias joins it as one float mask.
    ``engine_refusal``: why 'auto' did not send this structured mask to the block engine, said
    in the reason when there is one."""
    mask, S = problem.mask, problem.S
    causal_offset = _causal_offset(problem)
    bias = problem.terms.bias
    reason = "backend='fused' was requested" if backend == "fused" else "PyTorch's SDPA applies"
    route: MaskRoute = "none" if mask is None else "dense"
    if bias is not None:
        # the mask joins the rendered bias: SDPA gets one float tensor
        masked = "" if mask is None else f" with {_mask_name(mask)} as -inf"
        reason += f"; {bias.describe()} is passed as a dense float mask{masked}"
        if causal_offset is not None and causal_offset >= S - 1:
            route = "none"
    elif causal_offset == 0:
        route = "is_causal"
        reason += "; causal runs as SDPA is_causal (L == S or top-left alignment), no mask materialized"
    elif causal_offset is not None and causal_offset >= S - 1:
        # every query sees every key (a one-token decoding step over its cache): no mask is built
        route = "none"
        reason += "; the causal mask hides no key here (every query sees the whole cache), so none is passed"
    elif causal_offset is not None:
        reason += "; bottom-right causal with L != S is passed as a dense bool mask"
    elif isinstance(mask, Mask):
        reason += f"; {mask.describe()} is passed as a dense bool mask"
        if engine_refusal is not None:
            reason += f" ({engine_refusal})"
    short_reason = short_kernel_reason(problem, backend, route, return_weights, return_lse)
    q = problem.q
    short = short_kernel(q)
    if short_reason is None:
        what = "no mask" if route == "none" else "a key-padding mask"
        if short == "short_bf16":
            why = "SDPA's CPU kernel spends most of such a call on per-head set-up"
        elif compute_dtype(q.dtype, q.device) != q.dtype:
            why = ("this CPU only emulates bf16 products, and the kernel reads the bf16 inputs themselves where the "
                   "portable route copies them to float32 for SDPA")  # fmt: skip
        else:
            why = "this CPU has no AMX, and the kernel's float32 products beat SDPA's in bf16 and in float32"
        reason = (
            f"the {_SHORT_KERNELS[short].KERNEL_NAME} applies: bf16 on CPU, {S} keys (at most {short_bf16.MAX_KEYS}), "
            f"{what}, no gradient; {why}"
        )
    lse: Source = "none"
    if return_weights or return_lse:
        # the weights are recomputed by the dense formula, and the lse with them; alone, the lse
        # comes from PyTorch's CPU flash kernel, except for a learned float mask, whose gradient
        # SDPA gives and a differentiable recomputed lse
        kernel = not return_weights and not _learned_float_mask(problem) and fused_lse_available(problem.q)
        lse = "kernel" if kernel else "dense"
    backward = "none" if short_reason is None else "sdpa"
    if backward == "sdpa" and _wide_backward(problem):
        backward = "sdpa_wide"
        reason += (
            f"; its backward runs on float32 copies: PyTorch's bf16 CPU flash backward is slower at head dims up to "
            f"{WIDE_BACKWARD_MAX_HEAD_DIM} on this CPU"
        )
    absent, absent_kernel = _short_absence(q, short, short_reason)
    return Plan(
        "fused",
        reason,
        mask=route,
        scores="dense_mask" if bias is not None else "none",
        weights="dense" if return_weights else "none",
        lse=lse,
        causal_offset=0 if route == "is_causal" else None,
        forward_kernel=short if short_reason is None else "sdpa",
        backward_kernel=backward,
        forward_absent=absent,
        forward_absent_kernel=absent_kernel,
    )


def _short_absence(q: torch.Tensor, short: str, short_reason: str | None) -> tuple[str | None, str | None]:
    """What a fused plan's kernel line says of the short-sequence kernels, for bf16 on CPU (where
    they are candidates): (``Plan.forward_absent``, ``Plan.forward_absent_kernel``). Why the
    candidate ``short`` does not run where SDPA stands in for it (named where it is not the AMX
    one), or, where short_wide runs, why the AMX one does not."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return None, None
    if short_reason is not None:
        return short_reason, None if short == "short_bf16" else short
    if short == "short_wide":
        return short_bf16.unavailable_reason(q.dtype, q.device), None
    return None, None


def _wide_backward(problem: AttentionProblem) -> bool:
    """Whether the fused path's backward runs on float32 copies of bf16 inputs
    (`qkv.backends.dense.wide_backward_wins`): calls that need a gradient, without dropout or
    a float mask or bias that learns (that backward gives q, k, v theirs only), eager or under
    torch.compile (its autograd Function traces whole). Exports keep SDPA (ONNX knows it, not
    the CPU flash operators), and so does vmap (those operators have no batching rule)."""
    q = problem.q
    compiling = torch.compiler.is_compiling() and not private_torch.is_exporting()
    return (
        needs_grad(problem) and problem.dropout == 0.0 and not _learned_float_mask(problem)
        and (compiling or not private_torch.host_unreadable(q, problem.k, problem.v))
        and not switches.is_off("sdpa_wide") and wide_backward_wins(q, problem.v, cpu_features().tier)
    )  # fmt: skip


# the two short-sequence kernels by their names in a Plan (`short_kernel`)
_SHORT_KERNELS = {"short_bf16": short_bf16, "short_wide": short_wide}


def short_kernel(q: torch.Tensor) -> str:
    """The short-sequence kernel for bf16 inputs like ``q``: "short_bf16" (AMX tiles) on the
    ``amx`` tier, else "short_wide" (float32 products, `qkv.native.short_wide`): where this CPU
    emulates bf16 products, and where it has AVX-512 BF16 but no AMX too, as there it beats
    PyTorch's SDPA in both dtypes (B=32 H=12 L=S=128 E=32 on an AMD EPYC of tier avx512, 2
    threads: 3.6 ms against SDPA's 7.2 in bf16 and 5.7 in float32)."""
    return "short_bf16" if cpu_features().amx else "short_wide"


def short_kernel_reason(
    problem: AttentionProblem, backend: str, route: MaskRoute, return_weights: bool, return_lse: bool
) -> str | None:
    """Why the short-sequence bf16 kernel (`short_kernel`) does not replace SDPA on a fused
    plan with this mask route, or None when it does. Its cases: ``backend="auto"``, bf16 on
    CPU, at most `short_bf16.MAX_KEYS` keys, no mask or a bool key-padding mask (varying over
    batch rows and keys only), no score terms, dropout, gradients, weights or lse.
    `short_widens_itself` asks the same of a call's arguments."""
    if _traced(problem):
        return "a compiled extension, which torch.compile, torch.export and vmap cannot trace"
    q = problem.q
    reason = _SHORT_KERNELS[short_kernel(q)].unavailable_reason(q.dtype, q.device) or _short_shape_reason(
        backend, problem.S, problem.N * problem.G
    )
    if reason is not None:
        return reason
    if problem.terms.active:
        return "it applies no score terms"
    if problem.dropout > 0.0:
        return "it has no dropout"
    if needs_grad(problem):
        return "gradients are needed and it has no backward"
    if return_weights or return_lse:
        return "it returns neither weights nor lse"
    if route == "none":
        return None
    if route == "dense" and _key_padding(problem.mask, problem.S) is not None:
        return None
    return "the mask is not a bool key-padding mask (one that varies over batch rows and keys only)"


def _short_shape_reason(backend: str, S: int, tasks: int) -> str | None:
    """The short-sequence kernels' conditions on the backend, the keys and the (batch row,
    key/value head) ``tasks``, or None when they hold."""
    if backend != "auto":
        return f"backend={backend!r} asks for PyTorch's SDPA"
    if S > short_bf16.MAX_KEYS:
        return f"{S} keys, more than its {short_bf16.MAX_KEYS} (qkv.native.short_bf16.MAX_KEYS)"
    threads = torch.get_num_threads()
    if tasks < threads:
        return f"{tasks} (batch row, key/value head) tasks for {threads} threads; SDPA splits the queries too"
    return None


def short_widens_itself(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, backend: str, *, scored: bool, dropout: float,
    outputs: bool,
) -> bool:
    """Whether a bf16 call will run on the short-sequence kernel with float32 products
    (`short_kernel` "short_wide"), which reads the bf16 inputs itself: then `qkv.attention`
    does not copy them to float32 first where this CPU emulates bf16 products. ``scored``: a bias,
    softcap, score_mod or sinks is given; ``outputs``: weights or lse are asked for. The
    conditions of `short_kernel_reason` on the call's arguments (q, k, v already checked to
    share a dtype), kept on the safe side: every call it says yes to is planned on that kernel
    (a call left in bf16 on another path would run on emulated products); a few it says no to
    would be too (masks of fewer dims than q), and are widened."""
    if q.device.type != "cpu" or q.dim() < 3 or k.dim() != q.dim() or short_kernel(q) != "short_wide":
        return False
    if private_torch.host_unreadable(q, k, v):
        return False  # traced: the compiled kernel is not (`short_kernel_reason`), the call is widened
    if scored or dropout > 0.0 or outputs or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False
    if short_wide.unavailable_reason(q.dtype, q.device) is not None:
        return False
    tasks = q.shape[:-3].numel() * k.shape[-3]  # (batch row, key/value head)
    if _short_shape_reason(backend, k.shape[-2], tasks) is not None:
        return False
    # no mask, or one that varies over batch rows and keys only ((N | 1, 1, 1, S) as a tensor);
    # a key_padding object from _SPARSE_MIN_PAIRS pairs up may go to the block engine instead
    # (`_sparse_if_it_wins`), so it is taken only below that
    small = q.shape[-2] * k.shape[-2] < _SPARSE_MIN_PAIRS
    return mask is None or (isinstance(mask, KeyPadding) and small) or (
        isinstance(mask, torch.Tensor) and mask.dim() == q.dim() == 4 and _key_padding(mask, k.shape[-2]) is not None
    )


def _key_padding(mask: torch.Tensor | Mask | None, S: int) -> torch.Tensor | None:
    """A `qkv.masks.key_padding` mask, or a bool tensor mask (N | 1, H | 1, L, S) that varies
    over batch rows and keys only, as (N | 1, S); None for any other mask."""
    if isinstance(mask, KeyPadding):
        if mask.valid is not None:
            return mask.valid  # (N | 1, S)
        assert mask.lengths is not None  # key_padding() sets one of them
        return torch.arange(S, device=mask.lengths.device).view(1, S) < mask.lengths.view(-1, 1)  # (N | 1, S)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        return None
    narrow = compact(mask)  # (N | 1, 1, 1, S) for a key-padding mask
    if narrow.shape[1] != 1 or narrow.shape[2] != 1:
        return None
    return narrow[:, 0, 0, :]  # (N | 1, S)


def key_padding(problem: AttentionProblem) -> torch.Tensor | None:
    """The key-padding mask (N | 1, S) of a plan whose forward kernel is a short-sequence one
    ("short_bf16", "short_wide"), None without a mask."""
    return _key_padding(problem.mask, problem.S)


def _math_plan(problem: AttentionProblem, reason: str, return_weights: bool, return_lse: bool) -> Plan:
    """The explicit formula: causal by offset, other masks dense; it returns weights and lse
    itself. Under torch.compile, by query chunks where `_query_chunks` says so."""
    causal_offset = _causal_offset(problem)
    route: MaskRoute = "causal_offset" if causal_offset is not None else "none" if problem.mask is None else "dense"
    rows = _query_chunks(problem, return_weights)
    kernel = "math"
    if rows is not None:
        kernel = "math_chunks"
        route = "chunks" if route == "dense" else route
        reason = (
            f"{reason}; traced by torch.compile: by chunks of {rows} query rows, each on the keys the mask lets "
            "them see and recomputed in the backward, never an L x S tensor"
        )
    return Plan(
        "math",
        reason,
        mask=route,
        scores="formula" if problem.terms.active else "none",
        weights="kernel" if return_weights else "none",
        lse="kernel",
        causal_offset=causal_offset,
        forward_kernel=kernel,
        backward_kernel=kernel,
        chunk_rows=rows,
    )


def _query_chunks(problem: AttentionProblem, return_weights: bool) -> int | None:
    """The query rows per chunk when the math path runs by chunks (`qkv.backends.query_chunks`),
    or None for the whole formula. By chunks: while torch.compile traces (not an export, whose
    graphs keep PyTorch's operators only), from `_SPARSE_MIN_PAIRS` pairs per head, with two
    chunks or more, and no weights or dropout (both L x S)."""
    if not torch.compiler.is_compiling() or private_torch.is_exporting():
        return None
    if return_weights or problem.dropout > 0.0 or switches.is_off("math_chunks"):
        return None
    if problem.L * problem.S < _SPARSE_MIN_PAIRS:
        return None
    rows = chunk_rows(problem.N, problem.H, problem.L, problem.S, problem.q.dtype)
    return rows if rows < problem.L else None


def _learned_float_mask(problem: AttentionProblem) -> bool:
    """Whether the float mask SDPA gets will require grad: a float mask or a bias tensor that does."""
    mask = problem.mask
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        return True
    bias = problem.terms.bias
    return bias is not None and torch.is_grad_enabled() and any(t.requires_grad for t in bias.tensors())


def _mask_name(mask: torch.Tensor | Mask) -> str:
    if isinstance(mask, Mask):
        return mask.describe()
    return f"a {str(mask.dtype).removeprefix('torch.')} tensor mask"


def _wide_float_mask_with_grad(problem: AttentionProblem) -> bool:
    """A float32 problem on CPU that needs gradients, with a float mask spanning a wide range."""
    mask = problem.mask
    if not (isinstance(mask, torch.Tensor) and mask.is_floating_point()):
        return False
    grad = needs_grad(problem) or (torch.is_grad_enabled() and mask.requires_grad)
    if problem.q.dtype != torch.float32 or problem.q.device.type != "cpu" or not grad:
        return False
    if _traced(problem):
        return True  # the span is not known while tracing: the math path is accurate for every span
    with torch.no_grad():
        values = compact(mask)
        finite = values.masked_fill(torch.isinf(values), float("nan"))
        span = float(finite.nan_to_num(nan=float("-inf")).amax()) - float(finite.nan_to_num(nan=float("inf")).amin())
    return span > _FLASH_GRAD_MAX_MASK_SPAN


def needs_grad(problem: AttentionProblem) -> bool:
    """Whether autograd will ask for a backward pass through this call."""
    inputs = (problem.q, problem.k, problem.v, *problem.terms.tensors())
    if problem.sinks is not None:
        inputs = (*inputs, problem.sinks)
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def _too_large_to_evaluate(problem: AttentionProblem) -> bool:
    """Whether the mask's layout would evaluate more than `POINTWISE_BUDGET` points one by one
    (a large `predicate`): then no decision and no explanation waits for it."""
    mask = problem.mask
    return isinstance(mask, Mask) and mask.evaluated_points(problem.L, problem.S) > POINTWISE_BUDGET


def _deferred_reason(problem: AttentionProblem, engine: str) -> str:
    mask = problem.mask
    assert isinstance(mask, Mask)
    points = mask.evaluated_points(problem.L, problem.S)
    return (
        f"{mask.describe()} is evaluated point by point and has {points:,} points, more than "
        f"{POINTWISE_BUDGET:,}: it is neither rendered as a dense mask nor evaluated to choose a path; "
        f"{engine} finds its tiles when attention runs (one block row at a time) and skips the empty ones"
    )


def complete(problem: AttentionProblem, plan: Plan) -> Plan:
    """A deferred plan with its layout and tiles, found now (attention is about to run)."""
    if not plan.deferred:
        return plan
    if plan.path == "blocks":
        layout = plan.layout if plan.layout is not None else _layout(problem, BLOCKS.block_q, BLOCKS.block_k)
        tiles = plan.tiles if plan.tiles is not None else _block_plan(problem, BLOCKS, layout)
    else:
        layout = plan.layout if plan.layout is not None else _layout(problem, FLEX_BLOCK, FLEX_BLOCK)
        tiles = None
        if plan.lse == "tiles" or plan.weights == "tiles":
            tiles = _block_plan(problem, BlockConfig(block_q=layout.block_q, block_k=layout.block_k), layout)
    return replace(plan, layout=layout, tiles=tiles, deferred=False)


def _layout(problem: AttentionProblem, block_q: int, block_k: int) -> BlockLayout:
    """The mask's tiles; no mask is one FULL tile grid."""
    mask = problem.mask
    if isinstance(mask, Mask):
        if problem.q.device.type == "cpu":
            return kept_layout(mask, problem.L, problem.S, block_q, block_k)  # the same for the same spec and size
        return mask.layout(problem.L, problem.S, block_q, block_k, device=problem.q.device)
    n_q, n_k = -(-problem.L // block_q), -(-problem.S // block_k)
    states = torch.full((1, 1, n_q, n_k), FULL, dtype=torch.uint8)
    return BlockLayout(states, problem.L, problem.S, block_q, block_k, name="no mask")


def _block_plan(problem: AttentionProblem, config: BlockConfig, layout: BlockLayout) -> BlockPlan:
    """The block engine's calls: from exact per-query key intervals when the mask has them,
    from the block layout otherwise."""
    mask = problem.mask
    L, S, device = problem.L, problem.S, problem.q.device
    # without a backward pass to come, calls can be larger (fewer kernel launches)
    sizes = BlockSizes(
        N=problem.N, H=problem.H, L=L, S=S, Ep=max(problem.E, problem.Ev), itemsize=problem.q.element_size(),
        mask_heads=mask_heads(problem), need_grad=needs_grad(problem), score_terms=problem.terms.active,
    )
    if device.type == "cpu" and config == BLOCKS:
        assert mask is None or isinstance(mask, Mask)
        kept = kept_plan(mask, sizes)  # planned once per spec and size for a mask without tensors
        if kept is not None:
            return kept
    intervals: tuple[torch.Tensor, torch.Tensor] | None
    if mask is None:
        intervals = (torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1, dtype=torch.long))
    else:
        assert isinstance(mask, Mask)
        intervals = mask.row_intervals(L, S, device)
    if intervals is not None:
        return plan_intervals(*intervals, sizes, config)
    return plan_layout(layout, sizes, config)


def mask_heads(problem: AttentionProblem) -> int:
    """Heads the mask's tiles carry: 1 unless the mask varies over heads. With score terms the
    tiles carry every head, and the engine's own kernel holds scores and probabilities too."""
    terms = problem.terms
    if terms.softcap is not None or terms.score_mod is not None:
        return 3 * problem.H
    if terms.bias is not None:
        return problem.H
    mask = problem.mask
    return mask.heads if isinstance(mask, Mask) and mask.heads else 1


def _sparse_plan(
    problem: AttentionProblem,
    path: Literal["blocks", "flex"],
    reason: str,
    return_weights: bool,
    return_lse: bool,
    layout: BlockLayout | None = None,
    tiles: BlockPlan | None = None,
    deferred: bool = False,
) -> Plan:
    """Plan for the block engine (CPU) or FlexAttention; raises when they cannot take the problem.
    ``layout`` / ``tiles``: the mask's tiles and the engine's calls when the caller already made
    them; ``deferred``: the caller decided not to evaluate the mask (``reason`` says why)."""
    mask = problem.mask
    if isinstance(mask, torch.Tensor):
        raise ValueError(
            f"backend={path!r} takes a qkv.masks object or None, got a {mask.dtype} tensor mask; "
            "wrap a bool tensor with qkv.masks.dense(tensor)"
        )
    if problem.dropout > 0.0:
        raise ValueError(f"backend={path!r} has no dropout (got dropout={problem.dropout}); use 'fused' or 'math'")
    terms = problem.terms
    grad = needs_grad(problem)
    if terms.score_mod is not None and grad and closes_over_grad(terms.score_mod):
        raise ValueError(
            f"backend={path!r} differentiates q, k, v and the qkv.bias tensors only, and this score_mod "
            "reads tensors that require grad; use backend='math', or pass them as a qkv.bias"
        )
    device = problem.q.device
    if switches.is_off(path):
        raise ValueError(f"backend={path!r}: {switches.off_reason(path)}")
    if private_torch.onnx_exporting():  # either exporter: the TorchScript one traces readable tensors
        raise ValueError(
            f"backend={path!r} cannot be exported to ONNX: ONNX has no operator for qkv's {path} kernels; "
            "use backend='auto', which exports the dense paths"
        )
    if _traced(problem):
        refusal = _traced_engine_refusal(problem, return_weights) if path == "blocks" else None
        if path != "blocks" or not _compile_tracing(problem):
            raise ValueError(f"backend={path!r} {_TRACED_REFUSAL}")
        if refusal is not None:
            raise ValueError(f"backend='blocks' while torch.compile / torch.export trace: {refusal}; use backend='auto'")
        if not deferred:
            reason, deferred = f"{reason}; {_TRACED_OPERATOR}", True
    if path == "blocks":
        if device.type != "cpu":
            raise ValueError(f"backend='blocks' is the CPU block engine, the inputs are on {device}; use 'flex' or 'auto'")
        if not flash_kernel_available():
            raise ValueError("backend='blocks' needs PyTorch's CPU flash-attention kernel (PyTorch >= 2.3)")
    else:
        if not flex_available():
            raise ValueError(f"backend='flex': {FLEX_NEEDS}; use backend='blocks' or 'auto'")
        if device.type == "cpu" and grad:
            raise ValueError("FlexAttention has no backward pass on CPU; use backend='blocks' (or 'auto') for gradients")
        kernel_refusal = cpu_kernel_reason(None, tested_release=False) if device.type == "cpu" else None
        if kernel_refusal is not None:  # the dtype the kernel takes is checked where it runs (`flex._cpu_kernel`)
            raise ValueError(f"backend='flex' on the CPU runs Inductor's FlexAttention kernel: {kernel_refusal}; use backend='blocks' or 'auto'")
    if layout is None and not deferred and _too_large_to_evaluate(problem):
        engine = "the CPU block engine" if path == "blocks" else "FlexAttention"
        reason, deferred = f"{reason}; {_deferred_reason(problem, engine)}", True
    # weights that a loss will differentiate come from the dense formula (they are L x S
    # anyway), the others from the tiles
    weights: Source = "none" if not return_weights else "dense" if grad else "tiles"
    if path == "blocks":
        lse: Source = "kernel"  # the engine always returns it
        scores: ScoreRoute = "tiles" if terms.active else "none"
    else:
        # compiled FlexAttention returns an lse off CPU only; on CPU the tiles recompute it when
        # needed, and sinks always need it (qkv.backends.sinks folds them into it)
        wanted = return_lse or weights == "tiles" or problem.sinks is not None
        lse = "kernel" if device.type != "cpu" else "tiles" if wanted else "none"
        scores = "score_mod" if terms.active else "none"
    plan = Plan(
        path, reason, mask="tiles", scores=scores, weights=weights, lse=lse,
        causal_offset=_causal_offset(problem) if weights == "dense" else None,
        layout=layout, tiles=tiles, deferred=True,
        # the engine's kernels are chosen below, once its tiles are known
        forward_kernel="flex" if path == "flex" else "cpu_flash_tiles",
        backward_kernel="flex" if path == "flex" else "engine_per_call",
    )
    # the layout and tiles not given are found now, unless the mask is too large to evaluate
    plan = plan if deferred else complete(problem, plan)
    return plan if path == "flex" else _engine_kernels(problem, plan)


def _engine_kernels(problem: AttentionProblem, plan: Plan) -> Plan:
    """A blocks plan with its forward and backward kernels: the fused bf16 interval kernels where
    they can run (the plan knows one key interval per query: a deferred plan's tiles are not
    known, so it does not) and can apply the problem's score terms, if any (a softcap, a bias
    by diagonal without a gradient of its own: `diagonals.fused_terms_reason`; with gradients
    the backward kernel must run too); else, with score terms, the engine's scored kernels,
    and without, PyTorch's CPU flash kernel per tile and the engine's backward per call."""
    terms = problem.terms
    q = problem.q
    # while tracing the plan is made when the graph runs: the interval kernels are named, and
    # the operator falls back to the portable ones if the mask's data gives no intervals
    has_intervals = plan.tiles.intervals is not None if plan.tiles is not None else _compile_tracing(problem)
    forward = interval_bf16.unavailable_reason(q.dtype, q.device, has_intervals)
    backward = interval_bf16_backward.unavailable_reason(q.dtype, q.device, has_intervals)
    low = q.dtype in (torch.bfloat16, torch.float16)  # where the kernels are candidates, said
    if terms.active:
        trains = needs_grad(problem)
        why = forward or fused_terms_reason(terms, trains) or (backward if trains else None)
        diagonals = None
        if why is None and terms.bias is not None and plan.tiles is not None and plan.tiles.intervals is not None:
            diagonals = diagonal_table(terms, problem.H, plan.tiles.intervals)
            if diagonals is None:
                why = TABLE_REFUSAL
        if why is None:  # bf16 products and the terms in one pass, where the tile kernels compute in float32
            return replace(
                plan, scores="kernel", diagonals=diagonals, forward_kernel="interval_bf16",
                backward_kernel="interval_bf16_backward" if backward is None else "scored_per_call",
            )  # fmt: skip
        scored = terms.softcap is not None or terms.score_mod is not None
        return replace(
            plan, forward_kernel="score_tiles" if scored else "bias_tiles", backward_kernel="scored_per_call",
            forward_absent=why if low else None, forward_absent_kernel="interval_bf16",
        )  # fmt: skip
    return replace(
        plan,
        forward_kernel="interval_bf16" if forward is None else "cpu_flash_tiles",
        backward_kernel="interval_bf16_backward" if backward is None else "engine_per_call",
        forward_absent=forward if low else None,
        backward_absent=backward if low else None,
    )


def _scored_engine(problem: AttentionProblem, return_weights: bool, return_lse: bool) -> Plan | None:
    """'auto' with score terms on CPU: the block engine whenever it can take the problem and it
    is large enough. Its alternatives materialize L x S tensors: the math path its scores and
    weights, SDPA a rendered bias (float mask)."""
    terms = problem.terms
    mask = problem.mask
    if isinstance(mask, torch.Tensor) or problem.L * problem.S < _SPARSE_MIN_PAIRS or private_torch.onnx_exporting():
        return None  # an ONNX export (either exporter) keeps to the dense paths
    if _traced(problem):
        if _traced_engine_refusal(problem, return_weights) is not None:
            return _traced_flex(problem, return_weights, return_lse)
        what = "no mask" if mask is None else mask.describe()
        reason = f"{terms.describe()} with {what}: the CPU block engine applies them tile by tile; {_TRACED_OPERATOR}"
        return _sparse_plan(problem, "blocks", reason, return_weights, return_lse, deferred=True)
    if terms.score_mod is not None and needs_grad(problem) and closes_over_grad(terms.score_mod):
        return None
    device = problem.q.device
    what = "no mask" if mask is None else mask.describe()
    if device.type == "cuda" and _flex_suits(problem):
        reason = f"{terms.describe()} with {what}: FlexAttention applies them as its score_mod"
        return _sparse_plan(problem, "flex", reason, return_weights, return_lse)
    if device.type != "cpu" or not flash_kernel_available() or switches.is_off("blocks"):
        return None
    if _too_large_to_evaluate(problem):
        reason = f"{terms.describe()}: {_deferred_reason(problem, 'the CPU block engine')}"
        return _sparse_plan(problem, "blocks", reason, return_weights, return_lse, deferred=True)
    layout, tiles, visited = _engine_tiles(problem)
    reason = (
        f"{terms.describe()} with {what}: the CPU block engine computes {visited:.1%} of the score matrix "
        "with the terms applied block by block, never an L x S tensor"
    )
    return _sparse_plan(problem, "blocks", reason, return_weights, return_lse, layout, tiles)


def _engine_tiles(problem: AttentionProblem) -> tuple[BlockLayout, BlockPlan, float]:
    """The block engine's layout and tile plan for ``problem``, and the share of the score
    matrix its tiles compute (over all batch rows)."""
    layout = _layout(problem, BLOCKS.block_q, BLOCKS.block_k)
    tiles = _block_plan(problem, BLOCKS, layout)
    return layout, tiles, tiles.computed_pairs() / (problem.N * problem.L * problem.S)


def _flex_suits(problem: AttentionProblem) -> bool:
    """Whether 'auto' may send this CUDA problem to FlexAttention."""
    return flex_available() and not switches.is_off("flex") and flex_suits(problem.q.dtype, (problem.E, problem.Ev))


def _sparse_if_it_wins(problem: AttentionProblem, return_weights: bool, return_lse: bool) -> Plan | str | None:
    """'auto' for a structured mask: the block engine (CPU) or FlexAttention (CUDA), when they
    pay off; else why not, when the engine's cost model decided (`_engine_refusal`), or None."""
    L, S = problem.L, problem.S
    if L * S < _SPARSE_MIN_PAIRS or private_torch.onnx_exporting():
        return None  # small, or an ONNX export (either exporter): the dense paths
    if _traced(problem):
        return _traced_sparse(problem, return_weights, return_lse)
    device = problem.q.device
    if device.type == "cpu" and flash_kernel_available() and not switches.is_off("blocks"):
        path: Literal["blocks", "flex"] = "blocks"
        block_q, block_k = BLOCKS.block_q, BLOCKS.block_k
    elif device.type == "cuda" and _flex_suits(problem):
        path, block_q, block_k = "flex", FLEX_BLOCK, FLEX_BLOCK
    else:
        return None
    engine = "the CPU block engine" if path == "blocks" else "FlexAttention with qkv's BlockMask"
    if _too_large_to_evaluate(problem):
        return _sparse_plan(problem, path, _deferred_reason(problem, engine), return_weights, return_lse, deferred=True)
    if path == "blocks":
        # before planning, which costs a good part of a small call
        refusal = _engine_refusal(problem, None, True)
        if refusal is not None:
            return refusal
    layout = _layout(problem, block_q, block_k)
    tiles = None
    if path == "blocks":
        tiles = _block_plan(problem, BLOCKS, layout)
        visited = tiles.computed_pairs() / (problem.N * L * S)
    else:
        visited = layout.visited_pairs() / (L * S)
    if visited > _SPARSE_MAX_VISITED:
        return None
    if tiles is not None:
        refusal = _engine_refusal(problem, visited, tiles.intervals is not None)
        if refusal is not None:
            return refusal
    assert isinstance(problem.mask, Mask)
    reason = (
        f"{problem.mask.describe()} leaves {layout.visited_block_fraction:.1%} of the "
        f"{layout.block_q}x{layout.block_k} tiles non-empty; {engine} computes {visited:.1%} "
        "of the score matrix and skips the rest"
    )
    return _sparse_plan(problem, path, reason, return_weights, return_lse, layout, tiles)


def _traced_flex(problem: AttentionProblem, return_weights: bool, return_lse: bool) -> Plan | None:
    """'auto' while torch.compile traces a call with score terms that the block engine's
    operators cannot take (a score_mod, or terms with a predicate: Python functions), on CPU
    without gradients, for a mask whose data decides which keys a query sees (documents,
    lengths, a predicate, a bool tensor, alone or combined): FlexAttention, which Inductor
    lowers to its CPU kernel, skipping the tiles that the mask's values leave empty when the
    graph runs (`qkv.backends.flex._cpu_kernel`). The math path's chunks
    (`qkv.backends.query_chunks`) would compute every key there, since the mask's parameters
    alone do not narrow them. Measured (benchmarks/compile_modes.py, "score_mod docs": n =
    4,096, B = 1, H = 4, E = 32, no gradient; AMD EPYC, 2 threads), compiled over eager qkv:
    0.66x in float32 and 0.72x in bfloat16, against 3.3x by chunks. The kernel has no
    backward and returns no lse, so gradients, weights, lse and sinks keep to the math path;
    an interval mask (causal, windows) too, whose chunks skip the keys it hides (the kernel
    and the chunks ran within a factor of 2 of each other there, either ahead by dtype)."""
    mask = problem.mask
    if not torch.compiler.is_compiling() or private_torch.is_exporting() or problem.q.device.type != "cpu":
        return None
    if not isinstance(mask, Mask) or not _data_decided(mask, problem.L, problem.S) or _too_large_to_evaluate(problem):
        return None
    if return_weights or return_lse or problem.sinks is not None or problem.dropout > 0.0 or needs_grad(problem):
        return None
    if switches.is_off("flex") or cpu_kernel_reason(problem.q.dtype) is not None:
        return None
    terms = problem.terms
    # FlexAttention takes no symbolic float in its score_mod or mask_mod: static sizes (with
    # dynamic sizes, Dynamo traces floats as variables too), and the functions traced once here,
    # on one pair, so that a float they read joins the graph before the check below
    if not all(type(n) is int for n in (problem.N, problem.H, problem.G, problem.L, problem.S, problem.E, problem.Ev)):
        return None
    index = torch.zeros((), dtype=torch.int32, device=problem.q.device)
    terms.apply(torch.zeros((), device=problem.q.device), index, index, index, index)
    for function in _predicates(mask):
        function(index, index, index, index)
    if private_torch.traced_floats_symbolic():
        return None
    what = f"{terms.describe()} with {mask.describe()}" if terms.active else mask.describe()
    reason = (
        f"{what}, traced by torch.compile without gradients: FlexAttention with qkv's BlockMask, which Inductor "
        "lowers to its CPU kernel; it skips the tiles the mask's values leave empty when the graph runs"
    )
    return Plan(
        "flex", reason, mask="tiles", scores="score_mod" if terms.active else "none",
        deferred=True, forward_kernel="flex", backward_kernel="none",
    )  # fmt: skip


def _predicates(mask: Mask) -> list[Callable[..., torch.Tensor]]:
    """The functions of the `predicate` masks in ``mask``."""
    if isinstance(mask, Combined):
        return _predicates(mask.left) + _predicates(mask.right)
    return [mask.fn] if isinstance(mask, Predicate) else []


def _data_decided(mask: Mask, L: int, S: int) -> bool:
    """Whether the mask's data (ids, lengths, a tensor, a predicate's values) decides some of
    what it hides: its parameters alone give no count of visible pairs for a part of it."""
    if isinstance(mask, Combined):
        return _data_decided(mask.left, L, S) or _data_decided(mask.right, L, S)
    return mask.visible_pairs(L, S) is None


def _engine_refusal(problem: AttentionProblem, visited: float | None, has_intervals: bool) -> str | None:
    """Why SDPA with the mask rendered dense is estimated faster than the block engine
    computing ``visited`` of the score matrix (`qkv.backends.blocks.crossover`), or None. With
    ``visited`` None, before any planning: whether SDPA wins even against an engine that
    computes nothing, its fixed and per-row costs alone. Only where the engine would run
    PyTorch's flash kernel per tile: the fused bf16 interval kernel (which needs one key
    interval per query) beat SDPA at every size measured. Plain Python on the sizes, as eager
    and traced dispatch both decide by it."""
    q = problem.q
    if interval_bf16.unavailable_reason(q.dtype, q.device, has_intervals) is None:
        return None
    sizes = (problem.N, problem.H, problem.L, problem.S, max(problem.E, problem.Ev))
    if _symbolic_sizes(sizes) or not crossover.decides(problem.L, problem.S):
        return None  # symbolic sizes (dynamic shapes), or beyond the model's range: the share threshold decides
    share = 0.0 if visited is None else visited
    engine, dense = crossover.engine_ms(*sizes, share), crossover.dense_ms(*sizes)
    if engine < dense:
        return None
    work = "even computing none of the score matrix" if visited is None else f"computing {visited:.1%} of the score matrix"
    return (
        f"at this size the CPU block engine's fixed cost outweighs the work it skips: an estimated "
        f"{engine:.1f} ms {work}, against {dense:.1f} ms for SDPA"
    )


def _symbolic_sizes(sizes: tuple[int, ...]) -> bool:
    """Whether some of these sizes may be symbolic: torch.export's non-strict tracing hands
    SymInts, and Dynamo shows its symbolic sizes as ints, so for it the trace's shape
    environment answers (`private_torch.traced_sizes_symbolic`). False on eager calls."""
    if not all(type(n) is int for n in sizes):
        return True
    return torch.compiler.is_compiling() and private_torch.traced_sizes_symbolic()


def _traced_sparse(problem: AttentionProblem, return_weights: bool, return_lse: bool) -> Plan | None:
    """'auto' for a structured mask while torch.compile / torch.export trace: the block engine's
    operators when eager would choose the engine, decided from the mask's Python parameters (the
    values of its tensors are not known): a mask without tensors (causal, windows, prefix-LM) by
    the share of the score matrix its planned tiles compute, as eagerly (`ops.planned_share`, a
    constant to Dynamo); a mask given by data (documents, varlen, key padding) by size alone.
    Both also by the engine's cost model (`_engine_refusal`): with the planned share, or for
    data masks with nothing computed, so that a call too small for the engine whatever its data
    keeps to SDPA, as eagerly. A bool tensor (`qkv.masks.dense`) stays on SDPA, which reads it
    as it is."""
    mask = problem.mask
    assert isinstance(mask, Mask)
    if isinstance(mask, Dense) or _traced_engine_refusal(problem, return_weights) is not None:
        return None
    L, S = problem.L, problem.S
    pairs = mask.visible_pairs(L, S)
    tensors: list[torch.Tensor] = []
    spec = spec_codec.encode(mask, tensors)
    sizes = (problem.N, problem.H, L, S, max(problem.E, problem.Ev), problem.q.element_size(), mask_heads(problem))
    # symbolic sizes (dynamic shapes) take no format spec, and no constant function takes them:
    # the planned share needs the real sizes, so they are decided by the mask's parameters alone
    symbolic = _symbolic_sizes(sizes)
    if pairs is None:
        if _engine_refusal(problem, None, True) is not None:
            return None  # too small for the engine whatever the mask's data, as eager finds
        size = "symbolic sizes" if symbolic else f"{L * S:,} pairs per head"
        reason = f"{mask.describe()} at {size}: the CPU block engine skips its empty tiles; {_TRACED_OPERATOR}"
    elif spec is not None and not tensors and not symbolic:
        visited = planned_share(spec, *sizes, needs_grad(problem))
        if visited > _SPARSE_MAX_VISITED or _engine_refusal(problem, visited, True) is not None:
            return None
        reason = (
            f"{mask.describe()} leaves {pairs / (L * S):.1%} of the score matrix visible (from its parameters); "
            f"the CPU block engine computes {visited:.1%} and skips the rest; {_TRACED_OPERATOR}"
        )
    else:
        # an upper bound: a mask with tensors (`&` of key padding), or any at symbolic sizes
        visited = pairs / (L * S)
        # torch.export must hold for every size in its range, and a share of symbolic sizes is
        # a guard it cannot always prove: an exported graph keeps the engine, right at any share
        decided_by_share = not (symbolic and private_torch.is_exporting())
        if (decided_by_share and visited > _SPARSE_MAX_VISITED) or _engine_refusal(problem, None, True) is not None:
            return None
        share = "a share" if symbolic else f"at most {visited:.1%}"
        reason = (
            f"{mask.describe()} leaves {share} of the score matrix visible (from its parameters); the "
            f"CPU block engine computes about that and skips the rest; {_TRACED_OPERATOR}"
        )
    return _sparse_plan(problem, "blocks", reason, return_weights, return_lse, deferred=True)


def weights_plan(problem: AttentionProblem) -> Plan:
    """The rule of `qkv.attention_weights`: the tiles recompute the weights of the chosen rows
    for no mask or a structured one; a tensor mask takes the dense formula on the chosen heads
    and rows."""
    active = problem.terms.active
    if problem.mask is None or isinstance(problem.mask, Mask):
        layout = _layout(problem, BLOCKS.block_q, BLOCKS.block_k)
        reason = "the weights of the chosen heads and rows, recomputed tile by tile from their lse"
        return Plan(
            "blocks", reason, mask="tiles", scores="tiles" if active else "none", weights="tiles", lse="tiles",
            layout=layout, tiles=_block_plan(problem, BLOCKS, layout), forward_kernel="weights_tiles",
            backward_kernel="none",
        )
    reason = "a tensor mask: the dense formula on the chosen heads and rows"
    return Plan(
        "math", reason, mask="dense", scores="formula" if active else "none", weights="dense", lse="dense",
        forward_kernel="weights_dense", backward_kernel="none",
    )


RingBlockPath = Literal["cpu-flash", "tiles"]


def ring_block_path(q: torch.Tensor, v: torch.Tensor, cpu_flash: bool = True) -> RingBlockPath:
    """The sub-rule for one block of ring attention (`qkv.distributed.blockwise`).

    A block has no mask but a causal diagonal, no score terms and no dropout, and it always
    needs its lse and a backward that takes the global output and lse. That is the fused
    path's lse rule above: PyTorch's CPU flash kernel (`fused_lse_available`), here only when
    E == Ev (the ring does not pad head dims) and ``cpu_flash`` allows it, and
    ``qkv.backends.disabled("ring_cpu_flash")`` is not in force; the blockwise tiles everywhere else.
    """
    if cpu_flash and not switches.is_off("ring_cpu_flash") and q.shape[-1] == v.shape[-1] and fused_lse_available(q):
        return "cpu-flash"
    return "tiles"
