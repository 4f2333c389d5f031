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

from pathlib import Path

import torch
import transformers

from qkv.inspect import Inspection
from qkv.models import TextTooLongError

__all__ = ["TransformersModel", "inspect", "load_model"]


def inspect(
    model: torch.nn.Module, tokenizer: object, text: str, *, truncate: bool = False, name: str = ""
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
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text is empty; give at least one word to inspect")
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"inspect needs a fast tokenizer (character offsets and word ids), got {type(tokenizer).__name__}"
        )
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    cut = {"truncation": True, "max_length": limit} if truncate and limit is not None else {}
    encoding = tokenizer(text, return_offsets_mapping=True, return_tensors="pt", **cut)
    ids = encoding["input_ids"]  # (1, T)
    if limit is not None and ids.shape[1] > limit:
        raise TextTooLongError(count=1, index=0, tokens=int(ids.shape[1]), limit=int(limit))
    device = next(model.parameters()).device
    with torch.no_grad():
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
    return Inspection(
        text=text,
        tokens=tokenizer.convert_ids_to_tokens(ids[0].tolist()),
        offsets=[(int(a), int(b)) for a, b in encoding["offset_mapping"][0].tolist()],
        word_ids=encoding.word_ids(0),
        attentions=torch.stack([a[0] for a in attentions]).float().cpu(),  # (layers, H, T, T)
        hidden_states=torch.stack([h[0] for h in hidden]).float().cpu(),  # (layers + 1, T, D)
        model_name=name or str(getattr(model.config, "name_or_path", "") or type(model).__name__),
    )


class TransformersModel:
    """A transformers model and its tokenizer, loaded for inspection (`load_model`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, *, name: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name

    def inspect(self, text: str, *, truncate: bool = False) -> Inspection:
        """One text: tokens, exact attention maps, hidden states (see `inspect`)."""
        return inspect(self.model, self.tokenizer, text, truncate=truncate, name=self.name)


def load_model(directory: str | Path, *, attn_implementation: str | None = None) -> TransformersModel:
    """Open a local transformers model directory on qkv: config.json, its weights
    (safetensors) and tokenizer files. Nothing is downloaded.

    ``attn_implementation`` defaults to qkv (registered here when needed).
    """
    from qkv.integrations.transformers import register

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a transformers model directory")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{path} has no .safetensors weights; qkv loads safetensors only")
    implementation = attn_implementation or register()
    model = transformers.AutoModel.from_pretrained(
        str(path), attn_implementation=implementation, local_files_only=True, use_safetensors=True,
        dtype=torch.float32,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return TransformersModel(model.eval(), tokenizer, name=str(path))
