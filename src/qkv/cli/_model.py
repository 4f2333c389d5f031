"""Loading a model for a `qkv` command, and running a text through it, with every failure an
exit-2 message that names the problem (a missing directory, a text too long, an empty text).
PyTorch and the model are imported only when a command loads one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.cli._app import fail
from qkv.cli._options import check_dtype

if TYPE_CHECKING:
    from qkv.inspect.inspection import Inspection
    from qkv.models import Encoder, TextTooLongError

__all__ = ["inspect_or_fail", "load_or_fail", "too_long_message"]

_encoders: dict[tuple[str, str], Encoder] = {}


def load_or_fail(model: str, dtype: str = "float32") -> Encoder:
    """The encoder for ``model`` in ``dtype`` (loaded once per process), or exit 2 with the reason."""
    check_dtype(dtype)
    if (model, dtype) not in _encoders:
        try:
            _encoders[model, dtype] = _load(model, dtype)
        except (OSError, ValueError, TypeError) as error:  # OSError: missing or unreadable files
            fail(f"cannot load model {model!r}: {error}")
        except Exception as error:  # damaged files fail inside third-party loaders in their own ways
            fail(f"cannot load model {model!r}: {type(error).__name__}: {error}")
    return _encoders[model, dtype]


def _load(model: str, dtype: str) -> Encoder:
    """qkv's own BERT-family encoder in ``dtype``, or for another model_type a transformers model
    on qkv (float32 only: its hidden states and maps would come back in the model's dtype)."""
    config = Path(model) / "config.json"
    model_type = None
    if config.is_file():
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (json.JSONDecodeError, AttributeError) as error:
            raise ValueError(f"{config} is not a JSON object: {error}") from error
    if model_type is None or model_type == "bert":
        import torch

        from qkv.models import load_encoder

        return load_encoder(model, dtype=getattr(torch, dtype))
    if dtype != "float32":
        raise ValueError(
            f"--dtype {dtype} applies to BERT-family encoders only; model_type {model_type!r} "
            "runs through transformers in float32 (leave --dtype out)"
        )
    try:
        from qkv.integrations.transformers import load_model
    except ImportError as error:
        raise ValueError(
            f"model_type {model_type!r} runs through transformers, which is not installed "
            "(pip install 'qkv[transformers]')"
        ) from error
    return load_model(model)  # type: ignore[return-value]  # an Encoder for inspection


def too_long_message(error: TextTooLongError, what: str = "the text") -> str:
    """The CLI's words for a text longer than the model's positions: it names --truncate."""
    return (
        f"{what} has {error.tokens} tokens, more than the model's {error.limit} positions "
        f"([CLS] and [SEP] included); pass --truncate to keep the first {error.limit}"
    )


def inspect_or_fail(encoder: Encoder, text: str, *, truncate: bool = False, name: str = "the text") -> Inspection:
    """Run ``text`` through the encoder, or exit 2 (empty or too long text)."""
    from qkv.models import TextTooLongError

    if not text.strip():
        fail(f"{name} is empty; give at least one word")
    try:
        return encoder.inspect(text, truncate=truncate)
    except TextTooLongError as error:
        fail(too_long_message(error, name))
    except ValueError as error:
        fail(str(error))
