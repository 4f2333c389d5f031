"""qkv's entry in transformers' ``AttentionInterface``: one attention call of any layer.

transformers calls ``fn(module, query, key, value, attention_mask, dropout=, scaling=, ...)``
with query (B, H, L, E), key (B, G, S, E), value (B, G, S, Ev), and expects
(output (B, L, H, Ev), weights (B, H, L, S) or None). Here that call becomes one
`qkv.attention` call: grouped-query heads go in as they are (no repeat), the mask comes from
qkv's mask interface as a `StructuredMask` (or as a tensor a caller built), and when the
model was asked for ``output_attentions`` the exact probabilities come back from the same
path (for the block engine: recomputed tile by tile from its log-sum-exp).

Score terms go to qkv as they are: Gemma 2's ``softcap`` (logit soft-capping) as
``softcap=``, T5's ``position_bias`` (its relative attention bias, (B | 1, H, L, S), added to
the scaled scores) as ``bias=``, differentiable; the mask stays structured.

gpt-oss's attention sinks (``s_aux``, one logit per head in every row's denominator) go to
qkv as ``sinks=``, in float32 when the model's are narrower (qkv keeps sinks float32 or
wider); their gradient reaches the model's parameter.

A cache wrapped by `track_bounds` notes running bounds on what it returns; those tensors then
reach `qkv.attention` with ``kv_bounds``, and a decoding step's input checks skip the cache.
The first call of each attention module installs a forward pre-hook on it that wraps the
model's own DynamicCache / StaticCache from its next forward on (`track_module_cache`): without it, every decoding
step scanned the whole cache twice (max |k|, max |v|), which at 8k tokens took longer than
the attention itself.

What is refused, with a message, before any work: masks of a type qkv does not take.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qkv import masks
from qkv._private.transformers import attentions_collected, registered_attention
from qkv.attention.functional import attention, explain
from qkv.integrations.transformers._bounds import noted_bounds, track_module_cache
from qkv.integrations.transformers._masks import StructuredMask
from qkv.masks import Mask

if TYPE_CHECKING:
    from collections.abc import Iterator

    from qkv.attention.functional import Explanation

__all__ = ["AttentionCall", "HeadInputs", "attention_forward", "capturing", "recording"]


@dataclass(frozen=True)
class AttentionCall:
    """One attention call as `recording` saw it: which layer, what mask, and what qkv ran."""

    layer_idx: int | None  # the module's layer_idx, when it has one
    module: str  # the attention module's class name
    mask_source: str  # what transformers asked for ("causal, padding", "sliding window 1024" ...)
    recognised: bool  # False: transformers' mask was not recognised and ran as a dense mask
    explanation: Explanation  # qkv.explain for the call: path, reason, work, memory


_recorder: ContextVar[list[AttentionCall] | None] = ContextVar("qkv_transformers_recorder", default=None)


@contextmanager
def recording() -> Iterator[list[AttentionCall]]:
    """Record every attention call that runs on qkv inside the block.

    >>> from qkv.integrations.transformers import recording
    >>> with recording() as calls:
    ...     pass  # model(**inputs)
    >>> calls
    []
    """
    calls: list[AttentionCall] = []
    token = _recorder.set(calls)
    try:
        yield calls
    finally:
        _recorder.reset(token)


@dataclass(frozen=True)
class HeadInputs:
    """What one attention call worked on, for batch row 0, as `capturing` keeps it: the
    per-head queries, keys (after any rotary embedding) and values, the scale, which pairs
    were visible, and the score terms beyond scale * q.k."""

    layer_idx: int | None
    q: torch.Tensor  # (H, L, E) float32 on the CPU
    k: torch.Tensor  # (G, S, E)
    v: torch.Tensor  # (G, S, Ev)
    scale: float
    allowed: torch.Tensor | None  # (L, S) bool, True = may attend; None = every pair
    terms: tuple[str, ...]  # score terms the four steps lack ("soft-capping at 50.0", ...)


_captured: ContextVar[list[HeadInputs] | None] = ContextVar("qkv_transformers_captured", default=None)


@contextmanager
def capturing() -> Iterator[list[HeadInputs]]:
    """Keep every qkv attention call's per-head q, k, v inside the block (`HeadInputs`): what
    `inspect` stores so that `Inspection.steps` can replay a row. Copies batch row 0 only."""
    kept: list[HeadInputs] = []
    token = _captured.set(kept)
    try:
        yield kept
    finally:
        _captured.reset(token)


def _visible_pairs(mask: Mask | torch.Tensor | None, L: int, S: int) -> tuple[torch.Tensor | None, tuple[str, ...]]:
    """Batch row 0 / head 0 of ``mask`` as (L, S) bool, and the terms it adds beyond hiding pairs."""
    if mask is None:
        return None, ()
    if isinstance(mask, Mask):
        dense = mask.to_dense(L, S)  # (B | 1, H | 1, L, S)
    elif mask.dtype == torch.bool:
        dense = mask
    else:  # a float mask is added to the scores: -inf hides a pair, any other value is a bias
        finite = mask[torch.isfinite(mask)]
        terms = ("a float mask that adds values to the scores",) if bool((finite != 0).any()) else ()
        dense = mask != float("-inf")
        return torch.broadcast_to(dense, (*dense.shape[:-2], L, S)).reshape(-1, L, S)[0].cpu(), terms
    return torch.broadcast_to(dense, (*dense.shape[:-2], L, S)).reshape(-1, L, S)[0].cpu(), ()


def _capture(
    kept: list[HeadInputs], module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: Mask | torch.Tensor | None, scaling: float | None, softcap: float | None, position_bias: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> None:
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    allowed, terms = _visible_pairs(mask, L, S)
    if softcap is not None:
        terms = (*terms, f"soft-capping of the scores at {float(softcap):g}")
    if position_bias is not None:
        terms = (*terms, "a position bias added to the scores")
    if sinks is not None:
        terms = (*terms, "an attention sink per head in every row's denominator")
    as_kept = lambda x: x.detach()[0].to("cpu", torch.float32).clone()  # noqa: E731  batch row 0
    kept.append(HeadInputs(
        getattr(module, "layer_idx", None), as_kept(query), as_kept(key), as_kept(value),
        1.0 / math.sqrt(E) if scaling is None else float(scaling), allowed, terms,
    ))


def _attentions_requested(kwargs: dict[str, object]) -> bool:
    """Whether the model will return this call's weights: ``output_attentions`` reaches the
    attention function in some models only (GPT-2 drops it), so the output collector of
    transformers' ``capture_outputs`` is read as well."""
    return bool(kwargs.get("output_attentions")) or attentions_collected()


def _sinks(s_aux: object) -> torch.Tensor | None:
    """gpt-oss's sinks (H,) for qkv.attention: float32 or wider (a bf16 model's are widened,
    differentiably)."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor):
        raise TypeError(f"s_aux (attention sinks) must be a tensor (H,), got {type(s_aux).__name__}")
    return s_aux if s_aux.dtype in (torch.float32, torch.float64) else s_aux.float()


def _qkv_mask(
    attention_mask: StructuredMask | torch.Tensor | None, module: torch.nn.Module, is_causal: bool | None, L: int, S: int
) -> tuple[Mask | torch.Tensor | None, str, bool]:
    """(mask for qkv.attention, what it came from, whether it was recognised)."""
    if isinstance(attention_mask, StructuredMask):
        if (attention_mask.q_length, attention_mask.kv_length) != (L, S):
            raise ValueError(
                f"the mask was built for {attention_mask.q_length} queries and {attention_mask.kv_length} keys, "
                f"the layer has L={L} queries and S={S} keys"
            )
        return attention_mask.mask, attention_mask.source, attention_mask.recognised
    if isinstance(attention_mask, torch.Tensor):
        # a 4-D mask the caller built (bool: True = attend; float: added to the scores)
        return attention_mask, f"a {attention_mask.dtype} tensor {tuple(attention_mask.shape)} built by the caller", False
    if attention_mask is not None:
        raise TypeError(
            f"attn_implementation='qkv' takes the masks of qkv's mask interface or a 4-D tensor, got "
            f"{type(attention_mask).__name__}; was the model's mask built for another implementation?"
        )
    # no mask: sdpa's rule, is_causal from the call or the module, top-left, and off for one query
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if causal and L > 1:
        return masks.causal(align="top-left"), "causal (no mask given; the module is causal)", True
    return None, "no mask", True


def _track_cache(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """The forward pre-hook of an attention module: its cache gets running bounds while the
    module runs on qkv (switched to another implementation, the cache is left alone)."""
    del args
    config = getattr(module, "config", None)
    if registered_attention(str(getattr(config, "_attn_implementation", ""))) is attention_forward:
        track_module_cache(kwargs)


def _hook_once(module: torch.nn.Module) -> None:
    """Install `_track_cache` on the module, once (its flag travels with the module)."""
    if getattr(module, "_qkv_tracks_caches", False) or torch.compiler.is_compiling():
        return
    module.register_forward_pre_hook(_track_cache, with_kwargs=True)
    module._qkv_tracks_caches = True  # type: ignore[assignment]


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: StructuredMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention for a transformers layer on qkv.

    Args:
        module: the calling attention module (its ``is_causal`` and ``layer_idx`` are read).
        query: (B, H, L, E); key: (B, G, S, E); value: (B, G, S, Ev); H a multiple of G.
        attention_mask: a `StructuredMask` from qkv's mask interface, None, or a 4-D bool /
            float tensor (B | 1, 1 | H, L, S) built by the caller.
        dropout: attention dropout probability (the model passes 0 in eval mode).
        scaling: the score scale; default 1 / sqrt(E).
        is_causal: sdpa's flag, used only when no mask is given.
        softcap: cap the scores at +-softcap (Gemma 2's attn_logit_softcapping), or None.
        position_bias: an additive bias (B | 1, H, L, S) such as T5's, or None.
        s_aux: attention sinks (H,) (gpt-oss), or None.
        kwargs: the model's other keywords (``sliding_window``, ``position_ids``,
            ``output_attentions`` ...): the mask already carries what they say.

    Returns:
        output (B, L, H, Ev) in query's dtype, and the exact probabilities (B, H, L, S) in
        query's dtype when the model returns attentions, else None.
    """
    sinks = _sinks(s_aux)
    _hook_once(module)
    L, S = query.shape[-2], key.shape[-2]
    mask, source, recognised = _qkv_mask(attention_mask, module, is_causal, L, S)
    want_weights = _attentions_requested(kwargs)
    kept = _captured.get()
    if kept is not None:
        _capture(kept, module, query, key, value, mask, scaling, softcap, position_bias, sinks)
    calls = _recorder.get()
    if calls is not None:
        explanation = explain(
            query, key, value, mask, bias=position_bias, softcap=softcap, scale=scaling, dropout=dropout,
            return_weights=want_weights, sinks=sinks,
        )
        calls.append(AttentionCall(getattr(module, "layer_idx", None), type(module).__name__, source, recognised, explanation))
    result = attention(
        query, key, value, mask, bias=position_bias, softcap=softcap, scale=scaling, dropout=dropout,
        return_weights=want_weights, sinks=sinks, kv_bounds=noted_bounds(key, value),
    )
    out, weights = result if isinstance(result, tuple) else (result, None)  # (B, H, L, Ev), (B, H, L, S) | None
    out = out.transpose(1, 2).contiguous()  # (B, L, H, Ev)
    if weights is not None:
        weights = weights.to(query.dtype)  # (B, H, L, S), the dtype eager returns
    return out, weights
