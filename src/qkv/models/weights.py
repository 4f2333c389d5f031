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

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from qkv.models.config import BertConfig

__all__ = [
    "PICKLE_SUFFIXES",
    "TensorInfo",
    "check_checkpoint",
    "checkpoint_keys",
    "expected_shapes",
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


def expected_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """qkv parameter name -> shape, for every parameter of a `BertEncoder` of ``config``,
    computed from the config alone: the file can be checked before anything is allocated."""
    D, inner = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word.weight": (config.vocab_size, D),
        "embeddings.position.weight": (config.max_position_embeddings, D),
        "embeddings.token_type.weight": (config.type_vocab_size, D),
        "embeddings.norm.weight": (D,),
        "embeddings.norm.bias": (D,),
    }
    for i in range(config.num_hidden_layers):
        layer = f"layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):  # all D -> D (H * E = D)
            shapes[f"{layer}.attention.{proj}.weight"] = (D, D)
            shapes[f"{layer}.attention.{proj}.bias"] = (D,)
        for norm in ("attention_norm", "ffn_norm"):
            shapes[f"{layer}.{norm}.weight"] = (D,)
            shapes[f"{layer}.{norm}.bias"] = (D,)
        shapes[f"{layer}.ffn_in.weight"] = (inner, D)
        shapes[f"{layer}.ffn_in.bias"] = (inner,)
        shapes[f"{layer}.ffn_out.weight"] = (D, inner)
        shapes[f"{layer}.ffn_out.bias"] = (D,)
    return shapes


def check_checkpoint(path: str | Path, config: BertConfig) -> dict[str, str]:
    """Check a safetensors file against ``config`` without reading a tensor or building a model.

    Every problem is reported at once, in one ValueError naming each key: missing,
    unexpected, wrong shape, non-float dtype. A config that asks for a million layers
    therefore fails here, against the file, before a million layers are allocated.
    Returns qkv parameter name -> checkpoint key.
    """
    path = Path(path)
    infos = read_header(path)
    prefix, skipped = _strip_nesting(list(infos))
    problems: list[str] = []
    held = _layers_held(infos, prefix)
    if config.num_hidden_layers > held:
        # Said once, not as one missing key per parameter of every absent layer (sixteen million
        # names for a million layers); the layers the file does hold are checked key by key.
        problems.append(
            f"the config's num_hidden_layers={config.num_hidden_layers} asks for layers "
            f"{held}..{config.num_hidden_layers - 1}, which the file does not hold (it has {held})"
        )
        config = dataclasses.replace(config, num_hidden_layers=max(held, 1))
    mapping = checkpoint_keys(config)
    shapes = expected_shapes(config)
    wanted = {ours: prefix + theirs for ours, theirs in mapping.items()}

    missing = [key for key in wanted.values() if key not in infos]
    if missing:
        problems.append(f"missing keys ({len(missing)}): {_listing(missing)}")
    expected = set(wanted.values()) | skipped
    unexpected = [key for key in infos if key not in expected]
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {_listing(unexpected)}")
    for ours, theirs in wanted.items():
        info = infos.get(theirs)
        if info is None:
            continue
        if info.shape != shapes[ours]:
            problems.append(f"{theirs}: shape {list(info.shape)}, expected {list(shapes[ours])} from the config")
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{theirs}: dtype {info.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
    if problems:
        raise ValueError(f"{path} does not fit the BERT config:\n  " + "\n  ".join(problems))
    return wanted


# Past this many keys, a listing shows the first ones and a count (a config with a million
# layers would otherwise print sixteen million names).
_LISTED_KEYS = 40


def _layers_held(infos: dict[str, TensorInfo], prefix: str) -> int:
    """1 + the highest encoder layer index among the file's keys (0 when it has none)."""
    pattern = re.compile(rf"{re.escape(prefix)}encoder\.layer\.(\d+)\.")
    indices = [int(match.group(1)) for key in infos if (match := pattern.match(key))]
    return max(indices, default=-1) + 1


def _listing(keys: list[str]) -> str:
    shown = ", ".join(keys[:_LISTED_KEYS])
    return shown if len(keys) <= _LISTED_KEYS else f"{shown}, ... and {len(keys) - _LISTED_KEYS} more"


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
        if not all(_is_count(n) for n in (*shape, begin, end)) or begin > end:
            raise ValueError(
                f"{path}: tensor {name!r} has a malformed shape {list(shape)} or data offsets "
                f"[{begin!r}, {end!r}] (non-negative integers, begin <= end)"
            )
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
    _check_tiling(path, infos, data_size)
    return infos


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(path: Path, infos: dict[str, TensorInfo], data_size: int) -> None:
    """The tensors' byte ranges must tile the data section, in some order, with no overlap
    and no hole, as the format requires: two tensors sharing bytes would alias each other."""
    ranges = sorted(infos.items(), key=lambda item: (item[1].begin, item[1].end))
    position, previous = 0, None
    for name, info in ranges:
        if info.begin < position:
            raise ValueError(
                f"{path}: tensors {previous!r} and {name!r} overlap (data bytes {info.begin}..{position} "
                "are claimed by both); the header is corrupt"
            )
        if info.begin > position:
            raise ValueError(
                f"{path}: data bytes {position}..{info.begin} belong to no tensor (a hole before "
                f"{name!r}); the header is corrupt"
            )
        position, previous = info.end, name
    if position != data_size:
        raise ValueError(
            f"{path}: the tensors cover {position} data bytes but the file holds {data_size}; "
            "the header is corrupt"
        )


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
    wanted = check_checkpoint(path, config)
    params = module.state_dict()
    actual = {name: tuple(p.shape) for name, p in params.items()}
    expected = expected_shapes(config)
    if actual != expected:
        # The module, checkpoint_keys and expected_shapes are written together: a difference is a qkv bug.
        differ = sorted(k for k in set(actual) | set(expected) if actual.get(k) != expected.get(k))
        raise RuntimeError(f"qkv's BERT module and its checkpoint mapping disagree on {differ}")

    tensors: dict[str, torch.Tensor] = {}
    not_finite: list[str] = []
    try:
        with safe_open(str(path), framework="pt") as f:
            for ours, theirs in wanted.items():
                tensor = f.get_tensor(theirs)
                if not torch.isfinite(tensor).all():
                    not_finite.append(theirs)
                tensors[ours] = tensor
    except SafetensorError as error:  # anything the header checks above did not foresee
        raise ValueError(f"{path} cannot be read as safetensors: {error}") from None
    if not_finite:
        raise ValueError(f"{path} has NaN or infinite values in: {', '.join(not_finite)}")
    with torch.no_grad():
        for ours, tensor in tensors.items():
            params[ours].copy_(tensor.to(params[ours].dtype))
