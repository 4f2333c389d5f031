"""qkv: attention as the seed articles teach it, verified against the kernels people run.

The public API is re-exported here. Names are resolved lazily so that ``qkv --help`` and
``import qkv.reference`` do not pay for importing PyTorch.

    >>> import torch, qkv
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> qkv.attention(q, k, v).shape
    torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qkv import _log  # the qkv logger and its NullHandler, before any module logs

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "attention": "qkv.functional",
    "explain": "qkv.functional",
    "attention_weights": "qkv.functional",
    "Explanation": "qkv.functional",
    "MultiHeadAttention": "qkv.modules",
    "KVCache": "qkv.cache",
    "KVBounds": "qkv._bounds",
    "PagedKVCache": "qkv.paged_cache",
    "attention_varlen": "qkv.varlen",
}
_SUBMODULES = ("bias", "compat", "masks", "reference", "functional", "positional", "modules", "interop", "models", "examples", "viz", "distributed")

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:
    from qkv import (
        bias,
        compat,
        distributed,
        examples,
        functional,
        interop,
        masks,
        models,
        modules,
        positional,
        reference,
        viz,
    )
    from qkv._bounds import KVBounds
    from qkv.cache import KVCache
    from qkv.functional import Explanation, attention, attention_weights, explain
    from qkv.modules import MultiHeadAttention
    from qkv.paged_cache import PagedKVCache
    from qkv.varlen import attention_varlen


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"qkv.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
