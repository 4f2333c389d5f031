"""FlexAttention with a ``BlockMask`` built from qkv's own block layout (the CUDA path).

PyTorch's FlexAttention (``torch.nn.attention.flex_attention``, PyTorch >= 2.5) compiles a
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
from typing import Any

import torch

from qkv.backends.softmax import accumulation_bytes
from qkv.masks import FULL, PARTIAL, BlockLayout, Mask
from qkv.scores import ScoreTerms

__all__ = ["FLEX_BLOCK", "block_mask_from_layout", "flex_attention_layout", "flex_available", "flex_extra_bytes"]

# FlexAttention's kernels are tuned for, and its BlockMask defaults to, 128 x 128 tiles.
FLEX_BLOCK = 128

_NEG_INF = float("-inf")


def flex_available() -> bool:
    """Whether this PyTorch ships FlexAttention with ``BlockMask.from_kv_blocks``."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


# FlexAttention's compiled GPU kernels are built and tested for these dtypes and for head
# dims that are powers of two from 16 up; 'auto' keeps SDPA (with a dense mask) elsewhere
# rather than betting on a compile that may fail on the user's machine.
_FLEX_AUTO_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLEX_AUTO_MIN_HEAD_DIM = 16


def flex_suits(dtype: torch.dtype, head_dims: tuple[int, ...]) -> bool:
    """Whether 'auto' may send a problem of this dtype and these head dims to FlexAttention."""
    powers_of_two = all(d >= _FLEX_AUTO_MIN_HEAD_DIM and d & (d - 1) == 0 for d in head_dims)
    return dtype in _FLEX_AUTO_DTYPES and powers_of_two


def flex_extra_bytes(dtype: torch.dtype, *, N: int, H: int, L: int, n_tiles: int) -> int:
    """Memory `flex_attention_layout` allocates beyond inputs and output (an estimate): the
    (N, H, L) lse and the BlockMask's int32 block indices, two per tile of the layout."""
    acc = accumulation_bytes(dtype)
    return N * H * L * acc + n_tiles * 2 * 4


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

        def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
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
    ``compiled=False`` runs FlexAttention's eager reference (for checks on small sizes).
    ``terms``: the score terms, applied as FlexAttention's score_mod.
    """
    from torch.nn.attention import flex_attention as fa

    block_mask = block_mask_from_layout(layout, mask, q.device)
    run = _compiled_flex() if compiled else fa.flex_attention
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
