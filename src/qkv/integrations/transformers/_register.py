"""Registering qkv as an attention implementation of transformers, under a name."""

from __future__ import annotations

import transformers

from qkv._private import transformers as private_transformers
from qkv.integrations.transformers._attention import attention_forward
from qkv.integrations.transformers._masks import structured_mask

__all__ = ["register"]


def register(name: str = "qkv") -> str:
    """Make ``attn_implementation=name`` run on qkv in every transformers model; returns name.

    Registering again (the same or another name) is harmless. The name must not be one of
    transformers' own implementations ("eager", "sdpa", "flash_attention_2", ...).
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"name must be a non-empty str without surrounding spaces, got {name!r}")
    from transformers.masking_utils import AttentionMaskInterface

    own = private_transformers.registered_mask(name)
    builtin = private_transformers.attention_names() | {"eager", "paged|eager"}
    if (name in builtin and private_transformers.registered_attention(name) is not attention_forward) or (
        own is not None and own is not structured_mask
    ):
        raise ValueError(f"{name!r} is already an attention implementation of transformers; choose another name")
    transformers.AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, structured_mask)
    return name
