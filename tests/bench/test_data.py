"""`qkv.bench.document_lengths` / `document_ids` / `random_qkv`: the benchmarks' inputs."""

from __future__ import annotations

import pytest
import torch

from qkv.bench import document_ids, document_lengths, random_qkv


@pytest.mark.parametrize(("n", "count"), [(1, 1), (7, 7), (100, 1), (1000, 64)])
def test_documents_fill_the_tokens_each_at_least_one_long(n: int, count: int) -> None:
    lengths = document_lengths(n, count, seed=3)
    assert lengths.shape == (count,) and int(lengths.sum()) == n and int(lengths.min()) >= 1
    ids = document_ids(n, count, seed=3)
    # ids count up by one at each document's first token (hand rule: id = documents started before)
    starts = torch.cumsum(lengths, 0)[:-1]  # first token of documents 1 .. count - 1
    expected = torch.zeros(n, dtype=torch.long)
    expected[starts] = 1
    assert torch.equal(ids, torch.cumsum(expected, 0))


def test_the_same_seed_gives_the_same_documents() -> None:
    assert torch.equal(document_ids(500, 9, seed=1), document_ids(500, 9, seed=1))
    assert not torch.equal(document_ids(500, 9, seed=1), document_ids(500, 9, seed=2))


@pytest.mark.parametrize("count", [0, 11])
def test_a_document_count_outside_1_to_n_is_refused(count: int) -> None:
    with pytest.raises(ValueError, match=f"count must be between 1 and n = 10, got {count}"):
        document_lengths(10, count)


def test_random_qkv_has_the_shape_dtype_and_grad_asked() -> None:
    q, k, v = random_qkv(5, heads=3, head_dim=4, dtype=torch.bfloat16, requires_grad=True)
    for x in (q, k, v):
        assert x.shape == (1, 3, 5, 4) and x.dtype == torch.bfloat16 and x.requires_grad and x.is_leaf
    assert not torch.equal(q, k)
