"""Masks and biases as spec text plus tensors (`qkv._private.spec`), and the visible pairs an
interval mask gives by arithmetic (`Mask.visible_pairs`): what the block engine's operators
(`qkv.backends.blocks.ops`) and the traced dispatch read. Expected values come from rendering
the mask or bias densely (`to_dense`), never from the spec code itself."""

from __future__ import annotations

import itertools

import pytest
import torch

import qkv
from qkv._private import spec
from qkv.backends.blocks import ops


def _masks() -> dict[str, qkv.masks.Mask]:
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])
    return {
        "causal": qkv.masks.causal(),
        "causal top-left": qkv.masks.causal("top-left"),
        "sliding_window": qkv.masks.sliding_window(3, 1, align="top-left"),
        "prefix_lm": qkv.masks.prefix_lm(4),
        "documents": qkv.masks.documents(ids),
        "key_padding": qkv.masks.key_padding(torch.tensor([[True] * 7 + [False] * 3])),
        "varlen": qkv.masks.varlen([4, 6], causal=True, window=(2, 0)),
        "padded": qkv.masks.padded(torch.tensor([10]), causal=True),
        "dense": qkv.masks.dense(torch.rand(10, 10, generator=torch.Generator().manual_seed(0)) > 0.5),
        "combined": qkv.masks.documents(ids) & qkv.masks.sliding_window(2),
    }


@pytest.mark.parametrize("name", list(_masks()))
def test_every_mask_but_a_predicate_comes_back_from_its_spec(name: str) -> None:
    mask = _masks()[name]
    tensors: list[torch.Tensor] = []
    text = spec.encode(mask, tensors)
    assert text is not None
    rebuilt = spec.decode(text, tensors, ops._MASKS)  # type: ignore[arg-type]
    assert isinstance(rebuilt, qkv.masks.Mask)
    assert type(rebuilt) is type(mask) and rebuilt.describe() == mask.describe()
    assert torch.equal(rebuilt.to_dense(10, 10), mask.to_dense(10, 10))


def test_a_predicate_has_no_spec_and_the_operators_refuse_it() -> None:
    mask = qkv.masks.predicate(lambda b, h, i, j: i >= j)
    assert spec.encode(mask, []) is None
    assert spec.encode(mask & qkv.masks.causal(), []) is None
    from qkv.scores import ScoreTerms

    assert not ops.encodable(mask, ScoreTerms(4, 4))
    assert not ops.encodable(None, ScoreTerms(4, 4, score_mod=lambda s, b, h, i, j: s))
    assert ops.encodable(qkv.masks.causal(), ScoreTerms(4, 4, softcap=2.0, bias=qkv.bias.alibi(torch.ones(2))))


def test_biases_come_back_from_their_spec_with_their_tensors_in_order() -> None:
    gen = torch.Generator().manual_seed(1)
    bias = qkv.bias.alibi(torch.rand(2, generator=gen)) + qkv.bias.relative(torch.randn(2, 8, generator=gen), num_buckets=8, max_distance=6, bidirectional=False)
    bias = bias + qkv.bias.dense(torch.randn(1, 2, 5, 5, generator=gen))
    tensors: list[torch.Tensor] = []
    text = spec.encode(bias, tensors)
    assert text is not None and len(tensors) == 3
    rebuilt = spec.decode(text, tensors, ops._BIASES)  # type: ignore[arg-type]
    assert isinstance(rebuilt, qkv.bias.Bias)
    torch.testing.assert_close(rebuilt.to_dense(5, 5), bias.to_dense(5, 5), rtol=0, atol=0)


def test_decode_names_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="names 'spiral'"):
        spec.decode("('!',('spiral',3,),)", [], ops._MASKS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="more tensors than the 0 given"):
        spec.decode("('!',('documents','@',None,),)", [], ops._MASKS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fewer tensors than the 1 given"):
        spec.decode("('!',('causal','bottom-right',),)", [torch.zeros(1)], ops._MASKS)  # type: ignore[arg-type]


def test_interval_masks_count_their_visible_pairs_by_arithmetic() -> None:
    masks = [
        qkv.masks.causal(), qkv.masks.causal("top-left"), qkv.masks.sliding_window(0), qkv.masks.sliding_window(2),
        qkv.masks.sliding_window(3, 1), qkv.masks.sliding_window(20, 5, align="top-left"), qkv.masks.prefix_lm(0),
        qkv.masks.prefix_lm(3), qkv.masks.prefix_lm(30, align="top-left"),
    ]
    for (L, S), mask in itertools.product(itertools.product([1, 3, 7, 12], [1, 4, 7, 13]), masks):
        assert mask.visible_pairs(L, S) == int(mask.to_dense(L, S).sum()), (mask.describe(), L, S)


def test_combinations_bound_their_visible_pairs_and_data_masks_give_none() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2]])
    both = qkv.masks.documents(ids) & qkv.masks.sliding_window(1)
    either = qkv.masks.sliding_window(1) | qkv.masks.prefix_lm(2)
    assert qkv.masks.documents(ids).visible_pairs(7, 7) is None
    bound = both.visible_pairs(7, 7)
    assert bound is not None and bound >= int(both.to_dense(7, 7).sum())
    bound = either.visible_pairs(7, 7)
    assert bound is not None and bound >= int(either.to_dense(7, 7).sum())
