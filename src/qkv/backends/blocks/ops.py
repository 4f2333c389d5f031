"""The block engine as two ``torch.library`` operators, for torch.compile and torch.export.

Eagerly the engine is an autograd Function (`engine._BlockAttention`, `scored._ScoredBlockAttention`)
whose non-tensor argument, the run (tile plan, mask, score terms), is planned on the host from
the mask's values. While torch.compile or torch.export trace, those values do not exist, and
Dynamo cannot follow the planner (NumPy, ``.item()``) without breaking the graph. So under
tracing the engine runs as ``qkv::blocks_forward`` and ``qkv::blocks_backward``: opaque to
Dynamo, with tensors and plain values only, and their implementations rebuild the mask, the
score terms and the tile plan from them *when the graph runs*, then call the engine's own
forward and backward code, the same as eager. The plan needs the mask's values (document ids,
lengths) anyway, so planning at run time is not a cost that tracing adds; for masks without
tensors (causal, windows, prefix-LM) the plan of the last few sizes is kept, with the mask
tiles its runs share (`_cached_plan`; eager dispatch takes it too, `kept_plan`), and for masks
with tensors the last few plans with copies of the tensors they were made from (`_data_plan`):
the backward operator finds the forward's plan there, as eager's autograd Function keeps its
plan, instead of planning again.

Why a spec string rather than another design. The mask and bias reach the operators as text
(`qkv._private.spec`: ``('sliding_window',256,0,'bottom-right')`` and the list of tensors
they read, such as document ids or ALiBi slopes). The alternatives were worse: a registry of
Python objects keyed by an id would give graphs that cannot be saved (torch.export) and that
outlive their objects; opaque script objects need torch >= 2.6 and a class registered in
TorchScript; a tile plan computed while tracing needs the mask's values. Building the spec is
plain Python over the masks' parameters (ints, strings, bools), which Dynamo traces without a
break and guards on, so a model that changes its window gets a new graph. The operators
serialize in an exported program (strings, floats, bools and tensor lists are schema types).

Gradients (`_setup_context`, `_backward`): the forward returns what the autograd Functions
save, the *unrounded* output in the accumulation dtype and the lse (in two parts, shift + rest,
for score terms), and the sinks' share p_sink when sinks are given, so the backward operator
costs what eager's backward costs (FlashAttention-2's recomputation from the final output and
lse). Gradients reach q, k, v, the sinks and the bias tensors (ALiBi slopes, relative tables,
dense biases); mask tensors get none. Without a gradient those saved outputs are empty.

The input check runs inside the forward operator with the values at hand, as eagerly and before
the engine: the overflow refusal (`qkv.backends.overflow`, eager's ValueError and message; its
graph code in `qkv.attention.problem` is left out, `qkv.attention.execute.checks_values_itself`)
and the NaN rule (`qkv.attention.nan_rule`): the magnitude scan of q, k, v (which tells whether
they are finite), and only when an entry is not finite the
affected rows (`_bad_rows`) and the engine on the inputs with those entries set to 0; with a
gradient to come the caller sets the rows to NaN in the graph, so autograd gives them no
gradient, and the backward operator gives the non-finite entries none; without, the operator
sets them (no pass over the output in the graph). The traced rule's tensor passes (finite copies of
q, k, v, a mask over the output) cost more than the engine itself for narrow windows.
`qkv.attention` skips them for these operators (`qkv.attention.execute.applies_nan_rule`).

score_mod, a Python function, cannot cross an operator boundary: `qkv.attention.dispatch`
keeps it off these operators (see its reason). Shapes: q, k, v (N, H, *, Ep) as
`calls.kernel_inputs` returns them (key/value heads expanded, one head size Ep), output
(N, H, L, Ep), lse and its parts (N, H, L).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from qkv._private import spec as spec_codec
from qkv._private import torch as private_torch
from qkv.backends import overflow
from qkv.backends.blocks import engine, scored
from qkv.backends.blocks.calls import BlockRun, kernel_inputs
from qkv.backends.blocks.planner import (
    BlockConfig,
    BlockPlan,
    BlockSizes,
    TileStore,
    plan_intervals,
    plan_layout,
)
from qkv.backends.sinks import fold as sink_fold
from qkv.backends.sinks import sink_gradient
from qkv.backends.softmax import accumulation_dtype, causal_kernel_scale
from qkv.bias import ALiBi, Bias, Relative, Sum
from qkv.bias import Dense as DenseBias
from qkv.masks import (
    BlockLayout,
    Causal,
    Combined,
    Dense,
    Documents,
    KeyPadding,
    Mask,
    Padded,
    PrefixLM,
    SlidingWindow,
    Varlen,
)
from qkv.scores import ScoreTerms

__all__ = ["block_attention_op", "encodable", "kept_layout", "kept_plan", "plan_for", "planned_share"]

# spec name -> constructor, for `spec_codec.decode`
_MASKS = {
    "causal": Causal, "sliding_window": SlidingWindow, "prefix_lm": PrefixLM, "documents": Documents,
    "key_padding": KeyPadding, "varlen": Varlen, "padded": Padded, "dense": Dense, "combined": Combined,
}  # fmt: skip
_BIASES = {"alibi": ALiBi, "relative": Relative, "dense_bias": DenseBias, "sum": Sum}

_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor[] mask_tensors, Tensor[] bias_tensors, str mask_spec, "
    "str bias_spec, float scale, float? softcap, str forward_kernel, str backward_kernel, bool need_grad, "
    "str impl) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor shift, "
    "Tensor rest, Tensor? sinks, Tensor p_sink, Tensor rows, Tensor nonfinite, Tensor[] mask_tensors, Tensor[] bias_tensors, str mask_spec, "
    "str bias_spec, float scale, float? softcap, str forward_kernel, str backward_kernel, bool sinks_grad, "
    "bool[] bias_grads, str impl) -> (Tensor, Tensor, Tensor, Tensor, Tensor[])"
)
# The operators' last argument, ``impl``: a digest of this file, where their fake kernels and
# autograd formula live. TorchInductor's caches key a compiled graph by its operators' names and
# arguments, not by the Python behind them; with the digest in the graph, a changed operator
# (an upgrade of qkv) compiles anew instead of running code made for the old one's output
# layout (which fails its size asserts). The operators do not read it. It has no default: with
# it omitted, PyTorch 2.10 expects one gradient fewer from the autograd formula than the formula
# gives (the formula cannot tell how many arguments came), and the backward fails.
_IMPL = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def encodable(mask: object, terms: ScoreTerms) -> bool:
    """Whether the operators can take this mask and these terms: every part rebuilds from its
    spec (not a `qkv.masks.predicate`) and there is no score_mod. Plain Python (traced)."""
    if terms.score_mod is not None:
        return False
    if mask is not None and spec_codec.encode(mask, []) is None:
        return False
    return terms.bias is None or spec_codec.encode(terms.bias, []) is not None


def block_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    scale: float,
    terms: ScoreTerms,
    sinks: torch.Tensor | None,
    forward_kernel: str,
    backward_kernel: str,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.block_attention` / `scored.scored_block_attention` through the operators: (output
    (N, H, L, Ev) in q's dtype, lse (N, H, L)). q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev);
    ``terms`` without score_mod (`encodable`). The tile plan is made when the graph runs."""
    with_terms = terms.active
    kernel_q, kernel_scale = (q, scale) if with_terms else causal_kernel_scale(q, scale)
    q_, k_, v_ = kernel_inputs(kernel_q, k, v)  # (N, H, *, Ep)
    mask_tensors: list[torch.Tensor] = []
    bias_tensors: list[torch.Tensor] = []
    mask_spec = spec_codec.encode(mask, mask_tensors)
    bias_spec = spec_codec.encode(terms.bias, bias_tensors)
    assert mask_spec is not None and bias_spec is not None  # dispatch checks `encodable`
    out, lse, *_ = torch.ops.qkv.blocks_forward(
        q_, k_, v_, sinks, mask_tensors, bias_tensors, mask_spec, bias_spec, kernel_scale, terms.softcap,
        forward_kernel, backward_kernel, need_grad, _IMPL,
    )
    # (N, H, L, Ev); no slice in the graph when Ep = Ev (autograd's slice_backward would copy the gradient)
    out = out if out.shape[3] == v.shape[3] else out[..., : v.shape[3]]
    # the NaN rule applied by the operator; the backward operator gives its rows no gradient
    return out.to(q.dtype), lse


# Runs at graph run time ---------------------------------------------------------------------------


def _decode(mask_spec: str, bias_spec: str, mask_tensors: Sequence[torch.Tensor], bias_tensors: Sequence[torch.Tensor]) -> tuple[Mask | None, Bias | None]:
    mask = spec_codec.decode(mask_spec, mask_tensors, _MASKS)  # type: ignore[arg-type]  # dataclasses are callables
    bias = spec_codec.decode(bias_spec, bias_tensors, _BIASES)  # type: ignore[arg-type]
    assert mask is None or isinstance(mask, Mask)
    assert bias is None or isinstance(bias, Bias)
    return mask, bias


def _terms(mask: Mask | None, bias: Bias | None, softcap: float | None, L: int, S: int, device: torch.device) -> ScoreTerms:
    """The score terms as `qkv.attention.problem` binds them (the bias is bound already)."""
    positions = mask.query_positions(L, S, device) if mask is not None and bias is not None else None
    return ScoreTerms(L, S, softcap, bias, None, positions)


def plan_for(mask: Mask | None, sizes: BlockSizes, config: BlockConfig, device: torch.device | None = None) -> BlockPlan:
    """The engine's calls for ``mask`` at these sizes: from exact per-query key intervals when
    the mask has them, from its block layout otherwise (what `qkv.attention.dispatch` plans eagerly)."""
    L, S = sizes.L, sizes.S
    if mask is None:
        intervals: tuple[torch.Tensor, torch.Tensor] | None = (
            torch.zeros(1, L, dtype=torch.long), torch.full((1, L), S - 1, dtype=torch.long)
        )
    else:
        intervals = mask.row_intervals(L, S, device)
    if intervals is not None:
        return plan_intervals(*intervals, sizes, config)
    return plan_layout(mask.layout(L, S, config.block_q, config.block_k, device=device), sizes, config)  # type: ignore[union-attr]  # None has intervals


# the mask tiles a kept plan holds for all its runs (a window's few distinct tiles take well
# under this; a run's own store may hold up to BlockConfig.call_bytes while it lasts)
_SHARED_TILE_BYTES = 2 << 20


@functools.lru_cache(maxsize=16)
def _cached_plan(mask_spec: str, sizes: BlockSizes) -> BlockPlan:
    """`plan_for` a mask without tensors (its spec says all): the same plan for the same sizes,
    with a tile store that its runs share (the mask's tiles are the same on every call)."""
    mask, _ = _decode(mask_spec, "None", (), ())
    return dataclasses.replace(plan_for(mask, sizes, BlockConfig()), tile_store=TileStore(_SHARED_TILE_BYTES))


@functools.lru_cache(maxsize=16)
def _cached_layout(mask_spec: str, L: int, S: int, block_q: int, block_k: int) -> BlockLayout:
    mask, _ = _decode(mask_spec, "None", (), ())
    assert mask is not None
    return mask.layout(L, S, block_q, block_k)


def _tensorless_spec(mask: Mask | None) -> str | None:
    """The spec of a mask that has no tensors (None itself included), or None."""
    tensors: list[torch.Tensor] = []
    spec = spec_codec.encode(mask, tensors)
    return spec if spec is not None and not tensors else None


def kept_plan(mask: Mask | None, sizes: BlockSizes) -> BlockPlan | None:
    """`plan_for` on the CPU with the default `BlockConfig` for a mask without tensors (causal,
    windows, prefix-LM and their combinations, or None): the plan made for its spec at these
    sizes before (`_cached_plan`), which eager dispatch and these operators share, with the
    mask tiles its runs share (planning and tiles took about a quarter of a 2 ms window call
    at n = 1,024). None for a mask with tensors."""
    spec = _tensorless_spec(mask)
    return None if spec is None else _cached_plan(spec, sizes)


def kept_layout(mask: Mask, L: int, S: int, block_q: int, block_k: int) -> BlockLayout:
    """``mask.layout`` on the CPU, kept per spec and size for a mask without tensors (as `kept_plan`)."""
    spec = _tensorless_spec(mask)
    return mask.layout(L, S, block_q, block_k) if spec is None else _cached_layout(spec, L, S, block_q, block_k)


@torch.compiler.assume_constant_result
def planned_share(mask_spec: str, N: int, H: int, L: int, S: int, Ep: int, itemsize: int, mask_heads: int,
                  need_grad: bool) -> float:
    """The share of the score matrix (over all batch rows) that the engine's calls compute for
    a mask without tensors, given by its spec, at these sizes: what eager's dispatch compares
    with its threshold. A constant to Dynamo, which cannot follow the planner: traced dispatch
    decides by it as eager does, without a graph break."""
    sizes = BlockSizes(N=N, H=H, L=L, S=S, Ep=Ep, itemsize=itemsize, mask_heads=mask_heads, need_grad=need_grad, score_terms=False)
    # real tensors for the planner, also under a fake tensor mode (qkv.explain of fake inputs)
    with private_torch.real_tensors():
        return _cached_plan(mask_spec, sizes).computed_pairs() / (N * L * S)


def _plan(mask: Mask | None, mask_spec: str, mask_tensors: Sequence[torch.Tensor], q: torch.Tensor, S: int, bias: Bias | None,
          softcap: float | None, need_grad: bool) -> BlockPlan:
    N, H, L, Ep = q.shape
    if softcap is not None:
        mask_heads = 3 * H  # as dispatch.mask_heads: scores and probabilities on top of the tiles
    elif bias is not None:
        mask_heads = H
    else:
        mask_heads = mask.heads if mask is not None and mask.heads else 1
    sizes = BlockSizes(
        N=N, H=H, L=L, S=S, Ep=Ep, itemsize=q.element_size(), mask_heads=mask_heads, need_grad=need_grad,
        score_terms=bias is not None or softcap is not None,
    )
    if not mask_tensors:
        return _cached_plan(mask_spec, sizes)
    return _data_plan(mask, mask_spec, mask_tensors, sizes, q.device)


# (mask spec, sizes, copies of the mask's tensors, plan), most recent first; masks whose tensors
# hold more than _DATA_PLAN_BYTES are planned anew every time (a dense bool mask is L x S)
_DATA_PLANS: list[tuple[str, BlockSizes, tuple[torch.Tensor, ...], BlockPlan]] = []
_DATA_PLANS_KEPT = 4
_DATA_PLAN_BYTES = 4 << 20
_DATA_PLANS_LOCK = threading.Lock()


def _same_values(kept: Sequence[torch.Tensor], given: Sequence[torch.Tensor]) -> bool:
    return len(kept) == len(given) and all(
        a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b)) for a, b in zip(kept, given, strict=True)
    )


def _data_plan(mask: Mask | None, mask_spec: str, mask_tensors: Sequence[torch.Tensor], sizes: BlockSizes,
               device: torch.device) -> BlockPlan:
    """`plan_for` a mask with tensors (document ids, lengths, padding): a plan made from equal
    tensors (compared by value: a tensor's address and version may come back with other values)
    is reused. Planning reads the tensors on the host (milliseconds for documents at n = 4,096);
    the comparison is one pass over them."""
    with _DATA_PLANS_LOCK:
        for index, (spec, planned_sizes, kept, plan) in enumerate(_DATA_PLANS):
            if spec == mask_spec and planned_sizes == sizes and _same_values(kept, mask_tensors):
                _DATA_PLANS.insert(0, _DATA_PLANS.pop(index))
                return plan
    plan = plan_for(mask, sizes, BlockConfig(), device)
    if sum(t.numel() * t.element_size() for t in mask_tensors) <= _DATA_PLAN_BYTES:
        kept = tuple(t.detach().clone() for t in mask_tensors)
        with _DATA_PLANS_LOCK:
            _DATA_PLANS.insert(0, (mask_spec, sizes, kept, plan))
            del _DATA_PLANS[_DATA_PLANS_KEPT:]
    return plan


# The run of a forward with a gradient (its plan and the mask tiles built; with score terms also
# the terms and the bias tiles: a `scored._ScoredRun`), for its backward, which would build the
# same tiles again (eager's autograd Functions keep the run in their context; an operator passes
# tensors only). The forward leaves it under its output's address, which the backward receives
# (saved), and the backward takes it out. Another forward's output can have that address only
# once the first output is freed, when its backward can no longer run, and it then replaces the
# entry; entries whose backward never runs are dropped beyond _KEPT_RUNS_COUNT (a run holds at
# most the plan's call_bytes of mask tiles and scored._BIAS_CACHE_BYTES of bias tiles). The
# entry keeps the forward's bias tensors: a compiled backward may get equal ones computed again
# (AOTAutograd recomputes cheap values such as ALiBi's slopes rather than saving them), so they
# are compared by value where their addresses differ.
_KEPT_RUNS: dict[tuple[object, ...], tuple[tuple[torch.Tensor, ...], BlockRun, scored._ScoredRun | None]] = {}
_KEPT_RUNS_COUNT = 4
_KEPT_RUNS_LOCK = threading.Lock()


def _run_key(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, mask_spec: str, bias_spec: str, scale: float,
             softcap: float | None, forward_kernel: str) -> tuple[object, ...]:
    """The forward's output (saved for the backward: the same address there), shapes and specs."""
    return (out.data_ptr(), tuple(out.shape), tuple(q.shape), tuple(k.shape), q.dtype, mask_spec, bias_spec, scale, softcap, forward_kernel)


def _keep_run(key: tuple[object, ...], bias_tensors: Sequence[torch.Tensor], run: BlockRun, run_s: scored._ScoredRun | None) -> None:
    """Keep the forward's mask run and, with score terms, its scored run (which holds the mask run)."""
    with _KEPT_RUNS_LOCK:
        _KEPT_RUNS.pop(key, None)
        _KEPT_RUNS[key] = (tuple(bias_tensors), run, run_s)  # the newest last
        while len(_KEPT_RUNS) > _KEPT_RUNS_COUNT:
            del _KEPT_RUNS[next(iter(_KEPT_RUNS))]


def _take_run(key: tuple[object, ...], bias_tensors: Sequence[torch.Tensor]) -> tuple[BlockRun | None, scored._ScoredRun | None]:
    """The runs kept under ``key`` (`_keep_run`) when they were built from bias tensors equal to
    ``bias_tensors``, else (None, None)."""
    with _KEPT_RUNS_LOCK:
        entry = _KEPT_RUNS.pop(key, None)
    if entry is None:
        return None, None
    kept, run, run_s = entry
    same = len(kept) == len(bias_tensors) and all(
        a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)
        or _same_values((a,), (b,))
        for a, b in zip(kept, bias_tensors, strict=True)
    )
    return (run, run_s) if same else (None, None)


def _empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


def _head_major(forward_kernel: str) -> bool:
    """Whether the results of ``forward_kernel`` come head major, (N, H, L, ...) contiguous, as
    the fused bf16 interval kernel writes them; the engine's calls (`calls.run_calls`) write
    them query-row major, (N, L, H, ...) transposed. A fake kernel must name the strides
    (Inductor checks them): it names the layout that the kernel writes, so that the operator
    copies nothing unless the kernel falls back at run time (`_with_intervals`)."""
    return forward_kernel == "interval_bf16"


def _laid_out(x: torch.Tensor, head_major: bool) -> torch.Tensor:
    """x (N, H, L, ...) in the layout `_head_major` names, copied only when it is not. Empty
    tensors pass as they are."""
    if x.numel() == 0:
        return x
    if head_major:
        return x.contiguous()
    moved = x.transpose(1, 2)  # (N, L, H, ...)
    return x if moved.is_contiguous() else moved.contiguous().transpose(1, 2)


def _laid_out_empty(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, head_major: bool) -> torch.Tensor:
    """An uninitialized (N, H, L, ...) tensor in `_laid_out`'s layout (for the fake kernels)."""
    if head_major:
        return like.new_empty(shape, dtype=dtype)
    N, H, L, *rest = shape
    return like.new_empty((N, L, H, *rest), dtype=dtype).transpose(1, 2)


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of x is finite, in one read of x: its min and max are finite exactly
    then (both carry a NaN, and an infinity is one of them)."""
    low, high = torch.aminmax(x)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """x with its non-finite entries replaced by 0 (x itself when it has none)."""
    if _all_finite(x):
        return x
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


def _bad_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None) -> torch.Tensor | None:
    """(N, H, L) bool: the rows that read a non-finite entry of q, k or v (N, H, *, Ep) by
    `qkv.attention`'s NaN rule, found as eagerly (`qkv.attention.nan_rule.affected_rows`: a row
    whose query holds one, and every row that may see a key whose k or v holds one); None when
    every entry is finite (one pass over each tensor, as eager's check)."""
    if _all_finite(q) and _all_finite(k) and _all_finite(v):
        return None
    N, H, L = q.shape[0], q.shape[1], q.shape[2]
    S = k.shape[2]
    rows = ~torch.isfinite(q).all(dim=-1)  # (N, H, L)
    bad_keys = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))  # (N, H, S): key/value heads expanded
    cols = torch.nonzero(bad_keys.any(dim=0).any(dim=0)).flatten()  # (c,) keys bad somewhere
    if cols.numel() == 0:
        return rows
    if mask is None:
        sees = torch.ones(1, 1, L, cols.numel(), dtype=torch.bool)
    else:
        B, Hm = mask.batch or 1, mask.heads or 1
        b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(Hm).view(1, Hm, 1, 1)  # (B | 1, 1, 1, 1), (1, H | 1, 1, 1)
        sees = mask.visible(b, h, torch.arange(L).view(1, 1, L, 1), cols.view(1, 1, 1, -1), L, S)  # (B | 1, H | 1, L, c)
    del N, H
    return rows | (sees & bad_keys[:, :, cols][:, :, None, :]).any(dim=-1)


def _plain(has_bias: bool, softcap: float | None, forward_kernel: str) -> bool:
    """Whether the plain engine runs the call (`engine._forward`, no shift and rest of the lse):
    no score terms, or terms that the fused bf16 interval kernels apply (dispatch names them
    then; the engine hands the call to the scored one where they cannot run)."""
    return forward_kernel == "interval_bf16" or (not has_bias and softcap is None)


def _with_intervals(kernel: str, plan: BlockPlan) -> str:
    """The interval kernels need one key interval per query; a plan without falls back to the portable kernels
    (dispatch names them while tracing when the mask's data decides)."""
    if plan.intervals is None:
        return {"interval_bf16": "cpu_flash_tiles", "interval_bf16_backward": "engine_per_call"}.get(kernel, kernel)
    return kernel


@torch.library.custom_op("qkv::blocks_forward", mutates_args=(), schema=_FORWARD_SCHEMA)
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, mask_tensors: Sequence[torch.Tensor],
    bias_tensors: Sequence[torch.Tensor], mask_spec: str, bias_spec: str, scale: float, softcap: float | None,
    forward_kernel: str, backward_kernel: str, need_grad: bool, impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output (N, H, L, Ep): float32 or wider with ``need_grad``, else q's dtype; lse (N, H, L);
    shift, rest (N, H, L) with score terms and ``need_grad``, else empty; p_sink (N, H, L) with
    sinks and ``need_grad``, else empty). ``forward_kernel``: the plain engine's forward kernel,
    or with score terms "bias_tiles" / "score_tiles", or "interval_bf16" where the fused kernels
    apply them; ``backward_kernel`` is read by the backward only.
    Then, with ``need_grad``, the rows (N, H, L) bool that the NaN rule makes NaN (else empty),
    and whether q, k or v holds a non-finite entry (0-d bool), for the backward: the engine runs
    on the inputs with their non-finite entries replaced by 0 and the operator sets those rows
    of the output and lse to NaN. Results come in the layout `_head_major` names for
    ``forward_kernel``."""
    del backward_kernel
    mask, bias = _decode(mask_spec, bias_spec, mask_tensors, bias_tensors)
    L, S = q.shape[2], k.shape[2]
    # qkv.attention's input check, as eagerly and before any work: the bias's values (its own
    # ValueError), the overflow refusal with eager's message, and whether the NaN rule applies
    bias_top = 0.0 if bias is None else float(bias.largest(L, S))
    nonfinite = overflow.refuse_overflow(q, k, overflow.largest_magnitudes((q, k, v)), scale, softcap, bias_top, 0.0)
    bad_rows = _bad_rows(q, k, v, mask) if nonfinite else None
    if bad_rows is not None:
        q, k, v = _finite(q), _finite(k), _finite(v)
    acc = accumulation_dtype(q.dtype)
    plan = _plan(mask, mask_spec, mask_tensors, q, S, bias, softcap, need_grad)
    p_sink = _empty(q, acc)
    plain = _plain(bias is not None, softcap, forward_kernel)
    fused_terms = _terms(mask, bias, softcap, L, S, q.device) if plain and (bias is not None or softcap is not None) else None
    run = BlockRun(plan, mask, scale, fused_terms)
    run_s: scored._ScoredRun | None
    if fused_terms is not None:
        # the fused kernels' lse comes whole (rest 0), the scored engine's, where it stands in, in
        # its two parts, which the backward then reads (`engine.forward_with_terms`)
        out, shift, maybe_rest = engine.forward_with_terms(q, k, v, run, not need_grad and sinks is None, _with_intervals(forward_kernel, plan))
        rest = torch.zeros_like(shift) if maybe_rest is None else maybe_rest
        if sinks is not None:
            out, rest, p_sink = sink_fold(out, rest, sinks, shift)
        lse = shift + rest
        if not need_grad:
            shift, rest = _empty(q, acc), _empty(q, acc)
        run_s = None
    elif plain:
        out, lse = engine._forward(q, k, v, run, rounded=not need_grad and sinks is None, kernel=_with_intervals(forward_kernel, plan))
        if sinks is not None:
            out, lse, p_sink = sink_fold(out, lse, sinks)
        shift, rest = _empty(q, acc), _empty(q, acc)
        run_s = None
    else:
        terms = _terms(mask, bias, softcap, L, S, q.device)
        run_s = scored._ScoredRun(run, terms, scored._tile_bias(bias, acc), flash=forward_kernel == "bias_tiles")
        out, shift, rest = scored._forward(q, k, v, run_s)
        if sinks is not None:
            out, rest, p_sink = sink_fold(out, rest, sinks, shift)
        lse = shift + rest
        if not need_grad:
            shift, rest = _empty(q, acc), _empty(q, acc)
    if not need_grad:
        p_sink = _empty(q, acc)
    if bad_rows is not None:
        # the NaN rule's last step, here rather than in the graph, which would pass over the whole
        # output on every call; the backward operator zeroes these rows' gradients (`_backward_op`)
        out, lse = out.masked_fill(bad_rows.unsqueeze(-1), float("nan")), lse.masked_fill(bad_rows, float("nan"))
    if need_grad:
        rows = torch.zeros(q.shape[:3], dtype=torch.bool) if bad_rows is None else bad_rows.contiguous()
    else:
        rows = _empty(q, torch.bool)
    head_major = _head_major(forward_kernel)
    results = tuple(_laid_out(x, head_major) for x in (out.to(acc if need_grad else q.dtype), lse, shift, rest, p_sink))
    if need_grad:
        _keep_run(_run_key(results[0], q, k, mask_spec, bias_spec, scale, softcap, forward_kernel), bias_tensors, run, run_s)
    return (*results, rows, torch.tensor(nonfinite))  # type: ignore[return-value]


@_forward_op.register_fake
def _forward_fake(q, k, v, sinks, mask_tensors, bias_tensors, mask_spec, bias_spec, scale, softcap, forward_kernel, backward_kernel, need_grad, impl):  # type: ignore[no-untyped-def]
    N, H, L, Ep = q.shape
    acc = accumulation_dtype(q.dtype)
    with_terms = bias_spec != "None" or softcap is not None  # the lse in two parts, shift + rest

    head_major = _head_major(forward_kernel)

    def rows(present: bool) -> torch.Tensor:
        return _laid_out_empty(q, (N, H, L), acc, head_major) if present else q.new_empty((0,), dtype=acc)

    out = _laid_out_empty(q, (N, H, L, Ep), acc if need_grad else q.dtype, head_major)
    return (
        out, rows(True), rows(with_terms and need_grad), rows(with_terms and need_grad), rows(sinks is not None and need_grad),
        q.new_empty((N, H, L) if need_grad else (0,), dtype=torch.bool), q.new_empty((), dtype=torch.bool),
    )


@torch.library.custom_op("qkv::blocks_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def _backward_op(
    grad_out: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, shift: torch.Tensor, rest: torch.Tensor, sinks: torch.Tensor | None, p_sink: torch.Tensor,
    rows: torch.Tensor, nonfinite: torch.Tensor, mask_tensors: Sequence[torch.Tensor], bias_tensors: Sequence[torch.Tensor], mask_spec: str, bias_spec: str,
    scale: float, softcap: float | None, forward_kernel: str, backward_kernel: str, sinks_grad: bool,
    bias_grads: Sequence[bool], impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv (N, H, *, Ep) in q's, k's, v's dtypes; d sinks (sinks' shape) or empty; the
    bias tensors' gradients, empty where not asked for) from the forward's saved outputs."""
    mask, bias = _decode(mask_spec, bias_spec, mask_tensors, bias_tensors)
    L, S = q.shape[2], k.shape[2]
    kept_run, kept_scored = _take_run(_run_key(out, q, k, mask_spec, bias_spec, scale, softcap, forward_kernel), bias_tensors)
    if any(bias_grads):
        # the bias tiles are differentiated against this call's bias tensors, which the kept
        # run's terms do not read: only the forward's mask tiles are reused
        kept_scored = None
    plan = kept_run.plan if kept_run is not None else _plan(mask, mask_spec, mask_tensors, q, S, bias, softcap, True)
    # the NaN rule: the forward ran on the finite inputs (non-finite entries 0), which take no
    # gradient where they were not finite (eager's torch.where), and made ``rows`` NaN, which pass
    # none (eager's masked_fill); the saved output and lse of those rows are NaN: 0 and the largest
    # float instead give them probabilities 0, so they add nothing to the other gradients
    originals = (q, k, v)
    if bool(nonfinite):
        q, k, v = _finite(q), _finite(k), _finite(v)
        per_row = rows.unsqueeze(-1)  # (N, H, L, 1)
        grad_out, grad_lse = grad_out.masked_fill(per_row, 0.0), grad_lse.masked_fill(rows, 0.0)
        out, lse = out.masked_fill(per_row, 0.0), lse.masked_fill(rows, torch.finfo(lse.dtype).max)
    lse_grad: torch.Tensor | None = grad_lse if bool(grad_lse.any()) else None  # autograd passes zeros for an unused lse
    d_sinks = _empty(q, q.dtype) if sinks is None else torch.zeros_like(sinks)
    if sinks is not None and sinks_grad:
        d_sinks = sink_gradient(grad_out, out, lse_grad, p_sink, sinks)
    # float32 accumulators stay float32; the scored backward differentiates each tile with
    # autograd, which the plain one does not need (every op would pass the autograd keys: its
    # Python overhead was about 1.5x eager's, 0.3 ms a call at n = 256)
    plain = _plain(bias is not None, softcap, forward_kernel)
    fused_terms = _terms(mask, bias, softcap, L, S, q.device) if plain and (bias is not None or softcap is not None) else None
    # (the plain engine with score terms may hand them to the scored backward: `engine._backward`)
    plain_only = plain and fused_terms is None
    with torch.autocast(q.device.type, enabled=False), contextlib.nullcontext() if plain_only else private_torch.autograd_inside_operator():
        run = kept_run if kept_run is not None else BlockRun(plan, mask, scale, fused_terms)
        if plain:
            grads: tuple[torch.Tensor | None, ...] = engine._backward(
                grad_out, q, k, v, out, lse, run, lse_grad, _with_intervals(backward_kernel, plan),
                lse_parts=None if fused_terms is None else (shift, rest),
            )
            d_bias = [_empty(t, t.dtype) for t in bias_tensors]  # the fused kernels take no learning bias
        else:
            acc = accumulation_dtype(q.dtype)
            if kept_scored is not None:
                run_s = kept_scored  # the forward's: its plan, terms, mask and bias tiles
            else:
                terms = _terms(mask, bias, softcap, L, S, q.device)
                run_s = scored._ScoredRun(run, terms, scored._tile_bias(bias, acc), flash=forward_kernel == "bias_tiles")
            grads = scored._backward(grad_out, lse_grad, q, k, v, out, shift, rest, run_s, tuple(bias_tensors), any(bias_grads))
            d_bias = [
                g if need and g is not None else _empty(t, t.dtype)
                for g, t, need in zip(grads[3:], bias_tensors, bias_grads, strict=True)
            ]
    dq, dk, dv = grads[0], grads[1], grads[2]
    assert dq is not None and dk is not None and dv is not None
    dq, dk, dv = (
        g if cleaned is x else g.masked_fill(~torch.isfinite(x), 0.0) for g, cleaned, x in zip((dq, dk, dv), (q, k, v), originals, strict=True)
    )
    # contiguous, as the fake kernel says (a gradient cut from a wider accumulator is a view)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), d_sinks.contiguous(), [g.contiguous() for g in d_bias]


@_backward_op.register_fake
def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, shift, rest, sinks, p_sink, rows, nonfinite, mask_tensors, bias_tensors,  # type: ignore[no-untyped-def]
                   mask_spec, bias_spec, scale, softcap, forward_kernel, backward_kernel, sinks_grad, bias_grads, impl):
    d_sinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    d_bias = [t.new_empty(t.shape if need else (0,)) for t, need in zip(bias_tensors, bias_grads, strict=True)]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), d_sinks, d_bias


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]  # torch.library's signature
    q, k, v, sinks, mask_tensors, bias_tensors, mask_spec, bias_spec, scale, softcap, forward_kernel, backward_kernel, need_grad, _ = inputs
    out, lse, shift, rest, p_sink, rows, nonfinite = output
    ctx.mark_non_differentiable(shift, rest, p_sink, rows, nonfinite)
    ctx.save_for_backward(q, k, v, out, lse, shift, rest, p_sink, rows, nonfinite, *(() if sinks is None else (sinks,)), *mask_tensors, *bias_tensors)
    ctx.has_sinks, ctx.mask_count = sinks is not None, len(mask_tensors)
    ctx.sinks_grad = sinks is not None and sinks.requires_grad
    ctx.bias_grads = [t.requires_grad for t in bias_tensors]
    ctx.strings = (mask_spec, bias_spec, scale, softcap, forward_kernel, backward_kernel)
    ctx.need_grad = need_grad


def _backward(ctx, grad_out, grad_lse, grad_shift, grad_rest, grad_p_sink, grad_rows, grad_nonfinite):  # type: ignore[no-untyped-def]
    del grad_shift, grad_rest, grad_p_sink, grad_rows, grad_nonfinite  # saved for the backward, not results: no gradient flows in
    if not ctx.need_grad:
        raise RuntimeError("qkv::blocks_forward ran with need_grad=False, it saved nothing for a backward pass")
    q, k, v, out, lse, shift, rest, p_sink, rows, nonfinite, *saved = ctx.saved_tensors
    sinks = saved.pop(0) if ctx.has_sinks else None
    mask_tensors, bias_tensors = saved[: ctx.mask_count], saved[ctx.mask_count :]
    mask_spec, bias_spec, scale, softcap, forward_kernel, backward_kernel = ctx.strings
    dq, dk, dv, d_sinks, d_bias = torch.ops.qkv.blocks_backward(
        grad_out, grad_lse, q, k, v, out, lse, shift, rest, sinks, p_sink, rows, nonfinite, mask_tensors, bias_tensors, mask_spec,
        bias_spec, scale, softcap, forward_kernel, backward_kernel, ctx.sinks_grad, ctx.bias_grads, _IMPL,
    )
    bias_result = [g if need else None for g, need in zip(d_bias, ctx.bias_grads, strict=True)]
    return dq, dk, dv, d_sinks if ctx.sinks_grad else None, [None] * ctx.mask_count, bias_result, None, None, None, None, None, None, None, None

_forward_op.register_autograd(_backward, setup_context=_setup_context)
