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

What is refused, with a message, before any work: attention sinks (``s_aux``, gpt-oss), and
masks of a type qkv does not take.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import qkv
from qkv._private.transformers import attentions_collected
from qkv.integrations.transformers._masks import StructuredMask
from qkv.masks import Mask

if TYPE_CHECKING:
    from collections.abc import Iterator

    from qkv.functional import Explanation

__all__ = ["AttentionCall", "attention_forward", "recording"]


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


def _attentions_requested(kwargs: dict[str, object]) -> bool:
    """Whether the model will return this call's weights: ``output_attentions`` reaches the
    attention function in some models only (GPT-2 drops it), so the output collector of
    transformers' ``capture_outputs`` is read as well."""
    return bool(kwargs.get("output_attentions")) or attentions_collected()


def _refuse_unsupported(s_aux: object) -> None:
    if s_aux is not None:
        raise ValueError(
            "qkv cannot run attention sinks (s_aux, as in gpt-oss): an extra logit per head joins every "
            "softmax and qkv has no such term; use attn_implementation='eager' or 'sdpa' for this model"
        )


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
        return qkv.masks.causal(align="top-left"), "causal (no mask given; the module is causal)", True
    return None, "no mask", True


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
        s_aux: attention sinks, refused when set.
        kwargs: the model's other keywords (``sliding_window``, ``position_ids``,
            ``output_attentions`` ...): the mask already carries what they say.

    Returns:
        output (B, L, H, Ev) in query's dtype, and the exact probabilities (B, H, L, S) in
        query's dtype when the model returns attentions, else None.
    """
    _refuse_unsupported(s_aux)
    L, S = query.shape[-2], key.shape[-2]
    mask, source, recognised = _qkv_mask(attention_mask, module, is_causal, L, S)
    want_weights = _attentions_requested(kwargs)
    calls = _recorder.get()
    if calls is not None:
        explanation = qkv.explain(
            query, key, value, mask, bias=position_bias, softcap=softcap, scale=scaling, dropout=dropout,
            return_weights=want_weights,
        )
        calls.append(AttentionCall(getattr(module, "layer_idx", None), type(module).__name__, source, recognised, explanation))
    result = qkv.attention(
        query, key, value, mask, bias=position_bias, softcap=softcap, scale=scaling, dropout=dropout,
        return_weights=want_weights,
    )
    out, weights = result if want_weights else (result, None)  # (B, H, L, Ev), (B, H, L, S) | None
    out = out.transpose(1, 2).contiguous()  # (B, L, H, Ev)
    if weights is not None:
        weights = weights.to(query.dtype)  # (B, H, L, S), the dtype eager returns
    return out, weights
