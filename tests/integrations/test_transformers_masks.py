"""qkv's mask interface against transformers' own sdpa_mask: the same visible pairs, structured.

The expected masks are rendered by ``transformers.masking_utils.sdpa_mask`` (never by qkv),
for every mask function transformers composes, at the offsets its caches produce.
"""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as hf

from qkv.integrations.transformers import StructuredMask, structured_mask
from qkv.masks import Causal, Dense, SlidingWindow


def _expected(**kw) -> torch.Tensor:
    kw.setdefault("allow_is_causal_skip", False)
    out = hf.sdpa_mask(**kw)
    return torch.ones(kw["batch_size"], 1, kw["q_length"], kw["kv_length"], dtype=torch.bool) if out is None else out


def _ours(**kw) -> torch.Tensor:
    got = structured_mask(**kw)
    B, L, S = kw["batch_size"], kw["q_length"], kw["kv_length"]
    if got is None:
        return torch.ones(B, 1, L, S, dtype=torch.bool)
    assert isinstance(got, StructuredMask) and got.recognised, got
    return got.mask.to_dense(L, S).expand(B, 1, L, S)


def _padding(B: int, T: int, left: int, right: int) -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :left] = False
    if right:
        mask[-1, T - right :] = False
    return mask


FUNCTIONS = {
    "causal": hf.causal_mask_function,
    "bidirectional": hf.bidirectional_mask_function,
    "sliding 1": hf.sliding_window_causal_mask_function(1),
    "sliding 3": hf.sliding_window_causal_mask_function(3),
    "sliding 40": hf.sliding_window_causal_mask_function(40),
    "bidirectional sliding 2": hf.sliding_window_bidirectional_mask_function(2),
}

# (q_length, kv_length, q_offset, kv_offset): prefill, decoding with a dynamic cache, a chunked
# prefill over a cache, and a sliding-window cache that keeps only the last keys
SIZES = [(9, 9, 0, 0), (1, 12, 11, 0), (4, 13, 9, 0), (1, 3, 7, 5), (3, 5, 7, 5)]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("pads", [(0, 0), (3, 0), (2, 1)])
def test_structured_mask_equals_sdpa_mask(name: str, sizes: tuple[int, int, int, int], pads: tuple[int, int]) -> None:
    L, S, q_offset, kv_offset = sizes
    if name.startswith("bidirectional") and q_offset:
        return  # bidirectional masks are built without a cache
    kw = {
        "batch_size": 2, "q_length": L, "kv_length": S, "q_offset": q_offset, "kv_offset": kv_offset,
        "mask_function": FUNCTIONS[name], "attention_mask": _padding(2, kv_offset + S, *pads),
    }
    torch.testing.assert_close(_ours(**kw), _expected(**kw), rtol=0, atol=0)


def test_hf_sliding_window_w_is_qkv_window_w_minus_1() -> None:
    """transformers' sliding_window=W: the query and the W - 1 keys before it."""
    got = structured_mask(batch_size=1, q_length=8, kv_length=8, mask_function=hf.sliding_window_causal_mask_function(4))
    assert isinstance(got.mask, SlidingWindow) and (got.mask.left, got.mask.right) == (3, 0)
    row = _expected(batch_size=1, q_length=8, kv_length=8, mask_function=hf.sliding_window_causal_mask_function(4))[0, 0, 7]
    assert row.tolist() == [False] * 4 + [True] * 4  # 4 keys visible, the query's own included


def test_cache_steps_are_bottom_right_causal() -> None:
    """Queries continuing a cache sit at its end (docs/design.md's bottom-right alignment); one
    decoding step sees every cached key, so nothing is hidden and no mask is passed."""
    got = structured_mask(batch_size=1, q_length=4, kv_length=10, q_offset=6, mask_function=hf.causal_mask_function)
    assert got.mask == Causal("bottom-right")
    assert structured_mask(batch_size=1, q_length=1, kv_length=6, q_offset=5, mask_function=hf.causal_mask_function) is None


def test_packed_sequences_become_documents() -> None:
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    packed = hf.find_packed_sequence_indices(position_ids)
    # transformers 5.23 started reading the base term on per-sequence positions; 5.20 (what Python
    # 3.10 resolves) applies it on the packed positions, which the document term makes equal
    remap = getattr(hf, "remap_positions_for_packed_sequence", lambda base, positions: base)
    for base in (hf.causal_mask_function, hf.sliding_window_causal_mask_function(2)):
        fn = hf.and_masks(remap(base, position_ids), hf.packed_sequence_mask_function(packed))
        kw = {"batch_size": 1, "q_length": 9, "kv_length": 9, "mask_function": fn}
        got = structured_mask(**kw)
        assert got.recognised and "documents" in got.mask.describe()
        torch.testing.assert_close(_ours(**kw), _expected(**kw), rtol=0, atol=0)


def test_chunked_attention_becomes_documents() -> None:
    left_padding = torch.tensor([0, 2])
    fn = hf.chunked_causal_mask_function(3, left_padding)
    for L, S, q_offset in ((10, 10, 0), (1, 11, 10)):
        kw = {"batch_size": 2, "q_length": L, "kv_length": S, "q_offset": q_offset, "mask_function": fn,
              "attention_mask": _padding(2, S, 0, 0) & torch.tensor([[True] * S, [False, False] + [True] * (S - 2)])}
        torch.testing.assert_close(_ours(**kw), _expected(**kw), rtol=0, atol=0)


def test_unrecognised_mask_function_falls_back_to_transformers_dense_mask() -> None:
    def every_other_key(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx % 2 == 0

    fn = hf.and_masks(hf.causal_mask_function, every_other_key)
    padding = _padding(2, 7, 2, 0)
    kw = {"batch_size": 2, "q_length": 7, "kv_length": 7, "mask_function": fn, "attention_mask": padding}
    got = structured_mask(**kw)
    assert isinstance(got, StructuredMask) and not got.recognised and isinstance(got.mask, Dense)
    assert "not recognised" in repr(got)
    torch.testing.assert_close(got.mask.to_dense(7, 7), _expected(**kw), rtol=0, atol=0)  # padding kept


def test_nothing_hidden_is_no_mask() -> None:
    kw = {"batch_size": 2, "q_length": 5, "kv_length": 5, "mask_function": hf.bidirectional_mask_function}
    assert structured_mask(**kw) is None
    assert structured_mask(**kw, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
