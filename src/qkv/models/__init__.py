"""`qkv.models`: a BERT-family encoder built on `qkv.MultiHeadAttention`, loaded offline.

- `load_encoder()` -> `Encoder` for all-MiniLM-L6-v2 (from the `qkv-minilm` package,
  found by `builtin_model_dir()` without importing it),
  or `load_encoder(directory)` for any BERT checkpoint with config.json, tokenizer.json and
  model.safetensors.
- `Encoder.encode(texts)` -> (N, D) sentence embeddings; `Encoder.inspect(text)` -> `Inspection`.
- `head_roles(encoder, texts)` -> `HeadRoles` of every head averaged over texts
  (default: `ROLE_SENTENCES`, written for qkv).
- `BertConfig`, `BertEncoder`, `WordPieceTokenizer`, `load_bert_weights` for building blocks.
"""

from __future__ import annotations

from qkv.models.bert import BertEncoder, EncoderOutput
from qkv.models.config import BertConfig
from qkv.models.encoder import (
    DEFAULT_MODEL,
    Encoder,
    TextTooLongError,
    builtin_model_dir,
    load_encoder,
    mean_pool,
    resolve_model_dir,
)
from qkv.models.roles import ROLE_SENTENCES, head_roles
from qkv.models.tokenizer import TokenizedText, WordPieceTokenizer
from qkv.models.weights import checkpoint_keys, load_bert_weights, read_header

__all__ = [
    "DEFAULT_MODEL",
    "ROLE_SENTENCES",
    "BertConfig",
    "BertEncoder",
    "Encoder",
    "EncoderOutput",
    "TextTooLongError",
    "TokenizedText",
    "WordPieceTokenizer",
    "builtin_model_dir",
    "checkpoint_keys",
    "head_roles",
    "load_bert_weights",
    "load_encoder",
    "mean_pool",
    "read_header",
    "resolve_model_dir",
]
