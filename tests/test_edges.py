"""Edges a new user hits: arguments that must work or be refused with a message naming them.

Expected values come from the float64 reference or from the masks' definitions, never from
the code under test.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from tests._attention_cases import Case, reference_forward_backward


def _inputs(L: int = 5, S: int = 6) -> tuple[torch.Tensor, ...]:
    return Case(B=2, H=2, G=1, L=L, S=S, E=4, Ev=3).tensors(torch.float64, seed=1)


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor([0.5])])
def test_scale_takes_any_real_number(scale: object) -> None:
    q, k, v = _inputs()
    trace, _ = reference_forward_backward(q, k, v, None, torch.zeros(2, 2, 5, 3), scale=0.5)
    torch.testing.assert_close(qkv.attention(q, k, v, scale=scale).numpy(), trace.output, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("scale", "words"),
    [
        ("0.5", "real number.*str"),
        (True, "real number.*bool"),
        (1 + 2j, "real number.*complex"),
        (torch.tensor([0.5, 0.5]), r"shape \(2,\)"),
        (torch.tensor(0.5, requires_grad=True), "requires grad"),
        (np.float32("inf"), "finite"),
    ],
)
def test_scale_refuses_what_is_not_one_finite_real_number(scale: object, words: str) -> None:
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=words):
        qkv.attention(q, k, v, scale=scale)  # type: ignore[arg-type]


def test_meta_tensors_are_refused_by_name() -> None:
    q = torch.empty(1, 2, 3, 4, device="meta")
    real = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="q is a meta tensor"):
        qkv.attention(q, q, q)
    with pytest.raises(ValueError, match="mask is a meta tensor"):
        qkv.attention(real, real, real, torch.ones(3, 3, dtype=torch.bool, device="meta"))


def test_attention_weights_rows_must_be_a_collection() -> None:
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"rows must be a sequence.*int 3.*pass \[3\]"):
        qkv.attention_weights(q, k, v, rows=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="heads must be a sequence"):
        qkv.attention_weights(q, k, v, heads="0")  # type: ignore[arg-type]


@pytest.mark.parametrize(("L", "S"), [(0, 0), (0, 4), (4, -1), (2.0, 4)])
def test_draw_refuses_sizes_that_are_not_positive(L: object, S: object) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        M.causal().draw(L, S)  # type: ignore[arg-type]


def test_predicate_of_the_wrong_shape_is_named() -> None:
    q, k, v = _inputs()
    wrong = M.predicate(lambda b, h, qi, ki: torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"returned shape \(3,\).*broadcast"):
        qkv.attention(q, k, v, wrong, backend="math")
    with pytest.raises(ValueError, match=r"returned shape \(3,\)"):
        wrong.draw(8, 8)


@pytest.mark.parametrize("huge", [sys.maxsize, 10**30])
def test_huge_windows_are_clamped_at_construction(huge: int) -> None:
    everything = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    assert torch.equal(M.sliding_window(huge, huge).to_dense(6, 6), everything)
    assert torch.equal(M.sliding_window(huge).to_dense(6, 6), torch.ones(6, 6, dtype=torch.bool).tril()[None, None])
    assert torch.equal(M.prefix_lm(huge).to_dense(6, 6), everything)
    q, k, v = _inputs(6, 6)
    trace, _ = reference_forward_backward(q, k, v, everything, torch.zeros(2, 2, 6, 3))
    for backend in ("auto", "math", "blocks"):
        out = qkv.attention(q, k, v, M.sliding_window(huge, huge), backend=backend)
        torch.testing.assert_close(out.numpy(), trace.output, rtol=1e-10, atol=1e-10)


def test_documents_describe_counts_every_batch_row() -> None:
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 2, 3]])  # 2 + 4 documents
    assert M.documents(ids).describe() == "documents(6 documents in 2 rows, ids (2, 4))"
    assert M.documents(torch.tensor([5, 5, 7])).describe() == "documents(2 documents, ids (1, 3))"


def test_explain_names_the_mask_and_the_batch_as_written() -> None:
    q = k = v = torch.randn(1, 2, 8, 4)
    text = str(qkv.explain(q, k, v, M.sliding_window(2)))
    assert "mask: sliding_window(left=2, right=0)" in text
    assert "B=1 H=2" in text
    q5 = torch.randn(2, 3, 2, 8, 4)
    assert "B=2x3 H=2" in str(qkv.explain(q5, q5, q5))


def test_module_refuses_inputs_of_another_dtype_before_any_work() -> None:
    mha = qkv.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=r"x is torch.float64.*weights are torch.float32"):
        mha(torch.randn(1, 3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"context is torch.float16"):
        mha(torch.randn(1, 3, 8), torch.randn(1, 4, 8, dtype=torch.float16))


def test_a_refused_decoding_step_leaves_the_cache_unchanged() -> None:
    mha = qkv.MultiHeadAttention(8, 2).double().eval()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, mask=M.causal())
        cache = mha.new_cache(2, max_len=8)
        mha(x[:, :5], mask=M.causal(), cache=cache)
        stored = cache.k[:, :, :5].clone()
        for bad in (M.key_padding(torch.ones(2, 5, dtype=torch.bool)), torch.ones(2, 1, 1, 5, dtype=torch.bool)):
            with pytest.raises(ValueError, match=r"S=6|broadcast"):
                mha(x[:, 5:], mask=bad, cache=cache)  # 6 keys after this step, the mask covers 5
            assert cache.length == 5 and torch.equal(cache.k[:, :, :5], stored)
        step = mha(x[:, 5:], mask=M.causal(), cache=cache)
    torch.testing.assert_close(step, full[:, 5:], rtol=1e-10, atol=1e-10)


def test_cache_truncate_forgets_the_last_positions() -> None:
    cache = qkv.KVCache(batch_size=1, max_len=4, num_kv_heads=1, d_k=2)
    cache.update(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    cache.truncate(1)
    assert cache.length == 1
    with pytest.raises(ValueError, match=r"truncate: length must be an int in \[0, 1\]"):
        cache.truncate(2)
