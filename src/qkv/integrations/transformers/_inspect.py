"""An `Inspection` of any transformers model: tokens, exact attention maps, hidden states.

`inspect(model, tokenizer, text)` runs one text with ``output_attentions`` and
``output_hidden_states`` and packs what comes back as qkv's `Inspection`, so the viewer
(`qkv.viz.html`), the heatmaps and the CLI work on it as on the built-in MiniLM. On
``attn_implementation="qkv"`` the maps are the exact probabilities of the path that ran; a
decoder's maps are lower-triangular (each token sees only the ones before it) and are drawn as
that triangle. `load_model(directory)` opens a local model directory (config.json, safetensors
weights, a fast tokenizer) on qkv, offline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from qkv.inspect.inspection import Inspection, Projections
from qkv.integrations.transformers._attention import HeadInputs, capturing
from qkv.models import TextTooLongError
from qkv.models.encoder import check_text
from qkv.models.weights import read_header

__all__ = ["TransformersModel", "inspect", "load_model"]

# Sizes in a config that must be positive integers for a model to be built at all; transformers
# itself fails on 0 or a negative size deep inside a layer's constructor (a ZeroDivisionError, a
# negative tensor dimension). Each family names them its own way.
_POSITIVE_SIZES = (
    "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "intermediate_size",
    "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_head", "n_layer", "n_positions",
    "d_model", "d_kv", "d_ff", "num_heads", "num_layers",
)


def inspect(
    model: torch.nn.Module, tokenizer: Any, text: str, *, truncate: bool = False, name: str = ""
) -> Inspection:
    """Run ``text`` through ``model`` and keep everything (see `Inspection`).

    Args:
        model: a transformers model (a base model such as ``AutoModel``, or one with a head)
            whose forward returns ``attentions`` and ``hidden_states``.
        tokenizer: its fast tokenizer (character offsets and word ids are read from it).
        text: the text; it must fit the model's positions (`TextTooLongError` otherwise).
        truncate: keep the tokens that fit instead of refusing a text that is too long.
        name: the model's name for the viewer; default the config's ``name_or_path``.

    Returns:
        Inspection with attentions (layers, H, T, T) and hidden states (layers + 1, T, D),
        float32 on the CPU. H counts query heads (grouped-query models included).
    """
    check_text(text)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"inspect needs a fast tokenizer (character offsets and word ids), got {type(tokenizer).__name__}"
        )
    limit = _position_limit(model)
    cut = {"truncation": True, "max_length": limit} if truncate and limit is not None else {}
    encoding = tokenizer(text, return_offsets_mapping=True, return_tensors="pt", **cut)
    ids = encoding["input_ids"]  # (1, T)
    if limit is not None and ids.shape[1] > limit:
        raise TextTooLongError(count=1, index=0, tokens=int(ids.shape[1]), limit=int(limit))
    device = next(model.parameters()).device
    with torch.no_grad(), capturing() as kept:
        output = model(
            input_ids=ids.to(device), attention_mask=encoding["attention_mask"].to(device),
            output_attentions=True, output_hidden_states=True,
        )
    attentions, hidden = getattr(output, "attentions", None), getattr(output, "hidden_states", None)
    if not attentions or not hidden or any(a is None for a in attentions):
        raise ValueError(
            f"{type(model).__name__} returned no attention maps or hidden states; inspect takes models "
            "whose forward returns both (encoders, decoders; not encoder-decoder models)"
        )
    layers, T = len(attentions), int(ids.shape[1])
    return Inspection(
        projections=_projections(kept, layers, T),
        text=text,
        tokens=tokenizer.convert_ids_to_tokens(ids[0].tolist()),
        offsets=[(int(a), int(b)) for a, b in encoding["offset_mapping"][0].tolist()],
        word_ids=encoding.word_ids(0),
        attentions=torch.stack([a[0] for a in attentions]).float().cpu(),  # (layers, H, T, T)
        hidden_states=torch.stack([h[0] for h in hidden]).float().cpu(),  # (layers + 1, T, D)
        model_name=name or str(getattr(model.config, "name_or_path", "") or type(model).__name__),
    )


def _projections(kept: list[HeadInputs], layers: int, T: int) -> Projections | None:
    """The per-head q, k, v of every layer, from the calls that ran on qkv (`capturing`);
    None unless there is one self-attention call of T queries and keys per layer (a model on
    another attn_implementation leaves none)."""
    own = [call for call in kept if call.q.shape[1] == call.k.shape[1] == T]
    if len(own) != layers or len({call.scale for call in own}) != 1:
        return None
    stack = lambda xs: torch.stack(xs)  # noqa: E731  (layers, heads, T, width)
    allowed = None
    if any(call.allowed is not None for call in own):
        every = torch.ones(T, T, dtype=torch.bool)
        allowed = stack([every if call.allowed is None else call.allowed for call in own])  # (layers, T, T)
    terms = sorted({f"{term} (layer {i})" for i, call in enumerate(own) for term in call.terms})
    return Projections(
        q=stack([c.q for c in own]), k=stack([c.k for c in own]), v=stack([c.v for c in own]), scale=own[0].scale,
        allowed=allowed, unsupported="; ".join(terms) if terms else None,
    )


def _position_limit(model: torch.nn.Module) -> int | None:
    """The model's number of positions, None when its config names none (rotary models may)."""
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    return None if limit is None else int(limit)


class TransformersModel:
    """A transformers model and its tokenizer, loaded for inspection (`load_model`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, *, name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name

    def inspect(self, text: str, *, truncate: bool = False) -> Inspection:
        """One text: tokens, exact attention maps, hidden states (see `inspect`)."""
        return inspect(self.model, self.tokenizer, text, truncate=truncate, name=self.name)

    @property
    def max_tokens(self) -> int | None:
        """Longest text in tokens (special tokens included), None when the config names no limit."""
        return _position_limit(self.model)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """How many tokens each text has, special tokens included (what `inspect` would run)."""
        for text in texts:
            check_text(text)
        return [len(ids) for ids in self.tokenizer(list(texts))["input_ids"]]  # type: ignore[operator]


def load_model(directory: str | Path, *, attn_implementation: str | None = None) -> TransformersModel:
    """Open a local transformers model directory on qkv: config.json, its weights
    (safetensors) and tokenizer files. Nothing is downloaded.

    ``attn_implementation`` defaults to qkv (registered here when needed).
    """
    from qkv.integrations.transformers._register import register

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a transformers model directory")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{path} has no .safetensors weights; qkv loads safetensors only")
    _check_config(path / "config.json")
    for file in weights:
        read_header(file)  # a truncated file, or one that is not safetensors, is named here
    implementation = attn_implementation or register()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar on every load
    try:
        model = transformers.AutoModel.from_pretrained(
            str(path), attn_implementation=implementation, local_files_only=True, use_safetensors=True,
            dtype=torch.float32,
        )
    except (RuntimeError, ArithmeticError, KeyError, IndexError) as error:
        # a config whose sizes disagree with each other or with the weights fails inside transformers
        raise ValueError(
            f"transformers could not build the model of {path}: {type(error).__name__}: {error}"
        ) from error
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # tokenizers raises a bare Exception for a damaged file
        raise ValueError(f"the tokenizer files of {path} cannot be read: {type(error).__name__}: {error}") from error
    return TransformersModel(model.eval(), tokenizer, name=str(path))


def _check_config(config: Path) -> None:
    """ValueError naming the first size in config.json that is not a positive integer."""
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config} is not JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{config} is not a JSON object")
    for section in (values, *(v for v in values.values() if isinstance(v, dict))):  # text_config, ...
        for key in _POSITIVE_SIZES:
            value = section.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{config}: {key} must be a positive integer, got {value!r}")
