"""A transformers cache that appends in place: `growing_cache`.

transformers' default ``DynamicCache`` appends a decoding step's key and value rows with
``torch.cat``: every step copies the whole cache of every layer into fresh memory. At long
contexts that copy costs more than attention itself (a Llama-shaped model, 4 layers, 32k
tokens, 2 cores: about 220 ms of the step against 61 ms of qkv's attention,
`benchmarks/generation_steps.py`), and it is the same for every attention implementation.

`growing_cache()` gives a ``DynamicCache`` whose full-attention layers keep their rows in a
store with spare room at the end: a step writes its new rows there, and the layer hands
attention a view of the filled prefix (no copy; qkv's decode kernel reads strided views in
place). When the store is full it is replaced by one an eighth larger plus 256 rows, copying
the rows once: appending n rows costs O(n) copies in all, not O(n^2). Sliding-window layers
keep transformers' own class (they hold at most the window). Everything else (crop, beam
reordering, ``batch_select_indices``) is transformers' code on the view; the next append
takes the rows it left. After a crop, that append goes to a fresh store: the rows it would
overwrite are still shown by the tensors returned before the crop, and DynamicCache never
changes a tensor it has returned (speculative decoding keeps and compares them).

The rows attention sees are exactly DynamicCache's, so a model gives the same logits with
either cache, on any attention implementation.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["growing_cache"]

# spare rows added when a store is replaced: an eighth of the rows held, at least this many
_MIN_SPARE_ROWS = 256


def _layer_class() -> type:
    """The layer class, made on first use (transformers is imported only then)."""
    global _GROWING_LAYER
    if _GROWING_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class GrowingLayer(DynamicLayer):  # type: ignore[misc,valid-type]  # transformers has no stubs
            """A DynamicLayer that appends into spare room instead of concatenating."""

            def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
                super().lazy_initialization(key_states, value_states)
                self._key_store: torch.Tensor | None = None  # (B, G, capacity, E)
                self._value_store: torch.Tensor | None = None  # (B, G, capacity, Ev)
                # rows of the stores that tensors returned by `update` show: never written again
                self._rows_returned = 0

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                assert self.keys is not None  # set by lazy_initialization
                held = self.keys.shape[-2] if self.keys.numel() else 0
                need = held + key_states.shape[-2]
                if not self._fits(key_states, value_states, held, need):
                    self._replace_stores(key_states, value_states, held, need)
                assert self._key_store is not None and self._value_store is not None
                self._key_store[..., held:need, :].copy_(key_states)
                self._value_store[..., held:need, :].copy_(value_states)
                self.keys = self._key_store[..., :need, :]  # (B, G, need, E): a view of the store
                self.values = self._value_store[..., :need, :]  # (B, G, need, Ev)
                self._rows_returned = need
                return self.keys, self.values

            def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, need: int) -> bool:
                """Whether the new rows go into the current stores: they exist, hold the layer's
                rows as their prefix (not replaced by a beam reorder or a batch selection), have
                room, no tensor returned before shows the rows to be written (a crop), and match
                the new rows' batch, heads, dims and dtype."""
                keys, values, store, values_store = self.keys, self.values, self._key_store, self._value_store
                if keys is None or values is None or store is None or values_store is None or store.shape[-2] < need:
                    return False
                if held < self._rows_returned:
                    return False  # cropped: rows held..need are still on show in returned tensors
                if held and (keys.data_ptr() != store.data_ptr() or keys.stride() != store.stride()):
                    return False
                if held and (values.data_ptr() != values_store.data_ptr() or values.stride() != values_store.stride()):
                    return False
                same = store.shape[:-2] == key_states.shape[:-2] and store.shape[-1] == key_states.shape[-1]
                same = same and values_store.shape[:-2] == value_states.shape[:-2] and values_store.shape[-1] == value_states.shape[-1]
                return same and store.dtype == key_states.dtype and values_store.dtype == value_states.dtype

            def _replace_stores(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, need: int) -> None:
                capacity = need + max(_MIN_SPARE_ROWS, need // 8)
                batch_heads, kdim, vdim = key_states.shape[:-2], key_states.shape[-1], value_states.shape[-1]
                key_store = key_states.new_empty(*batch_heads, capacity, kdim)  # (B, G, capacity, E)
                value_store = value_states.new_empty(*value_states.shape[:-2], capacity, vdim)  # (B, G, capacity, Ev)
                if held:
                    assert self.keys is not None and self.values is not None  # held rows exist
                    key_store[..., :held, :].copy_(self.keys)
                    value_store[..., :held, :].copy_(self.values)
                self._key_store, self._value_store = key_store, value_store
                self._rows_returned = 0

            def reset(self) -> None:
                self._key_store = self._value_store = None
                self._rows_returned = 0
                super().reset()

        _GROWING_LAYER = GrowingLayer
    return _GROWING_LAYER


_GROWING_LAYER: type | None = None


def growing_cache(config: object | None = None) -> Any:
    """A ``transformers.DynamicCache`` whose full-attention layers append in place (see the
    module docstring); ``config``: the model's config, as for ``DynamicCache(config=...)``
    (sliding-window layers then keep their own class). Pass it to ``generate`` or the model as
    ``cache`` (``past_key_values`` in older transformers). The qkv backend keeps running bounds
    on it as on a DynamicCache.

    >>> cache = growing_cache()
    >>> type(cache).__name__
    'DynamicCache'
    """
    import transformers
    from transformers.cache_utils import DynamicLayer

    layer = _layer_class()
    made = transformers.DynamicCache(config=config) if config is not None else transformers.DynamicCache()  # type: ignore[arg-type]  # any model config
    cache: Any = made  # transformers' class gets qkv's flag below
    if cache.layers:
        cache.layers = [layer() if type(existing) is DynamicLayer else existing for existing in cache.layers]
    else:
        cache.layer_class_to_replicate = layer
    cache._qkv_grows_in_place = True
    return cache
