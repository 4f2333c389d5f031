"""Modules and state for models: `MultiHeadAttention` (`multihead`), `KVCache` (`cache`),
`PagedKVCache` (`paged_cache`), positional encodings (`positional`) and `interop` with
PyTorch's `nn.MultiheadAttention`.

The three classes are also names of this package, as of ``qkv`` itself
(``qkv.nn.MultiHeadAttention is qkv.MultiHeadAttention``), resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "KVCache": "qkv.nn.cache",
    "MultiHeadAttention": "qkv.nn.multihead",
    "PagedKVCache": "qkv.nn.paged_cache",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from qkv.nn.cache import KVCache
    from qkv.nn.multihead import MultiHeadAttention
    from qkv.nn.paged_cache import PagedKVCache


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qkv.nn' has no attribute {name!r}")
