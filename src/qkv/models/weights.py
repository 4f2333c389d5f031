"""Pretrained BERT weights from a safetensors file, by an explicit key mapping.

Every parameter of `qkv.models.bert.BertEncoder` is named here next to the checkpoint key it
comes from (`checkpoint_keys`). Before a single tensor is copied, the loader checks the whole
file and reports every problem at once: a tensor whose bytes lie past the end of the file
(truncated download), missing keys, unexpected keys, wrong shapes and non-float dtypes.
Then it reads the tensors and refuses NaN or infinite values, naming the keys: a single
NaN weight would silently turn every embedding into NaN.

Only safetensors is read. Pickle checkpoints (``pytorch_model.bin``, ``.pt``, ``.ckpt``)
can run arbitrary code when loaded and are refused.

Reference: the safetensors format (8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then the raw bytes),
https://github.com/huggingface/safetensors#format
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qkv.models.config import BertConfig

__all__ = [
    "PICKLE_SUFFIXES",
    "TensorInfo",
    "checkpoint_keys",
    "load_bert_weights",
    "read_header",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# Bytes per element of the safetensors dtype names.
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# Weight dtypes accepted; all are converted to the encoder's float32.
FLOAT_DTYPES = ("F32", "F16", "BF16")
# A header larger than this is not a real safetensors header (guards against reading a pickle).
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# Checkpoint entries that carry no weights the encoder uses: HF's saved position-id buffer and
# the [CLS] pooler (sentence embeddings use mean pooling, inspection the hidden states).
IGNORED_KEYS = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
# A pretraining checkpoint (BertForPreTraining, BertForMaskedLM) nests the encoder under "bert."
# and adds heads under "cls.", which are ignored.
NESTED_PREFIX = "bert."
NESTED_HEADS_PREFIX = "cls."


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset into the data section
    end: int


def checkpoint_keys(config: BertConfig) -> dict[str, str]:
    """qkv parameter name -> Hugging Face BERT checkpoint key, for every parameter."""
    keys = {
        "embeddings.word.weight": "embeddings.word_embeddings.weight",
        "embeddings.position.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    for i in range(config.num_hidden_layers):
        ours, theirs = f"layers.{i}", f"encoder.layer.{i}"
        for param in ("weight", "bias"):
            keys[f"{ours}.attention.q_proj.{param}"] = f"{theirs}.attention.self.query.{param}"
            keys[f"{ours}.attention.k_proj.{param}"] = f"{theirs}.attention.self.key.{param}"
            keys[f"{ours}.attention.v_proj.{param}"] = f"{theirs}.attention.self.value.{param}"
            keys[f"{ours}.attention.out_proj.{param}"] = f"{theirs}.attention.output.dense.{param}"
            keys[f"{ours}.attention_norm.{param}"] = f"{theirs}.attention.output.LayerNorm.{param}"
            keys[f"{ours}.ffn_in.{param}"] = f"{theirs}.intermediate.dense.{param}"
            keys[f"{ours}.ffn_out.{param}"] = f"{theirs}.output.dense.{param}"
            keys[f"{ours}.ffn_norm.{param}"] = f"{theirs}.output.LayerNorm.{param}"
    return keys


def refuse_pickle(path: Path) -> None:
    """Raise for a pickle checkpoint path, before anything is opened."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ValueError(
            f"{path} is a pickle checkpoint; qkv loads only safetensors, because unpickling can "
            "run arbitrary code. Convert it once with safetensors.torch.save_file in a trusted "
            "environment, or use the model's model.safetensors."
        )


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header without reading the tensors.

    Raises ValueError naming the file, or the first tensor whose bytes lie past the end of the
    file (a truncated download) or disagree with its shape and dtype.
    """
    path = Path(path)
    refuse_pickle(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ValueError(
                f"{path} is not a complete safetensors file: its header claims {header_len} bytes "
                f"but the file has {size} bytes (truncated, or not safetensors)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    data_size = size - 8 - header_len
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: header entry {name!r} is malformed: {entry!r}") from None
        if dtype not in _ITEMSIZE:
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if end > data_size:
            raise ValueError(
                f"{path} is truncated: tensor {name!r} needs data bytes {begin}..{end} but the file "
                f"holds only {data_size}; download it again"
            )
        if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(
                f"{path}: tensor {name!r} of shape {list(shape)} {dtype} should take "
                f"{math.prod(shape) * _ITEMSIZE[dtype]} bytes, the header gives {end - begin}"
            )
        infos[name] = TensorInfo(dtype, shape, begin, end)
    return infos


def _strip_nesting(names: list[str]) -> tuple[str, set[str]]:
    """The prefix that the encoder's keys carry ("" or "bert.") and the keys to skip."""
    if f"{NESTED_PREFIX}embeddings.word_embeddings.weight" in names:
        heads = {n for n in names if n.startswith(NESTED_HEADS_PREFIX)}
        return NESTED_PREFIX, heads | {NESTED_PREFIX + k for k in IGNORED_KEYS}
    return "", set(IGNORED_KEYS)


def load_bert_weights(module: nn.Module, path: str | Path, config: BertConfig) -> None:
    """Copy a safetensors BERT checkpoint into ``module`` (a `BertEncoder` of ``config``).

    All problems in the file are collected and raised as one ValueError that names each key:
    missing, unexpected, wrong shape, non-float dtype, NaN or infinite values. Nothing is
    copied unless the whole file passes.
    """
    path = Path(path)
    infos = read_header(path)
    mapping = checkpoint_keys(config)
    params = module.state_dict()
    if set(params) != set(mapping):
        # The module and this mapping are written together; a difference is a qkv bug.
        raise RuntimeError(
            f"qkv's BERT key mapping and module disagree: only in module {sorted(set(params) - set(mapping))}, "
            f"only in mapping {sorted(set(mapping) - set(params))}"
        )
    prefix, skipped = _strip_nesting(list(infos))
    wanted = {ours: prefix + theirs for ours, theirs in mapping.items()}

    problems: list[str] = []
    missing = [key for key in wanted.values() if key not in infos]
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    expected = set(wanted.values()) | skipped
    unexpected = [key for key in infos if key not in expected]
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    for ours, theirs in wanted.items():
        info = infos.get(theirs)
        if info is None:
            continue
        if info.shape != tuple(params[ours].shape):
            problems.append(
                f"{theirs}: shape {list(info.shape)}, expected {list(params[ours].shape)} from the config"
            )
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{theirs}: dtype {info.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
    if problems:
        raise ValueError(f"{path} does not fit the BERT config:\n  " + "\n  ".join(problems))

    tensors: dict[str, torch.Tensor] = {}
    not_finite: list[str] = []
    with safe_open(str(path), framework="pt") as f:
        for ours, theirs in wanted.items():
            tensor = f.get_tensor(theirs)
            if not torch.isfinite(tensor).all():
                not_finite.append(theirs)
            tensors[ours] = tensor
    if not_finite:
        raise ValueError(f"{path} has NaN or infinite values in: {', '.join(not_finite)}")
    with torch.no_grad():
        for ours, tensor in tensors.items():
            params[ours].copy_(tensor.to(params[ours].dtype))
