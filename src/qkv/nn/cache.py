"""`KVCache`: the keys and values of one attention layer, kept between decoding steps.

A decoder generates one token at a time. The keys and values of the tokens already seen do
not change, so they are computed once and stored; each step projects only the new token and
attends over the whole cache. With a causal mask aligned bottom-right (qkv's default), a step
of L new queries against S cached keys lets query i see keys 0 .. S - L + i: a prefill
followed by one-token steps gives the outputs of one causal forward over the whole sequence.

Storage is allocated once at full size (no reallocation or concatenation per step); `update`
writes the new rows in place and returns views of the filled part: attention reads those
rows only, whatever ``max_len``. The cache also keeps a running max |k| and max |v| of what it
was given (inf once a NaN or infinity is written), at the cost of the new rows; `bounds` hands
them to `qkv.attention(..., kv_bounds=...)`, whose input checks then skip the cache
(`qkv.attention.bounds`). `truncate` keeps the maxima (still upper bounds); `reset` clears them.
A write to the storage by other means (``cache.k[...] = x``) moves its version counter past the
one `update` left: the next `update` or `bounds` then scans the filled part again (inference
tensors keep no counter, so under ``torch.inference_mode`` such a write goes unseen).

Batch handling: the cache holds ``batch_size`` sequences that advance together, one shared
length for all rows. Sequences of different prompt lengths are handled the usual way: pad
them on the left to one length and pass a key-padding mask over the cached positions (True =
may attend) at every step. To start new sequences call `reset()` (the storage is reused);
for another batch size, make another cache.

Use one cache per layer, under ``torch.no_grad()`` or ``torch.inference_mode()``: the storage
is written in place, which autograd cannot differentiate through across steps.

Shape legend (docs/design.md): B batch, G key/value heads, S length, E key dim, Ev value dim.
"""

from __future__ import annotations

import torch

from qkv._checks import positive_int
from qkv.attention.bounds import KVBounds, largest_magnitude

__all__ = ["KVCache", "storage_heads"]


def storage_heads(owner: str, num_kv_heads: object, d_k: object, d_v: object, dtype: object) -> tuple[int, int, int]:
    """(G, E, Ev) of a cache's storage, checked: positive head counts and widths (d_v defaults
    to d_k) and a floating-point dtype, else a ValueError / TypeError naming ``owner``."""
    G = positive_int(num_kv_heads, f"{owner}: num_kv_heads")
    E = positive_int(d_k, f"{owner}: d_k")
    Ev = E if d_v is None else positive_int(d_v, f"{owner}: d_v")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{owner}: dtype must be a floating-point torch.dtype, got {dtype!r}")
    return G, E, Ev


class KVCache:
    """Preallocated keys (B, G, max_len, E) and values (B, G, max_len, Ev) of one layer.

    Args:
        batch_size: B, the number of sequences decoded together.
        max_len: the most positions the cache can hold (prompt plus generated tokens).
        num_kv_heads: G, the key/value heads of the layer (fewer than its query heads under
            grouped-query attention: the cache is then H / G times smaller).
        d_k: E, key width per head.
        d_v: Ev, value width per head (default d_k).
        dtype, device: of the storage; they must match the keys and values written.

    `qkv.MultiHeadAttention.new_cache(batch_size, max_len)` builds one that fits a module.

    Example:
        >>> cache = KVCache(batch_size=2, max_len=8, num_kv_heads=1, d_k=4)
        >>> k, v = cache.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))  # prefill 3
        >>> k, v = cache.update(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))  # one step
        >>> cache.length, tuple(k.shape)
        (4, (2, 1, 4, 4))
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        d_k: int,
        d_v: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        B = positive_int(batch_size, "KVCache: batch_size")
        S = positive_int(max_len, "KVCache: max_len")
        G, E, Ev = storage_heads("KVCache", num_kv_heads, d_k, d_v, dtype)
        self.k = torch.zeros(B, G, S, E, dtype=dtype, device=device)  # (B, G, max_len, E)
        self.v = torch.zeros(B, G, S, Ev, dtype=dtype, device=device)  # (B, G, max_len, Ev)
        self.length = 0  # positions 0 .. length - 1 hold keys and values
        self.k_max = 0.0  # >= max |k| over the positions written since reset(); inf: a non-finite k
        self.v_max = 0.0  # the same for v
        self._versions = self._storage_versions()  # the storage as this cache last wrote it

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def __repr__(self) -> str:
        B, G, S, E = self.k.shape
        return (
            f"KVCache(length={self.length}/{S}, batch_size={B}, num_kv_heads={G}, d_k={E}, "
            f"d_v={self.v.shape[-1]}, dtype={self.k.dtype}, device={self.k.device})"
        )

    def check_append(self, batch_size: int, length: int) -> None:
        """Raise unless ``length`` positions of ``batch_size`` sequences fit after the current ones."""
        if batch_size != self.batch_size:
            raise ValueError(
                f"KVCache holds batch_size={self.batch_size} sequences, got a batch of {batch_size}; "
                "make a cache per batch size"
            )
        if self.length + length > self.max_len:
            raise ValueError(
                f"KVCache overflow: it holds {self.length} of max_len={self.max_len} positions and "
                f"cannot take {length} more; make it with max_len >= {self.length + length} or reset() it"
            )

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k (B, G, L, E) and v (B, G, L, Ev); return all keys (B, G, S, E) and values
        (B, G, S, Ev) held so far, S = length after the update (views of the storage)."""
        for name, new, store in (("k", k, self.k), ("v", v, self.v)):
            if not isinstance(new, torch.Tensor):
                raise TypeError(f"KVCache.update: {name} must be a torch.Tensor, got {type(new).__name__}")
            if new.ndim != 4 or new.shape[0] != store.shape[0] or new.shape[1] != store.shape[1] or new.shape[3] != store.shape[3]:
                B, G, _, D = store.shape
                raise ValueError(
                    f"KVCache.update: {name} must have shape ({B}, {G}, L, {D}), got {tuple(new.shape)}"
                )
            if new.dtype != store.dtype or new.device != store.device:
                raise TypeError(
                    f"KVCache.update: {name} is {new.dtype} on {new.device} but the cache stores "
                    f"{store.dtype} on {store.device}"
                )
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"KVCache.update: k and v must have the same length, got {k.shape[2]} and {v.shape[2]}")
        L = k.shape[2]
        self.check_append(k.shape[0], L)
        self._rescan_if_written()
        start, stop = self.length, self.length + L
        self.k[:, :, start:stop] = k
        self.v[:, :, start:stop] = v
        self.k_max = max(self.k_max, largest_magnitude(k))  # O(new rows)
        self.v_max = max(self.v_max, largest_magnitude(v))
        self.length = stop
        self._versions = self._storage_versions()
        return self.keys_values()

    def _storage_versions(self) -> tuple[int, int] | None:
        """The storage's version counters (None for inference tensors, which keep none)."""
        if self.k.is_inference() or self.v.is_inference():
            return None
        return self.k._version, self.v._version

    def _rescan_if_written(self) -> None:
        """Bound the filled part afresh when the storage was written since this cache's last
        write: the running maxima never saw what was written by other means."""
        versions = self._storage_versions()
        if versions is not None and versions != self._versions:
            k, v = self.keys_values()
            self.k_max, self.v_max = largest_magnitude(k), largest_magnitude(v)
            self._versions = versions

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled part: keys (B, G, length, E) and values (B, G, length, Ev)."""
        S = self.length
        return self.k[:, :, :S], self.v[:, :, :S]  # (B, G, S, E), (B, G, S, Ev)

    @property
    def bounds(self) -> KVBounds:
        """The running maxima, bound to the views `update` and `keys_values` return (pass them as
        ``qkv.attention(..., kv_bounds=cache.bounds)``; a write to the storage by other means
        outside inference mode is found here, and the filled part is scanned again)."""
        self._rescan_if_written()
        k, v = self.keys_values()
        return KVBounds.of(k, v, self.k_max, self.v_max)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions and forget the rest (e.g. rejected draft tokens)."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length must be an int in [0, {self.length}], got {length!r}")
        self.length = length

    def reset(self) -> None:
        """Forget every position; the storage is kept and overwritten by the next updates."""
        self.length = 0
        self.k_max = self.v_max = 0.0
