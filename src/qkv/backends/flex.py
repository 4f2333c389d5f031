"""FlexAttention with a ``BlockMask`` built from qkv's own block layout (the CUDA path).

PyTorch's FlexAttention (``torch.nn.attention.flex_attention``; qkv uses it from PyTorch 2.6) compiles a
fused kernel that skips the blocks a ``BlockMask`` declares empty, runs "full" blocks
without calling the mask and "partial" blocks with ``mask_mod``. Its own
``create_block_mask`` finds the blocks by evaluating ``mask_mod`` on all L x S points; qkv
already knows them analytically (`Mask.layout`), so the BlockMask is assembled directly
with ``BlockMask.from_kv_blocks``:

- kv_num_blocks / kv_indices (B, H, nQ) / (B, H, nQ, nK): the PARTIAL key blocks of each
  query block, listed first;
- full_kv_num_blocks / full_kv_indices: the FULL ones;
- mask_mod(b, h, q_idx, kv_idx) = ``mask.visible(b, h, q_idx, kv_idx, L, S)``.

Score terms (softcap, a `qkv.bias`, a score_mod) become FlexAttention's own ``score_mod``:
`ScoreTerms.apply` on the scalar indices FlexAttention passes, in docs/design.md's order. The bias
tensors are captured by that function; FlexAttention differentiates captured tensors on CUDA.

A query row with no visible key gets output 0 and lse = -inf here as everywhere in qkv.

References: PyTorch, "FlexAttention: the flexibility of PyTorch with the performance of
FlashAttention" (blog, 2024) and the ``torch.nn.attention.flex_attention`` documentation.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any

import torch

from qkv.backends.softmax import accumulation_bytes
from qkv.masks import FULL, PARTIAL, BlockLayout, Mask
from qkv.native.machine import cpu_features
from qkv.scores import ScoreTerms

__all__ = [
    "FLEX_BLOCK", "FLEX_NEEDS", "block_mask_from_layout", "cpu_kernel_reason", "flex_attention_layout", "flex_available",
    "flex_extra_bytes",
]

# FlexAttention's kernels are tuned for, and its BlockMask defaults to, 128 x 128 tiles.
FLEX_BLOCK = 128

_NEG_INF = float("-inf")


# why qkv cannot use this PyTorch's FlexAttention (`flex_available`)
FLEX_NEEDS = "it needs PyTorch's FlexAttention with BlockMask.from_kv_blocks(seq_lengths=...) (PyTorch >= 2.6)"


@torch.compiler.assume_constant_result
def flex_available() -> bool:
    """Whether this PyTorch's FlexAttention takes the BlockMask qkv builds: one from
    ``BlockMask.from_kv_blocks`` with the true sequence lengths (``seq_lengths``, PyTorch 2.6
    on; qkv's range starts there). PyTorch 2.5 has FlexAttention, but its BlockMask knows only
    whole blocks, and qkv's call failed there with a TypeError from inside. A constant to
    torch.compile."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    from_kv_blocks = getattr(BlockMask, "from_kv_blocks", None)
    return from_kv_blocks is not None and "seq_lengths" in inspect.signature(from_kv_blocks).parameters


# Inductor's CPU kernel for FlexAttention (a C++ template, forward only) came with PyTorch 2.6,
# as did the BlockMask qkv builds (`flex_available`); 'auto' routes to it from the release
# qkv's tests run it on, 2.15 (a failure there is a failed compile, not a slower call, so
# untested releases keep to the math path's chunks); backend='flex', asked for by name, runs
# it wherever it exists
_CPU_KERNEL_SINCE = (2, 15)
# the dtypes it takes
_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_kernel_reason(dtype: torch.dtype | None, *, tested_release: bool = True) -> str | None:
    """Why torch.compile cannot run FlexAttention's CPU kernel for ``dtype`` here, or None.

    Inductor lowers FlexAttention on the CPU to a C++ kernel that skips the BlockMask's empty
    tiles. It has no backward pass and returns no log-sum-exp, and it needs AVX2 vector code:
    PyTorch refuses it on macOS and where its CPU capability is ``DEFAULT``
    (``ATEN_CPU_CAPABILITY=default``). ``tested_release``: also refuse PyTorch releases before
    the one qkv's tests run the kernel on (what 'auto' asks; backend='flex' asks without).
    ``dtype`` None: the machine and the release only."""
    if not flex_available():
        return FLEX_NEEDS
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if tested_release and version < _CPU_KERNEL_SINCE:
        return f"qkv runs Inductor's CPU FlexAttention kernel from PyTorch 2.15 (tested there), this is {torch.__version__}"
    if sys.platform == "darwin":
        return "Inductor has no CPU FlexAttention kernel on macOS"
    capability = cpu_features().capability  # probed at import: a query torch.compile cannot trace
    if capability not in ("AVX2", "AVX512", "AMX"):
        return f"Inductor's CPU FlexAttention kernel needs AVX2 vector code; PyTorch's CPU capability is {capability}"
    return None if dtype is None else _dtype_refusal(dtype)


def _dtype_refusal(dtype: torch.dtype) -> str | None:
    """Why Inductor's CPU kernel cannot take ``dtype``, or None."""
    if dtype in _CPU_KERNEL_DTYPES:
        return None
    return f"Inductor's CPU FlexAttention kernel takes float32, bfloat16 and float16, not {dtype}"


# FlexAttention's compiled GPU kernels are built and tested for these dtypes and for head
# dims that are powers of two from 16 up; 'auto' keeps SDPA (with a dense mask) elsewhere
# rather than betting on a compile that may fail on the user's machine.
_FLEX_AUTO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLEX_AUTO_MIN_HEAD_DIM = 16


def flex_suits(dtype: torch.dtype, head_dims: tuple[int, ...]) -> bool:
    """Whether 'auto' may send a problem of this dtype and these head dims to FlexAttention."""
    powers_of_two = all(d >= _FLEX_AUTO_MIN_HEAD_DIM and d & (d - 1) == 0 for d in head_dims)
    return dtype in _FLEX_AUTO_DTYPES and powers_of_two


def flex_extra_bytes(
    dtype: torch.dtype, *, N: int, H: int, L: int, n_tiles: int, cpu_elements: tuple[int, int] | None = None
) -> int:
    """Memory `flex_attention_layout` allocates beyond inputs and output (an estimate): the
    BlockMask's int32 block indices, two per tile of the layout, and the (N, H, L) lse; on the
    CPU (``cpu_elements``: the elements of q, k and v together, and of the output) no lse, but
    float32 copies of low-precision inputs and a float32 output (`_cpu_kernel`)."""
    indices = n_tiles * 2 * 4
    if cpu_elements is None:
        return N * H * L * accumulation_bytes(dtype) + indices
    inputs, output = cpu_elements
    return (inputs * 4 if dtype != torch.float32 else 0) + output * 4 + indices


def _indices_first(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count and indices of the True key blocks of every row, those first: int32 (..., nQ), (..., nQ, nK)."""
    counts = selected.sum(dim=-1, dtype=torch.int32)  # (B | 1, H | 1, nQ)
    order = torch.argsort((~selected).to(torch.uint8), dim=-1, stable=True)  # True blocks first, in key order
    return counts, order.to(torch.int32)


def block_mask_from_layout(layout: BlockLayout, mask: Mask | None, device: torch.device | str) -> Any:
    """FlexAttention's BlockMask for ``mask`` from its layout, without evaluating every point."""
    from torch.nn.attention.flex_attention import BlockMask

    states = layout.states.to(device)  # (B | 1, H | 1, nQ, nK)
    kv_num_blocks, kv_indices = _indices_first(states == PARTIAL)
    full_num_blocks, full_indices = _indices_first(states == FULL)
    L, S = layout.L, layout.S
    mask_mod = None
    if mask is not None:
        structured = mask
        # a mask without a batch (heads) axis is evaluated at b = 0 (h = 0) on every path, as
        # `Mask.to_dense` does: a predicate that reads h without heads=H is one mask for all heads
        one_row, one_head = states.shape[0] == 1, states.shape[1] == 1

        def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            b = torch.zeros_like(b) if one_row else b
            h = torch.zeros_like(h) if one_head else h
            return structured.visible(b, h, q_idx, kv_idx, L, S)

        mask_mod = visible

    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, full_num_blocks, full_indices,
        BLOCK_SIZE=(layout.block_q, layout.block_k), mask_mod=mask_mod, seq_lengths=(L, S),
    )


@functools.cache
def _compiled_flex() -> Any:
    """flex_attention compiled once per process; a new sequence length recompiles once, with
    symbolic sizes (torch.compile's automatic dynamic shapes), then no more."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_attention_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | None,
    layout: BlockLayout,
    scale: float,
    *,
    need_lse: bool = True,
    compiled: bool = True,
    terms: ScoreTerms | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention on q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) with qkv's layout.

    Returns (output (N, H, L, Ev), lse (N, H, L) float32 with -inf on rows with no visible
    key, or None without ``need_lse``: compiled FlexAttention on CPU returns no lse).
    ``compiled=False`` runs FlexAttention's eager reference (for checks on small sizes). While
    torch.compile traces a CPU call, FlexAttention's own call runs, which Inductor compiles to
    its CPU kernel (`_cpu_kernel`). ``terms``: the score terms, applied as FlexAttention's score_mod.
    """
    from torch.nn.attention import flex_attention as fa

    traced = torch.compiler.is_compiling()
    on_cpu_kernel = q.device.type == "cpu" and (compiled or traced)
    refusal = _dtype_refusal(q.dtype) if on_cpu_kernel else None
    if refusal is not None:  # backend='flex' asked for by name ('auto' checks `cpu_kernel_reason`); before any work
        raise ValueError(f"backend='flex' on the CPU runs Inductor's FlexAttention kernel: {refusal}; use backend='blocks' or 'auto'")
    block_mask = block_mask_from_layout(layout, mask, q.device)
    gqa = k.shape[1] != q.shape[1]
    score_mod = None
    if terms is not None and terms.active:
        # the softcap rides along as a tensor: FlexAttention traces its score_mod with dynamo,
        # which turns a captured Python float into a symbolic float once it recompiles for new
        # sizes, and FlexAttention accepts tensors and ints there, not symbolic floats
        cap = None if terms.softcap is None else torch.tensor(terms.softcap, dtype=torch.float64, device=q.device)
        rest = dataclasses.replace(terms, softcap=None)

        def apply_terms(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            if cap is not None:  # first, as ScoreTerms.apply orders the terms
                softcap = cap.to(score.dtype)
                score = torch.tanh(score / softcap) * softcap
            return rest.apply(score, b, h, q_idx, kv_idx)

        score_mod = apply_terms

    kwargs: dict[str, Any] = {"block_mask": block_mask, "scale": scale, "enable_gqa": gqa, "score_mod": score_mod}
    if on_cpu_kernel:
        assert not need_lse  # Inductor's CPU kernel returns none
        return _cpu_kernel(q, k, v, kwargs, traced), None
    run = _compiled_flex() if compiled else fa.flex_attention
    if not need_lse:
        return run(q, k, v, **kwargs), None
    if hasattr(fa, "AuxRequest"):
        out, aux = run(q, k, v, return_aux=fa.AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:
        out, lse = run(q, k, v, return_lse=True, **kwargs)
    assert lse is not None  # asked for
    empty = lse == _NEG_INF  # (N, H, L)
    out = torch.where(empty.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=out.device), out)
    return out, lse.float()


def _cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any], traced: bool) -> torch.Tensor:
    """FlexAttention on Inductor's CPU kernel, in float32: with bfloat16 inputs that kernel
    miscomputes a score_mod that casts its result (PyTorch 2.15: ``.to(score.dtype)``, which
    qkv's score terms end with, gave outputs 1.2 off against 0.003 without the cast, n = 1,024),
    and the float32 kernel ran faster there too (8 documents, n = 4,096: 10 against 16 ms, AMD
    EPYC without AMX). The output comes back in the inputs' dtype. ``traced``: torch.compile is
    tracing the caller, whose graph takes FlexAttention's own call, through `_flex_output`;
    else the kernel compiled once per process (`_compiled_flex`)."""
    from torch.nn.attention.flex_attention import flex_attention

    dtype = q.dtype  # one `_dtype_refusal` accepts (`flex_attention_layout`)
    q, k, v = q.float(), k.float(), v.float()  # (N, H | G, L | S, E | Ev) each, as given
    if traced:
        return torch.ops.qkv.flex_output(flex_attention(q, k, v, **kwargs)).to(dtype)
    return _compiled_flex()(q, k, v, **kwargs).to(dtype)


@torch.library.custom_op("qkv::flex_output", mutates_args=())
def _flex_output(out: torch.Tensor) -> torch.Tensor:
    """A copy of FlexAttention's output, made by an operator of its own in a traced CPU graph.

    Inductor fuses pointwise work that reads the output of its CPU FlexAttention kernel (qkv's
    NaN rule, a cast, the caller's own code) into that kernel, whose C++ template then refuses
    to render it: "Unsupported for `epilogue_nodes` in CppFlexAttentionTemplate" (PyTorch
    2.15), a failed compile. An operator's output is a buffer of its own, which nothing fuses
    into the kernel; the copy costs one pass over (N, H, L, Ev)."""
    return out.clone()


@_flex_output.register_fake
def _(out: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(out)
