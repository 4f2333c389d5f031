"""`KVBounds`: what a KV cache already knows about the keys and values it hands to attention.

`qkv.attention` checks its inputs before any kernel runs: the largest |k| bounds the scores
(the overflow rule) and a non-finite entry of k or v triggers the NaN rule (`qkv.attention.nan_rule`).
Both need one pass over k and v. For a decoding step that pass reads the whole cache, as many
bytes as the attention itself. A cache sees every row when it is written, so it keeps a running
max |k| and max |v| (inf once a non-finite value is written) at O(new tokens) per step, and
passes them with its views: `qkv.attention(..., kv_bounds=cache.bounds)`.

A bound names the exact tensors it describes (storage address, shape, strides and, outside
inference mode, PyTorch's version counter, which any in-place write bumps). Attention uses it
only for those tensors, and scans as before otherwise: a stale or misplaced bound costs time,
never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.backends.overflow import largest_magnitude

__all__ = ["KVBounds", "largest_magnitude"]

_Identity = tuple[object, ...]


def _identity(x: torch.Tensor) -> _Identity:
    """Which tensor x is and, where PyTorch tracks it, how often it was written in place."""
    version = None if x.is_inference() else x._version  # inference tensors keep no counter
    try:
        where: object = x.data_ptr()
    except RuntimeError:  # a wrapper without storage (torch.func.grad's): the object itself
        where = ("object", id(x))
    return (where, x.device, x.dtype, tuple(x.shape), x.stride(), version)


@dataclass(frozen=True, eq=False)
class KVBounds:
    """Upper bounds on max |k| and max |v| of one pair of tensors (inf: may be non-finite).

    Made by `qkv.KVCache.bounds` (or `KVBounds.of`); `qkv.attention(..., kv_bounds=...)` then
    skips its scan of k and v, and decides exactly as the scan would: the overflow rule
    compares a bound (a tighter scan runs only when the bound is too large), and the NaN rule
    runs whenever a bound is inf.

    Example:
        >>> k, v = torch.ones(1, 1, 3, 2), torch.full((1, 1, 3, 2), -4.0)
        >>> b = KVBounds.of(k, v)
        >>> b.k_max, b.v_max, b.describes(k, v), b.describes(k.clone(), v)
        (1.0, 4.0, True, False)
    """

    k_max: float
    v_max: float
    k_id: _Identity
    v_id: _Identity

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor, k_max: float | None = None, v_max: float | None = None) -> KVBounds:
        """Bounds of k and v: the given ones (the caller vouches for them), else scanned."""
        k_max = largest_magnitude(k) if k_max is None else float(k_max)
        v_max = largest_magnitude(v) if v_max is None else float(v_max)
        return KVBounds(k_max, v_max, _identity(k), _identity(v))

    def describes(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether these bounds were made for exactly k and v, unchanged since."""
        return _identity(k) == self.k_id and _identity(v) == self.v_id

    def carried(self, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> KVBounds | None:
        """The same bounds for exact copies k_new, v_new of k, v (a widening cast), or None when
        these bounds do not describe k and v."""
        return KVBounds.of(k_new, v_new, self.k_max, self.v_max) if self.describes(k, v) else None
