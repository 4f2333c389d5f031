"""The options that several `qkv` commands share, declared once: --model, --json, --truncate,
--dtype. Typer reads them from the annotations; nothing here imports PyTorch."""

from __future__ import annotations

from typing import Annotated

import typer

from qkv.cli._app import fail

__all__ = ["BUILTIN_MODEL", "DTYPES", "DtypeOption", "JsonOption", "ModelOption", "TruncateOption", "check_dtype"]

BUILTIN_MODEL = "all-MiniLM-L6-v2"  # the same name as qkv.models.DEFAULT_MODEL, without importing torch

ModelOption = Annotated[
    str,
    typer.Option(
        "--model",
        help=(
            "A directory with config.json, tokenizer.json and model.safetensors, or the built-in "
            "all-MiniLM-L6-v2. A model that is not BERT-family (Llama, GPT-2, ...) runs through "
            "transformers on qkv (the qkv[transformers] extra)."
        ),
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
TruncateOption = Annotated[
    bool, typer.Option("--truncate", help="Cut a text longer than the model's positions instead of refusing it.")
]
# The dtypes a command can run in (qkv.models.ENCODER_DTYPES, named without importing torch).
DTYPES = ("float32", "bfloat16")
DtypeOption = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="float32 or bfloat16: the dtype of the model's matrix multiplies (bfloat16 runs on the "
        "CPU's bf16 units; LayerNorms and results stay float32).",
    ),
]


def check_dtype(dtype: str) -> None:
    """Exit 2 naming the allowed values unless ``dtype`` is one of `DTYPES`."""
    if dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
