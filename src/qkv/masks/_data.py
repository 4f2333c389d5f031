"""Masks given by data per position: packed `documents` (ids) and `key_padding` (valid keys).

Their layouts come from each block's smallest and largest document id, or from each key
block's valid keys.

Reference: Krell et al., "Efficient sequence packing without cross-contamination" (2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qkv._private import torch as private_torch
from qkv.masks._base import Device, Mask, batch_index
from qkv.masks._layout import compose_states, states_from_dense


def _block_min_max(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest value of each block of ``block`` positions of x (B, T): two (B, n)."""
    B, T = x.shape
    n = math.ceil(T / block)
    padded = torch.cat([x, x[:, -1:].expand(B, n * block - T)], dim=1)  # (B, n * block): the last value repeated
    blocks = padded.view(B, n, block)  # (B, n, block)
    return blocks.amin(dim=2), blocks.amax(dim=2)


@dataclass(frozen=True, eq=False)
class Documents(Mask):
    """Packed sequences: a query sees only the keys of its own document.

    ``ids`` (B | 1, S) gives the document of every key position; queries take the ids of
    the last L positions (bottom-right, so a decoding step continues its document). With
    ``kv_ids`` (B | 1, S), ``ids`` (B | 1, L) are the queries' own ids (cross-attention).

    The layout compares each block's smallest and largest id: exact when the documents lie
    one after another (ids sorted), otherwise a block may be reported partial while empty.
    """

    ids: torch.Tensor
    kv_ids: torch.Tensor | None = None

    @property
    def batch(self) -> int | None:
        sizes = {self.ids.shape[0]} | ({self.kv_ids.shape[0]} if self.kv_ids is not None else set())
        size = max(sizes)
        return size if size > 1 else None

    def _key_ids(self) -> torch.Tensor:
        return self.ids if self.kv_ids is None else self.kv_ids

    def to(self, device: torch.device | str) -> Documents:
        return Documents(self.ids.to(device), None if self.kv_ids is None else self.kv_ids.to(device))

    def spec_fields(self) -> tuple[object, ...]:
        return ("documents", self.ids, self.kv_ids)

    def check_size(self, L: int, S: int) -> None:
        keys = self._key_ids()
        if keys.shape[1] != S:
            raise ValueError(f"documents() has ids for {keys.shape[1]} key positions, the keys have length S={S}")
        if self.kv_ids is None and L > S:
            raise ValueError(
                f"documents(ids) places the L={L} queries on the last positions of the S={S} keys; "
                "L > S needs documents(q_ids, kv_ids)"
            )
        if self.kv_ids is not None and self.ids.shape[1] != L:
            raise ValueError(f"documents(q_ids, kv_ids) has {self.ids.shape[1]} query ids, the queries have L={L}")

    def _query_ids(self, L: int, S: int) -> torch.Tensor:
        return self.ids[:, S - L :] if self.kv_ids is None else self.ids  # (B | 1, L)

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        keys = self._key_ids().to(device)  # (B | 1, S)
        if bool((keys[:, 1:] < keys[:, :-1]).any()):
            return None  # a document in several places: not one interval per query
        queries = self._query_ids(L, S).to(device)  # (B | 1, L)
        B = max(keys.shape[0], queries.shape[0])
        keys, queries = keys.expand(B, -1).contiguous(), queries.expand(B, -1).contiguous()  # (B, S), (B, L)
        lo = torch.searchsorted(keys, queries)  # first key of the query's document
        hi = torch.searchsorted(keys, queries, right=True) - 1  # its last key (lo > hi: no key)
        return lo, hi

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        keys = self._key_ids().to(kv_idx.device)
        queries = self.ids.to(q_idx.device)
        q_pos = q_idx + (S - L) if self.kv_ids is None else q_idx
        q_doc = queries[batch_index(b, queries.shape[0]), q_pos]
        k_doc = keys[batch_index(b, keys.shape[0]), kv_idx]
        return q_doc == k_doc

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        q_min, q_max = _block_min_max(self._query_ids(L, S).to(device), block_q)  # (B | 1, nQ) each
        k_min, k_max = _block_min_max(self._key_ids().to(device), block_k)  # (B | 1, nK) each
        one_doc = (q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]  # (B | 1, nQ, nK)
        full = one_doc & (q_min[:, :, None] == k_min[:, None, :])
        overlap = (q_max[:, :, None] >= k_min[:, None, :]) & (k_max[:, None, :] >= q_min[:, :, None])
        return compose_states(full, overlap)[:, None]  # (B | 1, 1, nQ, nK)

    def describe(self) -> str:
        if private_torch.host_unreadable(self.ids):
            # the count needs the ids' values, and their shape may be symbolic (dynamic shapes)
            return "documents(ids)"
        rows = self.ids.sort(dim=1).values  # (B | 1, L): each row's ids in order
        n_docs = int((rows[:, 1:] != rows[:, :-1]).sum()) + rows.shape[0]  # distinct ids, counted per row
        where = f" in {rows.shape[0]} rows" if rows.shape[0] > 1 else ""
        return f"documents({n_docs} documents{where}, ids {tuple(self.ids.shape)})"


def _check_ids(ids: object, name: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must hold integer document ids, got dtype {ids.dtype}")
    if ids.ndim not in (1, 2) or ids.numel() == 0:
        raise ValueError(f"{name} must have shape (L,) or (B, L) and be non-empty, got {tuple(ids.shape)}")
    return ids.long().reshape(-1, ids.shape[-1])  # (B | 1, L)


def documents(ids: torch.Tensor, kv_ids: torch.Tensor | None = None) -> Documents:
    """Packed sequences: query and key see each other only within one document.

    Args:
        ids: (S,) or (B, S) integer document id of every position (per batch row if 2-D).
            Queries take the ids of the last L positions (bottom-right alignment).
        kv_ids: optional (S,) or (B, S) ids of the keys; ``ids`` are then the queries' own
            (L,) or (B, L) ids.

    >>> print(documents(torch.tensor([0, 0, 1, 1, 1])).to_dense(5, 5).int()[0, 0])
    tensor([[1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    q_ids = _check_ids(ids, "ids")
    k_ids = None if kv_ids is None else _check_ids(kv_ids, "kv_ids")
    if k_ids is not None:
        if k_ids.device != q_ids.device:
            raise ValueError(f"ids are on {q_ids.device} but kv_ids on {k_ids.device}")
        if q_ids.shape[0] != k_ids.shape[0] and 1 not in (q_ids.shape[0], k_ids.shape[0]):
            raise ValueError(f"ids {tuple(ids.shape)} and kv_ids {tuple(k_ids.shape)} have different batch sizes")
    return Documents(q_ids, k_ids)


@dataclass(frozen=True, eq=False)
class KeyPadding(Mask):
    """Every query of batch row b sees the valid keys of row b: ``valid`` (B, S) or ``lengths`` (B,)."""

    valid: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def batch(self) -> int | None:
        data = self.valid if self.valid is not None else self.lengths
        assert data is not None  # the constructor key_padding() sets exactly one of them
        return data.shape[0] if data.shape[0] > 1 else None

    def check_size(self, L: int, S: int) -> None:
        if self.valid is not None and self.valid.shape[1] != S:
            raise ValueError(f"key_padding(valid) has shape {tuple(self.valid.shape)}, the keys have length S={S}")
        # while tracing the lengths cannot be read: a length beyond S then hides no key, as S would
        if self.lengths is not None and not private_torch.host_unreadable(self.lengths) and int(self.lengths.max()) > S:
            raise ValueError(f"key_padding(lengths) has a length {int(self.lengths.max())} > S={S}")

    def to(self, device: torch.device | str) -> KeyPadding:
        return KeyPadding(
            None if self.valid is None else self.valid.to(device), None if self.lengths is None else self.lengths.to(device)
        )

    def spec_fields(self) -> tuple[object, ...]:
        return ("key_padding", self.valid, self.lengths)

    def _valid(self, S: int, device: Device) -> torch.Tensor:
        """(B | 1, S) bool."""
        if self.valid is not None:
            return self.valid.to(device)
        assert self.lengths is not None
        return torch.arange(S, device=device)[None, :] < self.lengths.to(device)[:, None]

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        valid = self._valid(S, device)  # (B | 1, S)
        positions = torch.arange(S, device=device)
        first = torch.where(valid, positions, S).amin(dim=1)  # (B | 1,): S when no key is valid
        last = torch.where(valid, positions, -1).amax(dim=1)
        if bool((valid.sum(dim=1) != (last - first + 1).clamp(min=0)).any()):
            return None  # holes between valid keys
        return first[:, None].expand(-1, L), last[:, None].expand(-1, L)  # (B | 1, L) each

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        if self.valid is not None:
            valid = self.valid.to(kv_idx.device)
            return valid[batch_index(b, valid.shape[0]), kv_idx]
        assert self.lengths is not None
        lengths = self.lengths.to(kv_idx.device)
        return kv_idx < lengths[batch_index(b, lengths.shape[0])]

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        valid = self._valid(S, device)  # (B | 1, S)
        per_key_block = states_from_dense(valid[:, None, None, :], 1, block_k)  # (B | 1, 1, 1, nK)
        n_q = math.ceil(L / block_q)
        return per_key_block.expand(-1, -1, n_q, -1)  # (B | 1, 1, nQ, nK)

    def describe(self) -> str:
        if private_torch.host_unreadable(self.valid, self.lengths):
            return "key_padding(valid)" if self.valid is not None else "key_padding(lengths)"  # sizes may be symbolic
        if self.valid is not None:
            return f"key_padding(valid {tuple(self.valid.shape)})"
        assert self.lengths is not None
        return f"key_padding(lengths {self.lengths.tolist() if self.lengths.numel() <= 8 else tuple(self.lengths.shape)})"


def key_padding(valid: torch.Tensor) -> KeyPadding:
    """Hide padded keys: ``valid`` is bool (B, S) (True = real token) or integer lengths (B,).

    >>> print(key_padding(torch.tensor([2, 3])).to_dense(1, 4).int()[:, 0, 0])
    tensor([[1, 1, 0, 0],
            [1, 1, 1, 0]], dtype=torch.int32)
    """
    if not isinstance(valid, torch.Tensor):
        raise TypeError(f"key_padding() takes a torch.Tensor, got {type(valid).__name__}")
    if valid.dtype == torch.bool:
        if valid.ndim != 2:
            raise ValueError(f"key_padding(valid) takes a bool tensor (B, S), got shape {tuple(valid.shape)}")
        return KeyPadding(valid=valid)
    if valid.is_floating_point() or valid.is_complex():
        raise TypeError(f"key_padding() takes bool (B, S) or integer lengths (B,), got dtype {valid.dtype}")
    if valid.ndim != 1 or valid.numel() == 0:
        raise ValueError(f"key_padding(lengths) takes a (B,) integer tensor, got shape {tuple(valid.shape)}")
    if private_torch.host_unreadable(valid):
        gate = private_torch.require((valid >= 0).all(), "qkv.masks.key_padding(lengths) must be >= 0 (checked inside a traced graph)")
        return KeyPadding(lengths=valid.long() * gate.long())  # times 1: the check runs with the graph
    if bool((valid < 0).any()):
        raise ValueError(f"key_padding(lengths) must be >= 0, got {valid.tolist()}")
    return KeyPadding(lengths=valid.long())
