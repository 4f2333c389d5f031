"""`BertConfig`: the shape of a BERT-family encoder, read from a Hugging Face ``config.json``.

Only the fields that decide the architecture are read; the rest of the file (training
settings such as dropout rates, library versions) is ignored on purpose, and a value that qkv
cannot run (another activation, relative position embeddings, a model type that is not BERT)
is refused with a message that names it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["BertConfig"]

# model_type values whose checkpoints share BERT's layout (embeddings + post-LN blocks).
SUPPORTED_MODEL_TYPES = ("bert",)
# hidden_act values and the GELU they mean: BERT's "gelu" is the exact erf form.
SUPPORTED_ACTIVATIONS = ("gelu",)


def _is_int(value: object) -> bool:
    # JSON's true/false arrive as bool, a subclass of int; 2.0 or "2" are not sizes either
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BertConfig:
    """Architecture of a BERT encoder; the defaults are all-MiniLM-L6-v2's."""

    vocab_size: int = 30522  # rows of the word-embedding table
    hidden_size: int = 384  # D, the model width
    num_hidden_layers: int = 6  # number of encoder blocks
    num_attention_heads: int = 12  # H; head dim E = D / H
    intermediate_size: int = 1536  # width of the feed-forward hidden layer
    max_position_embeddings: int = 512  # longest sequence, [CLS] and [SEP] included
    type_vocab_size: int = 2  # segment (token type) embeddings
    layer_norm_eps: float = 1e-12  # epsilon of every LayerNorm
    hidden_act: str = "gelu"  # feed-forward activation; "gelu" = exact erf GELU
    pad_token_id: int = 0  # id of [PAD]
    model_type: str = "bert"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"config hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
            raise ValueError(f"config layer_norm_eps must be a positive finite number, got {eps!r}")
        for name in ("hidden_act", "model_type"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"config {name} must be a string, got {getattr(self, name)!r}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"config hidden_act={self.hidden_act!r} is not supported; qkv runs {SUPPORTED_ACTIVATIONS}"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config model_type={self.model_type!r} is not supported; qkv runs {SUPPORTED_MODEL_TYPES}"
            )
        if not _is_int(self.pad_token_id):
            raise ValueError(f"config pad_token_id must be an integer token id, got {self.pad_token_id!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"config pad_token_id={self.pad_token_id} is outside the vocabulary of {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        """E, the width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BertConfig:
        """Pick the architecture fields out of a Hugging Face config dictionary."""
        if not isinstance(raw, dict):
            raise TypeError(f"a config must be a JSON object, got {type(raw).__name__}")
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(
                f"config position_embedding_type={position_type!r} is not supported; qkv runs 'absolute'"
            )
        if raw.get("is_decoder", False) or raw.get("add_cross_attention", False):
            raise ValueError("config describes a BERT decoder (is_decoder / add_cross_attention); qkv runs encoders")
        known = {f.name for f in fields(cls)}
        # null means "not set" in HF configs (e.g. pad_token_id of some checkpoints): keep the default
        values = {name: raw[name] for name in known if raw.get(name) is not None}
        missing = sorted(
            name for name in known - {"model_type", "pad_token_id", "hidden_act", "layer_norm_eps"}
            if name not in values
        )
        if missing:
            raise ValueError(f"config is missing {', '.join(missing)}")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read ``config.json``; errors name the file."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no config file at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{path}: {error}") from None
