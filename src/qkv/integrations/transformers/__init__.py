"""qkv as an attention backend for Hugging Face transformers models.

    >>> import transformers
    >>> from qkv.integrations.transformers import register
    >>> register()  # once per process
    'qkv'
    >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="qkv")
    >>> model.config._attn_implementation
    'qkv'

`register` adds qkv to transformers' ``AttentionInterface`` (the attention of every layer)
and ``AttentionMaskInterface`` (how the model's masks are built) under one name. Models whose
attention goes through that interface then run on qkv:

- masks arrive structured (`StructuredMask`): causal, sliding windows, padding on either
  side, packed sequences and chunks become ``qkv.masks`` objects, so qkv's CPU block engine
  computes only the tiles they leave visible; a mask qkv does not recognise runs dense and
  `recording` says so;
- ``output_attentions=True`` (as a forward or ``generate`` argument) returns the exact
  probabilities of the path that ran, for every layer; transformers refuses
  ``config.output_attentions=True`` for any implementation but eager, so pass it per call;
- Gemma 2's soft-capping and T5's relative position bias reach qkv as ``softcap=`` and
  ``bias=``, gpt-oss's attention sinks as ``sinks=``;
- `recording` lists every call with its `qkv.explain`;
- the model's DynamicCache / StaticCache keeps running bounds on its keys and values (the
  backend wraps it from the second forward on; `track_bounds(cache)` does it by hand for other
  caches), so that a decoding step's input checks read the new tokens only (``kv_bounds``);
- `growing_cache(config)`: a DynamicCache that appends a step's rows in place instead of
  copying the whole cache each step (``torch.cat``), which at long contexts costs more than
  attention; any attention implementation gives the same results with it;
- `inspect(model, tokenizer, text)` gives qkv's `Inspection` of any such model, and
  `load_model(directory)` opens a local model directory for it (``qkv inspect --model DIR``).

Not served: transformers' continuous batching (``generate_batch`` and its paged cache). In
transformers 5.24 ``switch_to_cb_friendly_attn`` (generation/continuous_batching/continuous_api.py)
accepts only "paged|eager", "sdpa" or a name containing "flash", and a registered name containing
"flash" is looked up as a FlashAttention kernel by ``set_attn_implementation`` and refused.

Requires the ``qkv[transformers]`` extra; ``import qkv`` never imports transformers.
"""

from __future__ import annotations

from qkv.integrations.transformers._attention import AttentionCall, attention_forward, recording
from qkv.integrations.transformers._bounds import track_bounds
from qkv.integrations.transformers._growing import growing_cache
from qkv.integrations.transformers._inspect import TransformersModel, inspect, load_model
from qkv.integrations.transformers._masks import StructuredMask, structured_mask
from qkv.integrations.transformers._register import register

__all__ = [
    "AttentionCall",
    "StructuredMask",
    "TransformersModel",
    "attention_forward",
    "growing_cache",
    "inspect",
    "load_model",
    "recording",
    "register",
    "structured_mask",
    "track_bounds",
]
