"""Tiny transformers models built from configs with random weights (nothing is downloaded).

Each family is kept to 2 layers and width 32 so that the whole file runs in seconds; the
same weights are loaded into the eager, sdpa and qkv variants of a model.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import transformers

from qkv.integrations.transformers import register

NAME = register()
VOCAB = 61

_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}


def llama() -> transformers.PreTrainedConfig:
    """Grouped-query attention: 4 query heads read 2 key/value heads."""
    return transformers.LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2)


def mistral(window: int = 5) -> transformers.PreTrainedConfig:
    return transformers.MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=window)


def qwen2() -> transformers.PreTrainedConfig:
    return transformers.Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=1)


def gemma2(window: int = 5, softcap: float | None = 1.0) -> transformers.PreTrainedConfig:
    """Sliding window on layer 0, full attention on layer 1 (Gemma 2's alternation), logits
    soft-capped at 1 (Gemma 2 uses 50; random weights give small scores, so a small cap
    is what makes the tanh matter here)."""
    return transformers.Gemma2Config(
        **_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
    )


def gpt_oss(window: int = 5, layers: int = 2) -> transformers.PreTrainedConfig:
    """Attention sinks, sliding-window and full layers alternating (gpt-oss's pattern), a
    mixture of 4 experts choosing 2."""
    return transformers.GptOssConfig(
        **{**_COMMON, "num_hidden_layers": layers}, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        sliding_window=window, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        num_local_experts=4, num_experts_per_tok=2,
    )


def gpt2() -> transformers.PreTrainedConfig:
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512)


def bert(decoder: bool = False) -> transformers.PreTrainedConfig:
    return transformers.BertConfig(
        **_COMMON, num_attention_heads=4, max_position_embeddings=512,
        is_decoder=decoder, add_cross_attention=decoder,
    )


def t5() -> transformers.PreTrainedConfig:
    """An encoder-decoder with relative position bias (added to the scores) and cross-attention."""
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
    )


DECODERS = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "gemma2": gemma2, "gpt2": gpt2}


def build(config: transformers.PreTrainedConfig, impl: str, auto=transformers.AutoModelForCausalLM, source=None):
    """The model of ``config`` with attention ``impl``, in float32 eval mode; weights copied from
    ``source`` when given, else drawn from the current seed."""
    model = auto.from_config(copy.deepcopy(config), attn_implementation=impl)
    if source is not None:
        model.load_state_dict(source.state_dict())
    return model.eval()


def trio(config: transformers.PreTrainedConfig, auto=transformers.AutoModelForCausalLM) -> dict[str, torch.nn.Module]:
    """eager, sdpa (when the family has it: Gemma 2 has not) and qkv models with the same random weights."""
    eager = build(config, "eager", auto)
    models = {"eager": eager, NAME: build(config, NAME, auto, eager)}
    if type(eager)._supports_sdpa:
        models["sdpa"] = build(config, "sdpa", auto, eager)
    return models


def peers(models: dict[str, torch.nn.Module]) -> list[str]:
    """The transformers implementations qkv is compared with."""
    return [impl for impl in ("eager", "sdpa") if impl in models]


def padded_batch(length: int, pads: tuple[int, ...], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, length) and their 2-D attention mask, row b padded by pads[b] on ``side``."""
    ids = torch.randint(3, VOCAB, (len(pads), length))
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        if pad:
            if side == "left":
                mask[row, :pad] = 0
            else:
                mask[row, length - pad :] = 0
    return ids, mask


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword that hands ``cache`` to ``model`` and its ``generate``: ``cache`` from
    transformers 5.24, ``past_key_values`` before it (Python 3.10 resolves transformers 5.20);
    the other name is ignored or refused there."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}
