"""Modules and state for models: `MultiHeadAttention` (`multihead`), `KVCache` (`cache`),
`PagedKVCache` (`paged_cache`), positional encodings (`positional`) and `interop` with
PyTorch's `nn.MultiheadAttention`.

The three classes are also names of this package, as of ``qkv`` itself
(``qkv.nn.MultiHeadAttention is qkv.MultiHeadAttention``), resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkv._aliases import lazy_names

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

__getattr__ = lazy_names(__name__, _EXPORTS)
