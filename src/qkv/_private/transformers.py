"""transformers' private names that qkv reads (checked against transformers 5.24).

The registries of attention and mask functions (``AttentionInterface._global_mapping``,
``AttentionMaskInterface._global_mapping``): `register` must not replace one of transformers'
own implementations, and the public ``register`` cannot say which names are taken.

The output collector of ``capture_outputs``: some models (GPT-2) do not pass ``output_attentions`` down to the attention function;
transformers then collects the attention weights through a context variable,
``transformers.utils.output_capturing._active_collector``, which holds the names of the
outputs being collected in this call (since transformers 5.2). `attentions_collected` reads
it; should a release drop the name, it answers False and qkv relies on ``output_attentions``
alone. pyproject.toml allows transformers >= 5.2, < 6 (the ``transformers`` extra);
tests/_private/test_transformers.py checks the names on the installed release.
"""

from __future__ import annotations

import transformers

__all__ = ["CHECKED_WITH", "attention_names", "attentions_collected", "registered_attention", "registered_mask"]

# The transformers release this module was checked against.
CHECKED_WITH = "5.24"


def attentions_collected() -> bool:
    """Whether transformers' output collector is gathering attention weights in this call."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without it passes output_attentions down itself
        return False
    collected = _active_collector.get()
    return bool(collected) and any(key in collected for key in ("attentions", "cross_attentions"))


def attention_names() -> set[str]:
    """The names registered as attention implementations (transformers' own and any added)."""
    return set(transformers.AttentionInterface._global_mapping)


def registered_attention(name: str) -> object | None:
    """The attention function registered under ``name``, or None."""
    return transformers.AttentionInterface._global_mapping.get(name)


def registered_mask(name: str) -> object | None:
    """The mask function registered under ``name`` (AttentionMaskInterface), or None."""
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionMaskInterface._global_mapping.get(name)
