"""Running bounds on a transformers cache, so that a decoding step's input checks read only its new tokens.

`qkv.attention` scans k and v before any kernel runs (the overflow rule and the NaN rule,
`qkv.attention.bounds`); on a decoding step that scan reads the whole cache. transformers'
attention interface hands the backend the cache's key and value tensors, but neither the
cache nor the positions written (its keywords are ``dropout``, ``scaling``, ``position_ids``,
``use_cache`` and the model's own): the backend alone cannot tell which rows are new.

`track_bounds(cache)` wraps one cache's ``update``: every write of new key / value rows raises
that layer's running max |k| and max |v| (one pass over the new rows, as the cache stores them),
and the tensors ``update`` returns are noted with those bounds (`KVBounds`). Every row a layer
returns was written through ``update`` (appended, kept by a window, reordered by a beam search,
cropped) or is a static cache's zeros, so the running max bounds it. The first write a wrapper
sees for a layer scans everything the layer returns, so rows the cache held before it was
wrapped are bounded too. The backend passes the noted bounds as ``kv_bounds`` when it is
handed exactly those tensors, unchanged since (`KVBounds.describes`); a tensor written by
other means gets a new version, and the next update of its layer scans the whole layer again.
Inference tensors (made under ``torch.inference_mode``) keep no version counter: a write to them
by other means goes unseen, and the running max may then miss it.

The backend wraps a model's own caches without being asked (`track_module_cache`, from a
forward pre-hook on each attention module that runs on qkv: the module is handed the cache,
the attention function is not), when it is a plain `DynamicCache` or
`StaticCache` (their layers return exactly the rows written; a quantized cache returns
dequantized ones, which the running max of the written rows need not bound).
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar, cast

import torch

from qkv.attention.bounds import KVBounds, largest_magnitude

__all__ = ["noted_bounds", "track_bounds", "track_module_cache"]

# id of the keys tensor a cache returned -> (a weak reference to it, the bounds of it and its
# values); an entry goes with its tensor. Keyed by id, not by the tensor: a WeakKeyDictionary
# compares live tensors with ==, which is elementwise.
_noted: dict[int, tuple[weakref.ref[torch.Tensor], KVBounds]] = {}


def _note(keys: torch.Tensor, bounds: KVBounds) -> None:
    key_id = id(keys)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _noted.get(key_id)
        if entry is not None and entry[0] is ref:
            del _noted[key_id]

    _noted[key_id] = (weakref.ref(keys, forget), bounds)

CacheT = TypeVar("CacheT")


def track_bounds(cache: CacheT) -> CacheT:
    """``cache`` (a transformers ``Cache``: dynamic, static, sliding, hybrid) with running bounds
    on what each layer holds; pass it to ``generate`` or the model as ``cache`` (``past_key_values`` in older transformers).
    Returns the same object.

    >>> import transformers
    >>> from qkv.integrations.transformers import track_bounds
    >>> cache = track_bounds(transformers.DynamicCache())
    >>> model_inputs = {"cache": cache}  # model.generate(ids, **model_inputs)
    """
    update = getattr(cache, "update", None)
    if not callable(update):
        raise TypeError(f"track_bounds takes a transformers Cache (with an update method), got {type(cache).__name__}")
    if getattr(cache, "_qkv_tracks_bounds", False):
        return cache  # tracked already: wrapping twice would count every write twice (harmless) and cost twice
    running: dict[int, tuple[float, float]] = {}
    # layer -> the tensors its last update returned and their bounds: a layer keeps those very
    # tensors (DynamicCache's cat result, StaticCache's buffers), so a write to them by other
    # means (``cache.layers[i].keys[...] = x``) shows as a changed version before the next update
    returned: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], KVBounds]] = {}

    def tracked(key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object):
        if _written_since(returned.get(layer_idx)):
            running.pop(layer_idx, None)  # rows the running max never saw: scan the layer again
        keys, values = cast("tuple[torch.Tensor, torch.Tensor]", update(key_states, value_states, layer_idx, *args, **kwargs))
        if torch.compiler.is_compiling():
            # a scan would break the graph: the layer's bound is forgotten, and the next eager
            # write scans what the layer then holds
            running.pop(layer_idx, None)
            returned.pop(layer_idx, None)
            return keys, values
        if layer_idx in running:
            k_max, v_max = running[layer_idx]
            # the rows as stored: a cache in another dtype rounds them, which may raise |x|
            k_max = max(k_max, largest_magnitude(key_states.to(keys.dtype)))
            v_max = max(v_max, largest_magnitude(value_states.to(values.dtype)))
        else:  # the layer's first write seen here: bound what it held before as well
            k_max, v_max = largest_magnitude(keys), largest_magnitude(values)
        running[layer_idx] = (k_max, v_max)
        bounds = KVBounds.of(keys, values, k_max, v_max)
        _note(keys, bounds)
        returned[layer_idx] = (weakref.ref(keys), weakref.ref(values), bounds)
        return keys, values

    cache.update = tracked  # type: ignore[attr-defined]
    cache._qkv_tracks_bounds = True  # type: ignore[attr-defined]
    return cache


def _written_since(last: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], KVBounds] | None) -> bool:
    """Whether the tensors a layer's last update returned were written in place since (their
    version moved on). Tensors gone since were replaced by the cache's own code (a crop or a
    beam reorder keeps rows that were written through ``update``): no sign of a write."""
    if last is None:
        return False
    keys, values = last[0](), last[1]()
    return keys is not None and values is not None and not last[2].describes(keys, values)


def noted_bounds(key: torch.Tensor, value: torch.Tensor) -> KVBounds | None:
    """The bounds a tracked cache noted for exactly these key and value tensors, unchanged since; else None."""
    entry = _noted.get(id(key))
    if entry is None or entry[0]() is not key:
        return None
    return entry[1] if entry[1].describes(key, value) else None


def _plain_cache(cache: object) -> bool:
    """Whether ``cache`` is exactly transformers' DynamicCache or StaticCache (not a subclass:
    those change what update returns)."""
    import transformers

    return type(cache) in (transformers.DynamicCache, transformers.StaticCache)


def track_module_cache(kwargs: dict[str, Any]) -> None:
    """Wrap the cache an attention module's forward is handed (``cache``, or ``past_key_values``
    in older transformers) with `track_bounds`, when it is a plain DynamicCache / StaticCache,
    so that each decoding step's checks scan its new rows only."""
    if torch.compiler.is_compiling():
        return
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and not getattr(cache, "_qkv_tracks_bounds", False) and _plain_cache(cache):
        track_bounds(cache)
