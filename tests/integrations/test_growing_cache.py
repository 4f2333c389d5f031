"""`growing_cache`: a DynamicCache that appends in place. Its tokens and logits equal
transformers' own DynamicCache on eager attention (the independent source), and a decoding
step writes into the same store instead of copying the cache."""

from __future__ import annotations

import pytest
import torch
import transformers

from qkv.integrations.transformers import growing_cache
from qkv.integrations.transformers._growing import _MIN_SPARE_ROWS
from tests.integrations import _tiny_models as tiny

NAME = tiny.NAME


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: a sliding layer keeps its own class
@pytest.mark.parametrize("impl", ["eager", NAME])
def test_greedy_generate_equals_a_dynamic_cache_on_eager(family: str, impl: str) -> None:
    models = tiny.trio(tiny.DECODERS[family]())
    ids, mask = tiny.padded_batch(7, (0, 3), "left")
    expected = models["eager"].generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
        **tiny.cache_argument(models["eager"], transformers.DynamicCache(config=models["eager"].config)),
    )  # fmt: skip
    cache = growing_cache(models[impl].config)
    got = models[impl].generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, **tiny.cache_argument(models[impl], cache)
    )
    assert torch.equal(got, expected)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert "GrowingLayer" in kinds and (family != "gemma2" or "DynamicSlidingWindowLayer" in kinds)


def test_steps_write_into_one_store_and_equal_concatenation() -> None:
    torch.manual_seed(0)
    cache, plain = growing_cache(), transformers.DynamicCache()
    prompt_k, prompt_v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 5)
    cache.update(prompt_k, prompt_v, 0)
    plain.update(prompt_k, prompt_v, 0)
    (layer,) = cache.layers
    store = layer._key_store
    assert store.shape[-2] == 10 + _MIN_SPARE_ROWS
    for _ in range(5):
        k, v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 5)
        keys, values = cache.update(k, v, 0)
        want_k, want_v = plain.update(k, v, 0)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
        assert layer._key_store is store and keys.data_ptr() == store.data_ptr()  # a view, no copy
    assert cache.get_seq_length() == 15


def test_a_full_store_grows_once_and_keeps_every_row() -> None:
    cache = growing_cache()
    rows = torch.arange(3 * (_MIN_SPARE_ROWS + 20), dtype=torch.float32).reshape(1, 1, -1, 1)  # (1, 1, 3 * (spare + 20), 1)
    first = rows[:, :, :20]
    cache.update(first, first, 0)
    (layer,) = cache.layers
    before = layer._key_store
    rest = rows[:, :, 20:]  # more than the spare room: the store is replaced, rows copied once
    keys, values = cache.update(rest, rest, 0)
    assert layer._key_store is not before and torch.equal(keys, rows) and torch.equal(values, rows)


def test_crop_and_batch_selection_then_append() -> None:
    torch.manual_seed(1)
    cache, plain = growing_cache(), transformers.DynamicCache()
    rows = torch.randn(3, 2, 6, 4)
    for target in (cache, plain):
        target.update(rows, rows, 0)
    cache.crop(-2)  # drop the last 2 rows
    plain.crop(-2)
    for order in (torch.tensor([2, 0, 1]), torch.tensor([1, 0])):  # a beam reorder (same batch), then a selection
        cache.batch_select_indices(order)
        plain.batch_select_indices(order)
        k = torch.randn(len(order), 2, 1, 4)
        got = cache.update(k, k, 0)
        want = plain.update(k, k, 0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].shape[-2] == 6


def test_an_append_after_a_crop_leaves_earlier_returned_rows_alone() -> None:
    """DynamicCache never writes into a tensor it returned: after a crop (assisted decoding
    rejecting draft tokens) the keys handed out before it still show the rejected rows."""
    torch.manual_seed(2)
    cache, plain = growing_cache(), transformers.DynamicCache()
    rows = torch.randn(1, 2, 6, 4)
    shown = cache.update(rows, rows, 0)[0]
    plain.update(rows, rows, 0)
    before = shown.clone()
    cache.crop(-2)  # keep 4 rows
    plain.crop(-2)
    k = torch.randn(1, 2, 2, 4)
    got = cache.update(k, k, 0)
    want = plain.update(k, k, 0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(shown, before)  # rows 4 and 5 of the earlier tensor are the rejected ones, unchanged
    (layer,) = cache.layers
    after = cache.update(k, k, 0)[0]  # appends past the crop go in place again
    assert after.data_ptr() == got[0].data_ptr()
    assert layer._key_store.data_ptr() == after.data_ptr()
