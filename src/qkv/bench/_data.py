"""The inputs benchmarks share: random q, k, v and packed documents of random lengths."""

from __future__ import annotations

import torch

__all__ = ["document_ids", "document_lengths", "random_qkv"]


def document_lengths(n: int, count: int, seed: int = 0) -> torch.Tensor:
    """Lengths (count,) of ``count`` packed documents that fill n tokens, each at least one
    token long: count - 1 distinct cut points drawn uniformly among the n - 1 gaps."""
    if not 1 <= count <= n:
        raise ValueError(f"count must be between 1 and n = {n}, got {count}")
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(n - 1, generator=gen)[: count - 1].sort().values + 1  # (count - 1,)
    return torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))  # (count,)


def document_ids(n: int, count: int, seed: int = 0) -> torch.Tensor:
    """ids (n,) of the documents of `document_lengths`: 0 for the first document's tokens, ...

    >>> document_ids(6, 3, seed=1).tolist() == sorted(document_ids(6, 3, seed=1).tolist())
    True
    """
    lengths = document_lengths(n, count, seed)
    return torch.repeat_interleave(torch.arange(count), lengths)  # (n,)


def random_qkv(
    n: int,
    *,
    heads: int = 8,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (1, heads, n, head_dim) of standard normal entries rounded to ``dtype``, leaves
    that require grad when asked."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, heads, n, head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_(requires_grad) for _ in range(3))
    return q, k, v
