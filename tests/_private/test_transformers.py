"""qkv._private.transformers, checked against transformers 5.24: the attention and mask
registries and the output collector of capture_outputs."""

from __future__ import annotations

from qkv._private import transformers as private_transformers
from tests._private._bounds import assert_checked_release_is_allowed


def test_checked_release_is_inside_the_declared_range() -> None:
    assert private_transformers.CHECKED_WITH == "5.24"
    assert_checked_release_is_allowed("transformers", private_transformers.CHECKED_WITH)


def test_registries_hold_transformers_own_implementations() -> None:
    assert "sdpa" in private_transformers.attention_names()
    assert callable(private_transformers.registered_attention("sdpa"))
    assert callable(private_transformers.registered_mask("sdpa"))
    assert private_transformers.registered_attention("no-such-implementation") is None


def test_output_collector_exists_and_is_idle_outside_a_call() -> None:
    from transformers.utils import output_capturing

    assert hasattr(output_capturing, "_active_collector")  # else attentions_collected is always False
    assert private_transformers.attentions_collected() is False
