"""`qkv.attention`, `qkv.explain` and `qkv.attention_weights`: validate, then one Plan.

Shape legend (docs/design.md): B batch (any number of leading dims), H query heads, G key/value
heads, L query length, S key length, E q/k head dim, Ev value head dim.

Paths, chosen in one place (`qkv.attention.dispatch.choose_path`):
- ``fused``: PyTorch's scaled_dot_product_attention, the kernels people run.
- ``math``: the explicit formula, scores and weights materialized in float32 or wider.
- ``blocks``: the CPU block engine (`qkv.backends.blocks.engine`): only the tiles a structured mask
  leaves visible are computed, forward and backward.
- ``flex``: PyTorch's FlexAttention with a BlockMask built from the mask's layout
  (`qkv.backends.flex`), for structured masks on CUDA.

Each function validates its inputs (`qkv.attention.problem`), asks `qkv.attention.dispatch` for a Plan, and then
runs it (`qkv.attention.execute`) or describes it (`qkv.attention.explain`); none of them decides anything.
`attention_weights` recomputes the probabilities of chosen heads and rows only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Literal, overload

import torch
from torch.autograd import forward_ad

from qkv._log import note_once
from qkv._private import torch as private_torch
from qkv.attention.bounds import KVBounds
from qkv.attention.dispatch import (
    Backend,
    choose_path,
    decode_widens_itself,
    short_widens_itself,
    weights_plan,
)
from qkv.attention.execute import applies_nan_rule, checks_values_itself, pack, run, run_weights
from qkv.attention.explain import Explanation, explanation
from qkv.attention.nan_rule import affected_rows, finite_problem, poison
from qkv.attention.problem import (
    autocast_dtype,
    check_indices,
    describe_problem,
    scan_magnitudes,
    with_traced_check,
)
from qkv.backends.overflow import memory_order
from qkv.bias import Bias
from qkv.masks import Mask
from qkv.native import magnitude
from qkv.native.machine import compute_dtype, emulation_note, note_computed_wide
from qkv.scores import ScoreMod

__all__ = ["Explanation", "attention", "attention_weights", "explain"]


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = ...,
    *,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    dropout: float = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    backend: Backend = ...,
    kv_bounds: KVBounds | None = ...,
    sinks: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = ...,
    *,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    dropout: float = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    backend: Backend = ...,
    kv_bounds: KVBounds | None = ...,
    sinks: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = ...,
    *,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    dropout: float = ...,
    return_weights: Literal[True],
    return_lse: Literal[False] = ...,
    backend: Backend = ...,
    kv_bounds: KVBounds | None = ...,
    sinks: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = ...,
    *,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    dropout: float = ...,
    return_weights: Literal[True],
    return_lse: Literal[True],
    backend: Backend = ...,
    kv_bounds: KVBounds | None = ...,
    sinks: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = ...,
    *,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    dropout: float = ...,
    return_weights: bool = ...,
    return_lse: bool = ...,
    backend: Backend = ...,
    kv_bounds: KVBounds | None = ...,
    sinks: torch.Tensor | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
    kv_bounds: KVBounds | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention: ``softmax(q k^T * scale + mask) v``, with score terms.

    Per (b, h, i, j) the score is s = scale * q_i . k_j; then softcap * tanh(s / softcap)
    when ``softcap`` is set; then + bias[b, h, i, j]; then score_mod(s, b, h, i, j); then the
    mask removes pairs and each row is softmaxed (docs/design.md).

    Args:
        q: (..., H, L, E) queries.
        k: (..., G, S, E) keys; H must be a multiple of G (grouped-query attention: query
            head h reads key/value head h // (H // G)).
        v: (..., G, S, Ev) values.
        mask: None; a bool tensor broadcastable to (..., H, L, S), True = may attend; a float
            tensor broadcastable to it, added to the scaled scores; or a `qkv.masks` object.
        bias: a `qkv.bias` object (``alibi()``, ``relative(table)``, ``dense(t)``, or a sum of
            them), or a float tensor broadcastable to (..., H, L, S) meaning ``dense(tensor)``.
            Its tensors may require grad.
        softcap: cap the scores smoothly at +-softcap (Gemma 2 uses 50 for attention).
        score_mod: a vectorized fn(score, b, h, q_idx, kv_idx) -> score on broadcasting
            tensors (FlexAttention's contract; b is the flattened batch row, h the query head).
        scale: factor applied to q k^T, any finite real number (a NumPy scalar or a
            one-element tensor without gradient too); default 1 / sqrt(E).
        dropout: probability of dropping an attention weight (applied whenever > 0; modules
            pass 0 in eval mode).
        return_weights: also return the exact probabilities (..., H, L, S) that produced the
            output (after dropout when dropout > 0), in float32 or wider.
        return_lse: also return log sum_j exp(score_ij) (..., H, L), float32 or wider.
        backend: "auto" (default: the first rule of `choose_path` that fires), "fused"
            (SDPA), "math" (the explicit formula), "blocks" (the CPU block engine, `qkv.masks`
            objects only), "flex" (FlexAttention with qkv's BlockMask) or "decode" (L <= 16
            queries, keys split across threads: `qkv.backends.decode`); see `qkv.explain`.
        kv_bounds: what a KV cache knows of k and v (`qkv.KVCache.bounds`): the input checks
            then read q only, not the cache. Used only if it describes exactly these k and v.
        sinks: None, or attention-sink logits (H,) or broadcastable to (..., H), float32 or
            wider, finite, may require grad (gpt-oss): each row's softmax becomes
            exp(s_ij - m) / (exp(sink_h - m) + sum_j exp(s_ij - m)), m the row max over the
            scores and the sink; the sink adds no value, so the weights sum to less than 1,
            and lse includes it. A row with no visible key still gives zeros (lse = -inf).
            'blocks' and 'flex' fold the sink into each row's lse and the math path adds it to
            the softmax denominator; 'auto' takes the block engine from 65,536 pairs per head
            (without a tensor mask or dropout), else the math path; 'fused' (SDPA) refuses.

    Returns:
        output (..., H, L, Ev) in q's dtype, or a tuple (output, weights), (output, lse) or
        (output, weights, lse). A query row that may attend to no key gets a zero output row,
        zero weights, lse = -inf and zero gradients. lse is differentiable on every path
        (d lse_i / d s_ij = p_ij), as are the weights on the paths that return them.

    Numerics, the same on every path:
        - A float mask is added in float32 or wider (float64 for float64 inputs), whatever
          the inputs' dtype: it is never rounded to float16 / bfloat16. It holds finite
          values or -inf (hide); NaN or +inf in it is refused with a ValueError. So is a
          dense bias or a relative table (-inf hides there too) and any non-finite ALiBi slope.
        - Non-finite inputs: a NaN or an infinity in q, k or v makes NaN the output, weights
          and lse of exactly the query rows that read it (a row whose query holds one, and
          every row that may see a key whose k or v holds one); every other row is exact,
          and the NaN rows pass no gradient (`qkv.attention.nan_rule`).
        - Overflow: finite inputs whose scaled scores could leave the accumulation dtype
          (max(1, |scale|) * max_i |q_i| * max_j |k_j|, capped by the softcap, plus the largest
          value the bias adds and the largest mask value, above half of float32's largest
          value 3.4e38, of float64's for float64 inputs) are refused with a ValueError naming
          the bound, as is a softcap beyond the accumulation dtype; float64 inputs hold scores
          up to 1e308.
        - Traced (torch.compile, torch.export, torch.func's vmap / grad / jacrev): under
          torch.compile and torch.export 'auto' takes the CPU block engine where eager would,
          as the operators ``qkv::blocks_forward`` / ``qkv::blocks_backward``, which plan the
          tiles when the graph runs (decided from the mask's Python parameters: a mask without
          tensors by the share its planned tiles compute, as eagerly, a mask given by data by
          size; a score_mod or a
          predicate mask, Python functions, cannot enter an operator and keep to the dense
          paths); backend='blocks' works there too. Everything else, and everything under
          torch.func (the math path) and ONNX exports, keeps to the dense paths (SDPA, the math
          path), whose graphs are tensor operations only, the structured masks reaching them
          as dense masks built from their Python parameters. The NaN rule runs as tensor
          operations, and the refusals (overflow, NaN or +inf in a float mask, bias or sinks)
          run inside the graph (a ``qkv::check`` operator) and raise ValueError, as eagerly,
          when it runs; the block engine's operators apply the NaN rule and refuse an overflow or a
          bad bias themselves when they run, with eager's ValueError. An ONNX graph carries no such check (ONNX has no operator for it).
          backend='flex' and 'decode', and 'blocks' under vmap, plan on the host and refuse to
          be traced, with a ValueError saying so.
        - Determinism: two calls with the same inputs and thread count give bitwise equal
          outputs and gradients (q, k, v and the bias tensors). Across thread counts the
          results may differ in the last bits (PyTorch's kernels split their sums by thread).

    Example:
        >>> import torch, qkv
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
        >>> qkv.attention(q, k, v, qkv.masks.causal()).shape
        torch.Size([2, 4, 5, 3])
    """
    low = autocast_dtype(q)
    if low is not None:
        q, k, v = _cast_for_autocast(low, q, k, v)
        with torch.autocast(q.device.type, enabled=False):
            return attention(
                q, k, v, mask, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale, dropout=dropout,
                return_weights=return_weights, return_lse=return_lse, backend=backend, kv_bounds=kv_bounds,
                sinks=sinks,
            )
    wide = _widened_dtype(q, k, v)
    if wide is not None:
        note_computed_wide(q.dtype, q.device)  # products in q's dtype are emulated on this CPU
        if _widens_itself(
            q, k, v, mask, backend, bias=bias, softcap=softcap, score_mod=score_mod, sinks=sinks, dropout=dropout,
            outputs=return_weights or return_lse,
        ):
            wide = None  # its path reads the inputs in their dtype and computes in float32 itself
    if wide is not None:
        # compute in float32, return q's dtype
        readable = not private_torch.host_unreadable(q, k, v)
        # Whether no autograd graph can keep the float32 copies, which may then live in this
        # thread's kept buffer: with no bias, sinks or score_mod (whose tensors may require grad
        # too), a graph is recorded only when q, k, v or a float mask requires grad; plain
        # values only (no vmap batch, no forward-mode tangent to copy in). The whole
        # call is widened at once: groups of batch rows, widened and computed while in cache,
        # were slower once one pass scans and widens (forced AVX2, B=32 H=12 L=128 E=32, 2
        # threads: 0.74x float32 in 2 MiB groups, 0.93x whole).
        untracked = readable and not _has_tangent(q, k, v) and (
            not torch.is_grad_enabled()
            or (bias is None and score_mod is None and sinks is None and not _any_requires_grad(q, k, v, mask))
        )  # fmt: skip
        scanned = _widened_and_scanned(wide, q, k, v, untracked) if readable else None
        q_max: float | None
        narrow_bounds: KVBounds | None
        kept: torch.Tensor | None
        if scanned is not None:  # one read of q, k and v for their check and their copies
            (q_wide, k_wide, v_wide), kept, (q_max, k_max, v_max) = scanned
            narrow_bounds = KVBounds.of(k, v, k_max, v_max)
        else:
            q_max, narrow_bounds = _narrow_bounds(q, k, v, kv_bounds)
            (q_wide, k_wide, v_wide), kept = _widened(wide, untracked, q, k, v)  # exact copies: the bounds carry over
        try:
            result = _attend(
                q_wide, k_wide, v_wide, mask, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale,
                dropout=dropout, return_weights=return_weights, return_lse=return_lse, backend=backend,
                kv_bounds=None if narrow_bounds is None else narrow_bounds.carried(k, v, k_wide, v_wide), sinks=sinks,
                q_max=q_max, out_dtype=q.dtype,
            )  # fmt: skip
        finally:
            if kept is not None:
                _buffers.wide = kept  # free for this thread's next call
        if isinstance(result, torch.Tensor):
            return result.to(q.dtype)
        return (result[0].to(q.dtype), *result[1:])  # weights and lse stay float32, as for q's dtype
    return _attend(
        q, k, v, mask, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale, dropout=dropout,
        return_weights=return_weights, return_lse=return_lse, backend=backend, kv_bounds=kv_bounds, sinks=sinks,
    )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None,
    *,
    bias: Bias | torch.Tensor | None,
    softcap: float | None,
    score_mod: ScoreMod | None,
    scale: float | None,
    dropout: float,
    return_weights: bool,
    return_lse: bool,
    backend: Backend,
    kv_bounds: KVBounds | None,
    sinks: torch.Tensor | None,
    q_max: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`attention` on inputs in the dtype they are computed in: validate, plan, run, the NaN
    rule. ``q_max``: max |q| when the caller scanned q already (`describe_problem`).
    ``out_dtype``: the dtype the caller rounds the output to, which a path may write directly
    (`qkv.attention.execute.run`); the output comes in it or in q's dtype."""
    problem = describe_problem(
        q, k, v, mask, scale, dropout, bias=bias, softcap=softcap, score_mod=score_mod, kv_bounds=kv_bounds,
        sinks=sinks, q_max=q_max, defer_traced_check=True,
    )
    plan = choose_path(problem, backend, return_weights, return_lse)
    if not checks_values_itself(problem, plan):
        problem = with_traced_check(problem)  # the overflow refusal as graph code, while traced
    widened_by_path = plan.path == "decode" or plan.forward_kernel == "short_wide"
    if not widened_by_path and q.dtype in (torch.bfloat16, torch.float16) and emulation_note(q.dtype, q.device) is not None:
        # kept in an emulated dtype (QKV_KEEP_EMULATED_DTYPES): slower than float32, said once
        dtype, device = q.dtype, q.device
        note_once(f"emulated {dtype} on {device.type}", lambda: emulation_note(dtype, device), logging.WARNING)
    if not problem.nonfinite or applies_nan_rule(problem, plan):
        out, weights, lse = run(problem, plan, out_dtype)
        return pack(problem, out, weights, lse, return_weights, return_lse)
    # the NaN rule (qkv.attention.nan_rule): compute on finite inputs, then NaN the rows that read a bad entry
    rows = affected_rows(problem)  # (N, H, L)
    out, weights, lse = run(finite_problem(problem), plan, out_dtype)
    out, weights, lse = poison(out, rows, False), poison(weights, rows, False), poison(lse, rows, True)
    assert out is not None
    return pack(problem, out, weights, lse, return_weights, return_lse)


def _cast_for_autocast(low: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(low) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in tensors)


# Float32 copies of q, k and v of an emulated low-precision call go into one buffer per
# thread, kept between calls, when no gradient is needed and they fit in this many bytes.
# Fresh full-size copies on every call cost more in first touches (page faults; the
# allocator returns big freed blocks to the system) than in converting: AVX2 tier, one
# thread, causal n = 4,096, 8 heads of 64: 193 ms against float32's 176, 181 ms with the
# kept buffer. The buffer grows to the largest such call seen, up to this limit per thread.
WIDEN_BUFFER_BYTES = 128 << 20
_buffers = threading.local()


def _widens_itself(
    q: torch.Tensor, k: object, v: object, mask: object, backend: Backend, *, bias: object, softcap: float | None,
    score_mod: object, sinks: object, dropout: float, outputs: bool,
) -> bool:
    """Whether an emulated low-precision call takes a path that widens its inputs to float32
    itself, so that `qkv.attention` does not copy them first: a decode step (its cache chunk
    by chunk, `qkv.backends.decode`) or the short-sequence kernel with float32 products (in
    registers, `qkv.native.short_wide`). ``outputs``: weights or lse are asked for."""
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        return False  # the checks name the mistake
    if decode_widens_itself(q, k, mask, backend, scored=score_mod is not None, dropout=dropout, return_weights=outputs):
        return True  # the decode path applies a softcap, no score_mod
    scored = bias is not None or softcap is not None or score_mod is not None or sinks is not None
    return short_widens_itself(q, k, v, mask, backend, scored=scored, dropout=dropout, outputs=outputs)


def _has_tangent(*tensors: torch.Tensor) -> bool:
    """Whether a tensor carries a forward-mode AD tangent (`torch.autograd.forward_ad`)."""
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _any_requires_grad(*values: object) -> bool:
    """Whether any of the tensors among ``values`` requires grad."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in values)


def _widened(
    wide: torch.dtype, untracked: bool, *tensors: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Exact copies of ``tensors`` in ``wide``, and the kept buffer they are views of (None:
    new tensors, ``t.to(wide)`` with their strides). The buffer is used on the CPU when the
    call is ``untracked`` (no autograd graph can save the copies for a backward pass; fresh
    copies of a few MB each would be page-faulted in on every call), each tensor fills
    one block of memory in some order of its dims (`_memory_order`: contiguous, or heads seen
    through a transpose of a projection) and they fit in `WIDEN_BUFFER_BYTES`; each copy has
    its tensor's strides. The buffer is taken from this thread while in use (a nested call,
    from a score_mod say, gets its own) and given back by the caller."""
    if not _buffer_fits(wide, untracked, tensors):
        return tuple(t.to(wide) for t in tensors), None
    buffer, views, _ = _taken_buffer(wide, tensors)
    return tuple(view.copy_(t) for view, t in zip(views, tensors, strict=True)), buffer


def _buffer_fits(wide: torch.dtype, untracked: bool, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the copies of ``tensors`` go into the kept buffer (`_widened`)."""
    itemsize = torch.empty((), dtype=wide).element_size()
    total = sum(t.numel() for t in tensors)
    return (
        untracked and tensors[0].device.type == "cpu" and total * itemsize <= WIDEN_BUFFER_BYTES
        and all(_memory_order(t) is not None for t in tensors)
    )  # fmt: skip


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """The order of t's dims that lays its values out contiguously (`memory_order`), when
    there is one: a contiguous tensor, or a permutation of one such as (N, L, H, E) seen as
    (N, H, L, E). None for a tensor with gaps or overlaps (a slice of a fused projection). A
    copy into a buffer of that layout is then a plain contiguous pass with t's strides."""
    order = memory_order(t)
    return order if t.permute(order).is_contiguous() else None


def _taken_buffer(
    wide: torch.dtype, tensors: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
    """This thread's kept buffer (taken: the caller gives it back), grown to hold ``tensors``
    in ``wide``, its views of their shapes and strides, one after another, and each tensor's
    `_memory_order` (in which both it and its view are contiguous)."""
    total = sum(t.numel() for t in tensors)
    buffer = getattr(_buffers, "wide", None)
    _buffers.wide = None
    # one made under torch.inference_mode cannot be written outside it (and the reverse would
    # hand inference tensors to a graph)
    inference = torch.is_inference_mode_enabled()
    if buffer is None or buffer.numel() < total or buffer.dtype != wide or buffer.is_inference() != inference:
        buffer = torch.empty(total, dtype=wide, device=tensors[0].device)
    views, orders, start = [], [], 0
    for t in tensors:
        order = _memory_order(t)
        assert order is not None  # `_buffer_fits` checked it
        block = buffer[start : start + t.numel()].view([t.shape[d] for d in order])  # t's dims in memory order
        views.append(block.permute(sorted(range(t.ndim), key=order.__getitem__)))  # (*t.shape), t's strides
        orders.append(order)
        start += t.numel()
    return buffer, views, orders


def _widened_and_scanned(
    wide: torch.dtype, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, untracked: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor, tuple[float, float, float]] | None:
    """The float32 copies of bfloat16 q, k and v in the kept buffer (`_widened`), the buffer, and
    max |x| of each (inf when non-finite), from one compiled pass that reads each value once
    (`qkv.native.magnitude.widen_bf16`): the input check's scan and the widening together, where
    both would otherwise read the inputs. None, with nothing taken, when that pass does not
    take them (another dtype, a copy outside the buffer, small or strided tensors, the scan
    switched off or not built here): the caller scans and widens apart."""
    tensors = (q, k, v)
    if wide != torch.float32 or q.dtype != torch.bfloat16 or not _buffer_fits(wide, untracked, tensors):
        return None
    buffer, views, orders = _taken_buffer(wide, tensors)
    found = magnitude.widen_bf16(  # each copy has its tensor's layout: both contiguous in its order
        [t.permute(o) for t, o in zip(tensors, orders, strict=True)],
        [view.permute(o) for view, o in zip(views, orders, strict=True)],
    )
    if found is None:
        _buffers.wide = buffer  # not used: back to this thread
        return None
    q_max, k_max, v_max = found
    return (views[0], views[1], views[2]), buffer, (q_max, k_max, v_max)


def _narrow_bounds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_bounds: KVBounds | None
) -> tuple[float | None, KVBounds | None]:
    """max |q| and the bounds of k and v for a call about to widen them, scanned now in their
    own dtype: half the bytes of the float32 copies, which the input checks would scan
    otherwise (the decisions are the same: the copies are exact). The caller's ``kv_bounds``
    when they describe k and v. (None, None) where the host cannot read the values (torch.compile,
    torch.export, vmap): the checks then run as tensor operations on the copies."""
    if private_torch.host_unreadable(q, k, v):
        return None, None
    if kv_bounds is not None and kv_bounds.describes(k, v):
        (q_max,) = scan_magnitudes((q,))
        return q_max, kv_bounds
    q_max, k_max, v_max = scan_magnitudes((q, k, v))
    return q_max, KVBounds.of(k, v, k_max, v_max)


def _widened_dtype(q: object, k: object, v: object) -> torch.dtype | None:
    """float32 when q, k and v share a low-precision dtype whose products this CPU only emulates
    (`qkv.native.machine.compute_dtype`): the whole call then runs in float32 and its output is
    rounded back once, which is faster there and at least as accurate. None otherwise (mixed
    dtypes are left to the input checks, which name them)."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    assert isinstance(q, torch.Tensor)
    if any(t.dtype != q.dtype or t.device != q.device for t in tensors):  # type: ignore[attr-defined]
        return None
    wide = compute_dtype(q.dtype, q.device)
    return None if wide == q.dtype else wide


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
    measure: bool = False,
    sinks: torch.Tensor | None = None,
) -> Explanation:
    """Say which path `qkv.attention` would take for these arguments, why, and its cost.

    Nothing is computed: the inputs are validated exactly as `attention` does. The score
    terms (bias, softcap, score_mod) are named and their work counted apart. A note says
    when a low-precision dtype has no native products on this CPU: the call then runs in
    float32 (`qkv.native.machine.compute_dtype`) and the Plan described is float32's. With
    ``measure=True`` the machine's float32 and input-dtype matmul rates are measured (once
    per process, a fraction of a second; `qkv.bench.machine_matmul_gflops`) and reported, with the time
    this work would take at that rate.
    """
    low = autocast_dtype(q)
    if low is not None:
        q, k, v = _cast_for_autocast(low, q, k, v)
    stored = q.dtype if isinstance(q, torch.Tensor) else None
    wide = _widened_dtype(q, k, v)
    if wide is not None and not _widens_itself(
        q, k, v, mask, backend, bias=bias, softcap=softcap, score_mod=score_mod, sinks=sinks, dropout=dropout,
        outputs=return_weights or return_lse,
    ):
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
    problem = describe_problem(
        q, k, v, mask, scale, dropout, bias=bias, softcap=softcap, score_mod=score_mod, sinks=sinks
    )
    return explanation(problem, choose_path(problem, backend, return_weights, return_lse), measure, stored=stored)


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | Mask | None = None,
    *,
    heads: Sequence[int] | torch.Tensor | None = None,
    rows: Sequence[int] | slice | range | torch.Tensor | None = None,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact attention probabilities of chosen heads and query rows, and nothing more.

    For a structured mask the scores are recomputed tile by tile, over the non-empty tiles
    of the chosen rows only, first for their log-sum-exp and then as exp(s - lse): the
    memory is that of the answer, whatever L and H. Other masks take the dense path on the
    chosen heads and rows. The result carries no gradient (use ``qkv.attention(...,
    backend="math", return_weights=True)`` to differentiate the weights).

    Args:
        q, k, v, mask, bias, softcap, score_mod, scale: as `qkv.attention` (v is validated
            and otherwise unused).
        sinks: as `qkv.attention`: each head's sink joins every row's denominator, so the
            weights over the keys sum to less than 1 (the sink keeps the rest).
        heads: query head indices, default every head.
        rows: query row indices (a sequence, range, slice or 1-D integer tensor), default
            every row.

    Returns:
        (..., len(heads), len(rows), S) float32 (float64 for float64 inputs). A row that may
        attend to no key is all zeros.

    Example:
        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 4, 1000, 16)
        >>> w = qkv.attention_weights(q, k, v, qkv.masks.sliding_window(8), heads=[2], rows=[0, 500])
        >>> w.shape, int((w[0, 0, 1] > 0).sum())
        (torch.Size([1, 1, 2, 1000]), 9)
    """
    low = autocast_dtype(q)
    if low is not None:
        q, k, v = _cast_for_autocast(low, q, k, v)
        with torch.autocast(q.device.type, enabled=False):
            return attention_weights(
                q, k, v, mask, heads=heads, rows=rows, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale,
                sinks=sinks,
            )
    wide = _widened_dtype(q, k, v)
    if wide is not None:  # the weights are float32 either way; only the products' speed differs
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
    problem = describe_problem(q, k, v, mask, scale, 0.0, bias=bias, softcap=softcap, score_mod=score_mod, sinks=sinks)
    heads_idx = check_indices(heads, problem.H, "heads", q.device)
    rows_idx = check_indices(rows, problem.L, "rows", q.device)
    weights = run_weights(problem, weights_plan(problem), heads_idx, rows_idx)  # (N, h, r, S)
    return weights.reshape(*problem.batch_shape, len(heads_idx), len(rows_idx), problem.S)  # (..., h, r, S)
