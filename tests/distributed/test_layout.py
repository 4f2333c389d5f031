"""Contiguous and zigzag layouts: shard, unshard, positions, uneven lengths, errors."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qkv.distributed import positions, shard, shard_lengths, unshard

LAYOUTS = ("contiguous", "zigzag")


@given(
    world_size=st.integers(1, 6),
    extra=st.integers(0, 20),
    layout=st.sampled_from(LAYOUTS),
)
def test_shard_then_unshard_is_identity(world_size: int, extra: int, layout: str) -> None:
    seq_len = (world_size if layout == "contiguous" else 2 * world_size) + extra
    x = torch.arange(2 * 3 * seq_len).reshape(2, 3, seq_len)  # (B, H, T)
    parts = [shard(x, r, world_size, layout, dim=-1) for r in range(world_size)]  # type: ignore[arg-type]
    assert [p.shape[-1] for p in parts] == shard_lengths(seq_len, world_size, layout)  # type: ignore[arg-type]
    assert torch.equal(unshard(parts, layout, dim=-1), x)  # type: ignore[arg-type]
    ids = [positions(seq_len, r, world_size, layout) for r in range(world_size)]  # type: ignore[arg-type]
    for r in range(world_size):
        assert torch.equal(parts[r][0, 0], ids[r])  # the shard of arange is its positions
    assert torch.equal(torch.sort(torch.cat(ids)).values, torch.arange(seq_len))
    lengths = shard_lengths(seq_len, world_size, layout)  # type: ignore[arg-type]
    assert max(lengths) - min(lengths) <= (1 if layout == "contiguous" else 2)


def test_zigzag_pairs_early_and_late_chunks() -> None:
    # the drawing of the module docstring: P = 2, T = 8
    assert positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert positions(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    # uneven: 4 chunks of 13 tokens are 4, 3, 3, 3 (tensor_split); rank 0 holds chunks 0 and 3
    assert positions(13, 0, 2, "zigzag").tolist() == [0, 1, 2, 3, 10, 11, 12]
    assert shard_lengths(13, 2, "contiguous") == [7, 6]
    assert shard_lengths(13, 2, "zigzag") == [7, 6]


def test_shard_along_another_dim_and_gradient() -> None:
    x = torch.randn(5, 12, 3, requires_grad=True)  # (B, T, D)
    parts = [shard(x, r, 3, "zigzag", dim=1) for r in range(3)]
    assert parts[1].shape == (5, 4, 3)
    torch.cat(parts, dim=1).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # every token in exactly one shard


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: shard(torch.zeros(1, 3, 4), 0, 2, "zigzag"), "at least 4 tokens"),
        (lambda: shard(torch.zeros(1, 1, 4), 0, 2, "striped"), "layout must be one of"),  # type: ignore[arg-type]
        (lambda: shard(torch.zeros(1, 8, 4), 2, 2), "rank must be an int in [0, 2)"),
        (lambda: shard(torch.zeros(1, 8, 4), 0, 0), "world_size must be a positive int"),
        (lambda: shard(torch.zeros(8, 4), 0, 2, dim=2), "dim=2 is out of range"),
        (lambda: positions(1, 0, 1, "zigzag"), "at least 2 tokens"),
        (lambda: unshard([]), "non-empty sequence"),
        (lambda: unshard([torch.zeros(1, 4, 2), torch.zeros(1, 5, 2)]), "[4, 5]"),
    ],
)
def test_bad_arguments_are_named(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()  # type: ignore[operator]
