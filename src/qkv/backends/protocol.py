"""One protocol for the backends, and the names of the kernels a `Plan` records.

Every backend answers the same few questions (`Backend`): its ``name`` (the ``backend=``
string of `qkv.attention`), why it cannot take a problem (`unavailable_reason`, None when it
can), its ``forward`` (the entry point `qkv.attention.execute` calls), the memory it allocates
beyond inputs and output (`extra_memory`, an estimate in bytes) and itself in words
(`describe`). `BACKENDS` holds one per path; `qkv.attention.dispatch.choose_path` asks them
once and records its answer in the Plan.

Inside a path, the kernel that runs forward and the one autograd runs backward are decided
once too, by ``choose_path`` from the compiled kernels' ``unavailable_reason``, and recorded
in ``Plan.forward_kernel`` / ``Plan.backward_kernel`` by the short names of `FORWARD_KERNELS`
and `BACKWARD_KERNELS`; execution runs the kernels named there, and `qkv.explain` prints
their words (`kernel_words`). A compiled kernel whose build or self-check fails at its first
use (which explain cannot know without building) falls back to its path's portable kernel
for that call; the failure is then part of the kernel's reason, and later plans name the
portable kernel.

`qkv.backends.disabled(*names)` switches kernels and backends off (`qkv.native.switches`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from qkv.backends import decode as decode_module
from qkv.backends.blocks.diagonals import fused_terms_reason
from qkv.backends.blocks.engine import block_attention, engine_extra_bytes
from qkv.backends.blocks.planner import BlockConfig, BlockPlan
from qkv.backends.blocks.scored import scored_block_attention
from qkv.backends.dense import (
    flash_kernel_available,
    fused_attention,
    fused_extra_bytes,
    math_attention,
    math_extra_bytes,
)
from qkv.backends.flex import (
    FLEX_BLOCK,
    FLEX_NEEDS,
    cpu_kernel_reason,
    flex_attention_layout,
    flex_available,
    flex_extra_bytes,
)
from qkv.masks import Mask
from qkv.native import build as compiled
from qkv.native import decode as native_decode
from qkv.native import interval_bf16, interval_bf16_backward, short_bf16, short_wide, switches
from qkv.scores import ScoreTerms

if TYPE_CHECKING:  # types only: the attention layer sits above this one
    from qkv.attention.problem import AttentionProblem

__all__ = [
    "BACKENDS",
    "BACKWARD_KERNELS",
    "COMPILED_KERNELS",
    "FORWARD_KERNELS",
    "Backend",
    "decode_kernel",
    "decode_reason",
    "flex_cpu_elements",
    "kernel_words",
]

# The kernels a Plan can name forward, in words (`qkv.explain` adds why a faster one does not run).
FORWARD_KERNELS: dict[str, str] = {
    "sdpa": "PyTorch's SDPA",
    "short_bf16": f"the {short_bf16.KERNEL_NAME} (C++, AMX tiles)",
    "short_wide": f"the {short_wide.KERNEL_NAME} (C++, built for this CPU's tier)",
    "math": "the explicit formula in PyTorch ops",
    "math_chunks": "the explicit formula in PyTorch ops by chunks of query rows, each under activation checkpointing",
    "flex": "FlexAttention with qkv's BlockMask",
    "decode": "the split-key decode kernel in PyTorch ops",
    "native_decode": f"the {native_decode.KERNEL_NAME} (C++, split keys, softcap, ALiBi, paged pools, built for this CPU's tier)",
    "interval_bf16": f"the {interval_bf16.KERNEL_NAME} (C++, built for this CPU's tier: products on AMX tiles or AVX-512 BF16)",
    "cpu_flash_tiles": "PyTorch's CPU flash kernel per tile",
    # the block engine with score terms: a bias alone on PyTorch's CPU flash kernel with a bias
    # tile (qkv's tile kernel for rows whose bias offset is huge); softcap or score_mod on qkv's tile kernel
    "bias_tiles": "PyTorch's CPU flash kernel per tile with the bias as its float mask",
    "score_tiles": "qkv's tile kernel with the score terms applied per tile",
    # `qkv.attention_weights`: the probabilities recomputed, no output
    "weights_tiles": "the probabilities recomputed tile by tile",
    "weights_dense": "the probabilities from the dense formula",
}
# ... and backward ("none": the forward kernel has none; it is chosen only without a gradient).
BACKWARD_KERNELS: dict[str, str] = {
    "none": "none (no gradient is needed)",
    "sdpa": "PyTorch's SDPA backward",
    "sdpa_wide": "PyTorch's CPU flash backward on float32 copies of the bf16 inputs, gradients rounded to bf16",
    "math": "autograd through the explicit formula",
    "math_chunks": "autograd through each chunk's formula, recomputed from the chunk's inputs",
    "flex": "FlexAttention's backward",
    "decode": "autograd through the decode kernel's ops",
    "interval_bf16_backward": f"the {interval_bf16_backward.KERNEL_NAME} (C++, built for this CPU's tier: products on AMX tiles or AVX-512 BF16)",
    "engine_per_call": "the engine's backward per call: bf16 products or PyTorch's flash backward on float32 copies",
    "scored_per_call": "the engine's backward per call, with the score terms recomputed under autograd",
}
# the compiled kernels among them, by their modules (their one build attempt gives the
# "built on first use" note)
COMPILED_KERNELS: dict[str, Any] = {
    "short_bf16": short_bf16,
    "short_wide": short_wide,
    "interval_bf16": interval_bf16,
    "interval_bf16_backward": interval_bf16_backward,
    "native_decode": native_decode,
}
# the compiled kernel that a portable one stands in for (`Plan.forward_absent` says why)
_STANDS_IN_FOR = {
    "decode": "native_decode", "sdpa": "short_bf16", "short_wide": "short_bf16", "cpu_flash_tiles": "interval_bf16",
    "engine_per_call": "interval_bf16_backward",
}  # fmt: skip


def kernel_words(name: str, absent: str | None = None, absent_kernel: str | None = None) -> str:
    """Kernel ``name`` in words (`qkv.explain`'s kernel lines); ``absent``: the Plan's reason
    why the compiled kernel that ``name`` stands in for (``absent_kernel``, else the usual
    one) does not run."""
    words = FORWARD_KERNELS.get(name) or BACKWARD_KERNELS[name]
    module = COMPILED_KERNELS.get(name)
    if module is not None:  # a kernel built per tier says its own note
        words += module.first_use_note() if hasattr(module, "first_use_note") else compiled.first_use_note(module.build_state())
    if absent is not None:
        words += f" (the {COMPILED_KERNELS[absent_kernel or _STANDS_IN_FOR[name]].KERNEL_NAME} does not run: {absent})"
    return words


@runtime_checkable
class Backend(Protocol):
    """What every backend answers (`BACKENDS`)."""

    @property
    def name(self) -> str:
        """The ``backend=`` string of `qkv.attention` that asks for it."""
        ...

    def unavailable_reason(self, problem: AttentionProblem) -> str | None:
        """Why this backend cannot take ``problem``, or None when it can."""
        ...

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Its entry point, as `qkv.attention.execute` calls it for a Plan of this path."""
        ...

    def extra_memory(self, problem: AttentionProblem) -> int:
        """Bytes it allocates beyond inputs and output for ``problem`` (an estimate)."""
        ...

    def describe(self, problem: AttentionProblem) -> str:
        """Itself in words for ``problem``, with why not when it cannot take it."""
        ...


@dataclass(frozen=True)
class _Adapter:
    """A backend as the protocol asks, over functions of its module."""

    name: str
    words: str
    reason: Callable[[AttentionProblem], str | None]
    memory: Callable[[AttentionProblem], int]
    entry: Callable[..., Any]

    def unavailable_reason(self, problem: AttentionProblem) -> str | None:
        return self.reason(problem)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.entry(*args, **kwargs)

    def extra_memory(self, problem: AttentionProblem) -> int:
        return self.memory(problem)

    def describe(self, problem: AttentionProblem) -> str:
        why = self.reason(problem)
        return self.words if why is None else f"{self.words} (it does not run: {why})"


def _no_reason(problem: AttentionProblem) -> str | None:
    return None


def _grad(problem: AttentionProblem) -> bool:
    inputs = (problem.q, problem.k, problem.v, *problem.terms.tensors())
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


def _blocks_reason(problem: AttentionProblem) -> str | None:
    if switches.is_off("blocks"):
        return switches.off_reason("blocks")
    if problem.q.device.type != "cpu":
        return f"it is the CPU block engine, the inputs are on {problem.q.device}"
    if not flash_kernel_available():
        return "it needs PyTorch's CPU flash-attention kernel (PyTorch >= 2.3)"
    if isinstance(problem.mask, torch.Tensor):
        return "it takes a qkv.masks object or None, not a tensor mask"
    if problem.dropout > 0.0:
        return f"it has no dropout (got dropout={problem.dropout})"
    return None


def _flex_reason(problem: AttentionProblem) -> str | None:
    if switches.is_off("flex"):
        return switches.off_reason("flex")
    if not flex_available():
        return FLEX_NEEDS
    if isinstance(problem.mask, torch.Tensor):
        return "it takes a qkv.masks object or None, not a tensor mask"
    if problem.dropout > 0.0:
        return f"it has no dropout (got dropout={problem.dropout})"
    if problem.q.device.type == "cpu":
        if _grad(problem):
            return "FlexAttention has no backward pass on CPU"
        return cpu_kernel_reason(problem.q.dtype, tested_release=False)
    return None


def decode_reason(problem: AttentionProblem) -> str | None:
    """Why the decode kernel cannot take ``problem`` (weights aside: it returns none)."""
    terms = problem.terms
    if switches.is_off("decode"):
        return switches.off_reason("decode")
    if problem.L > decode_module.MAX_QUERIES:
        return f"it takes at most {decode_module.MAX_QUERIES} queries, got L={problem.L}"
    if not decode_module.supports_mask(problem.mask):
        return f"it applies no mask, causal(), sliding_window() or key_padding() only, got {problem.mask_kind}"
    if terms.score_mod is not None:
        return f"it applies a softcap and a bias only, got {terms.describe()}"
    if problem.dropout > 0.0:
        return f"it has no dropout (got dropout={problem.dropout})"
    return None


def decode_kernel(problem: AttentionProblem) -> tuple[str, str | None]:
    """The decode path's forward kernel for ``problem`` and why the compiled one does not run:
    ("native_decode", None) or ("decode", the reason)."""
    why = decode_module.native_reason(problem.q, problem.k, problem.v, problem.terms, _grad(problem))
    return ("decode", why) if why is not None else ("native_decode", None)


def _math_memory(problem: AttentionProblem) -> int:
    return math_extra_bytes(problem.q.dtype, N=problem.N, H=problem.H, L=problem.L, S=problem.S)


def _fused_memory(problem: AttentionProblem) -> int:
    q = problem.q
    return fused_extra_bytes(q.dtype, q.device, N=problem.N, H=problem.H, L=problem.L, S=problem.S, Ev=problem.Ev)


def _decode_memory(problem: AttentionProblem) -> int:
    return decode_module.decode_extra_bytes(
        problem.q.dtype, N=problem.N, H=problem.H, L=problem.L, S=problem.S, Ev=problem.Ev,
        splits=decode_module.default_splits(problem.S),
    )


def _tiles(problem: AttentionProblem, block_q: int, block_k: int) -> int:
    """Tiles of the mask's layout, counted from its batch and heads (no layout is made)."""
    mask = problem.mask
    batch, heads = (mask.batch or 1, mask.heads or 1) if isinstance(mask, Mask) else (1, 1)
    return batch * heads * -(-problem.L // block_q) * -(-problem.S // block_k)


def _blocks_memory(problem: AttentionProblem) -> int:
    """Without its plan: one call's temporaries at most and the layout (`engine_extra_bytes`);
    `qkv.explain` counts a Plan's own calls."""
    config = BlockConfig()
    return engine_extra_bytes(
        problem.q.dtype, N=problem.N, H=problem.H, G=problem.G, L=problem.L, S=problem.S, E=problem.E, Ev=problem.Ev,
        plan=None, call_bytes=config.call_bytes, n_tiles=_tiles(problem, config.block_q, config.block_k),
        mask_heads=1, reuses_tiles=False, score_terms=problem.terms.active,
    )


def _flex_memory(problem: AttentionProblem) -> int:
    n_tiles = _tiles(problem, FLEX_BLOCK, FLEX_BLOCK)
    return flex_extra_bytes(problem.q.dtype, N=problem.N, H=problem.H, L=problem.L, n_tiles=n_tiles,
                            cpu_elements=flex_cpu_elements(problem))  # fmt: skip


def flex_cpu_elements(problem: AttentionProblem) -> tuple[int, int] | None:
    """For `flex_extra_bytes` on the CPU: the elements of q, k and v together, and of the output."""
    if problem.q.device.type != "cpu":
        return None
    inputs = problem.q.numel() + problem.k.numel() + problem.v.numel()
    return inputs, problem.N * problem.H * problem.L * problem.Ev


def _blocks_entry(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | None, plan: BlockPlan, scale: float,
    terms: ScoreTerms | None = None, forward_kernel: str | None = None, backward_kernel: str = "engine_per_call",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine (`block_attention`), with score terms on their own kernels (`scored_block_attention`)
    unless the fused bf16 interval kernels are named (``forward_kernel="interval_bf16"``) and can
    apply them; named for terms they cannot apply, the scored engine's kernels take them."""
    active = terms is not None and terms.active
    fused = forward_kernel == "interval_bf16" and terms is not None and fused_terms_reason(terms, torch.is_grad_enabled()) is None
    if active and not fused:
        assert terms is not None
        scored = None if forward_kernel == "interval_bf16" else forward_kernel
        return scored_block_attention(q, k, v, mask, plan, scale, terms, forward_kernel=scored)
    return block_attention(
        q, k, v, mask, plan, scale, forward_kernel=forward_kernel or "cpu_flash_tiles", backward_kernel=backward_kernel,
        terms=terms if active else None,
    )  # fmt: skip


# One per path of `qkv.attention.dispatch` ("fused" is PyTorch's SDPA, with the short-sequence
# bf16 kernel as one of its kernels).
BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        _Adapter("fused", "PyTorch's scaled_dot_product_attention", _no_reason, _fused_memory, fused_attention),
        _Adapter("math", "the explicit formula in PyTorch ops", _no_reason, _math_memory, math_attention),
        _Adapter("blocks", "the CPU block engine", _blocks_reason, _blocks_memory, _blocks_entry),
        _Adapter("flex", "FlexAttention with qkv's BlockMask", _flex_reason, _flex_memory, flex_attention_layout),
        _Adapter("decode", "the split-key decode kernel", decode_reason, _decode_memory, decode_module.decode_attention),
    )
}
