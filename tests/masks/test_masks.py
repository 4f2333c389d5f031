"""qkv.masks: every mask against its definition, analytic block layouts against dense ones, drawings.

The expected matrices are built with NumPy straight from the definitions in docs/design.md
(absolute positions, bottom-right alignment), independently of the masks' own code.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv import masks as M
from qkv.masks import EMPTY, FULL, PARTIAL
from qkv.masks._layout import states_from_dense

# awkward (L, S): equal, not multiples of any block, L < S, L > S, a single query, a single key
SIZES = [(16, 16), (37, 37), (23, 41), (41, 23), (1, 29), (29, 1)]
# tiles of 1 (point by point), 16, larger than every size, and non-square ones
BLOCKS = [(1, 1), (16, 16), (64, 64), (7, 5), (16, 8)]


def positions(L: int, S: int, align: str = "bottom-right") -> tuple[np.ndarray, np.ndarray]:
    offset = S - L if align == "bottom-right" else 0
    return (np.arange(L) + offset)[:, None], np.arange(S)[None, :]  # (L, 1), (1, S)


def expected(kind: str, L: int, S: int) -> np.ndarray:
    """The definition of each test mask as an (L, S) bool matrix."""
    p, t = positions(L, S)
    if kind == "causal":
        return t <= p
    if kind == "causal-top-left":
        p0, _ = positions(L, S, "top-left")
        return t <= p0
    if kind == "window-3-1":
        return (p - 3 <= t) & (t <= p + 1)
    if kind == "window-0-0":
        return t == p
    if kind == "window-5-5-top-left":
        p0, _ = positions(L, S, "top-left")
        return (p0 - 5 <= t) & (t <= p0 + 5)
    if kind == "prefix-4":
        return (t < 4) | (t <= p)
    if kind == "documents":
        ids = _doc_ids(S).numpy()
        return ids[p] == ids[t]
    if kind == "lengths":
        return np.broadcast_to(t < min(S, 11), (L, S))
    if kind == "every-third":
        i = np.arange(L)[:, None]
        return (i + t) % 3 == 0
    raise AssertionError(kind)


def _doc_ids(S: int) -> torch.Tensor:
    """Documents of lengths 1, 1, 5, 1, 9, ... (several one-token documents), cut to S positions."""
    lengths = [1, 1, 5, 1, 9, 2, 1, 13, 1, 30]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:S]


def make(kind: str, S: int) -> M.Mask:
    return {
        "causal": lambda: M.causal(),
        "causal-top-left": lambda: M.causal(align="top-left"),
        "window-3-1": lambda: M.sliding_window(3, 1),
        "window-0-0": lambda: M.sliding_window(0),
        "window-5-5-top-left": lambda: M.sliding_window(5, 5, align="top-left"),
        "prefix-4": lambda: M.prefix_lm(4),
        "documents": lambda: M.documents(_doc_ids(S)),
        "lengths": lambda: M.key_padding(torch.tensor([min(S, 11)])),
        "every-third": lambda: M.predicate(lambda b, h, q, k: (q + k) % 3 == 0),
    }[kind]()


KINDS = ["causal", "causal-top-left", "window-3-1", "window-0-0", "window-5-5-top-left", "prefix-4", "documents",
         "lengths", "every-third"]


# documents(ids) places the queries on the last L of S positions, so it needs L <= S (the
# cross-attention form documents(q_ids, kv_ids) is tested separately)
CASES = [(kind, L, S) for kind in KINDS for L, S in SIZES if not (kind == "documents" and L > S)]


@pytest.mark.parametrize(("kind", "L", "S"), CASES)
def test_to_dense_follows_the_definition(kind: str, L: int, S: int) -> None:
    dense = make(kind, S).to_dense(L, S)
    assert dense.dtype == torch.bool and dense.shape[-2:] == (L, S)
    np.testing.assert_array_equal(dense[0, 0].numpy(), expected(kind, L, S))


@pytest.mark.parametrize(("kind", "L", "S"), CASES)
@pytest.mark.parametrize(("bq", "bk"), BLOCKS)
def test_analytic_layout_equals_the_layout_of_the_dense_mask(kind: str, L: int, S: int, bq: int, bk: int) -> None:
    mask = make(kind, S)
    from_dense = states_from_dense(mask.to_dense(L, S), bq, bk)
    torch.testing.assert_close(mask.layout(L, S, bq, bk).states, from_dense, rtol=0, atol=0)


def test_documents_per_batch_and_cross_attention() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    mask = M.documents(ids)
    dense = mask.to_dense(6, 6)
    assert dense.shape == (2, 1, 6, 6)
    for b in range(2):
        np.testing.assert_array_equal(dense[b, 0].numpy(), ids[b, :, None].numpy() == ids[b, None, :].numpy())
    # a decoding step: the last 2 queries continue the documents of the last 2 positions
    np.testing.assert_array_equal(mask.to_dense(2, 6)[:, 0].numpy(), dense[:, 0, 4:].numpy())
    for bq, bk in [(1, 1), (2, 4), (4, 2)]:
        torch.testing.assert_close(mask.layout(6, 6, bq, bk).states, states_from_dense(dense, bq, bk), rtol=0, atol=0)
    q_ids, kv_ids = torch.tensor([2, 0, 0]), torch.tensor([0, 0, 1, 2, 2])
    cross = M.documents(q_ids, kv_ids).to_dense(3, 5)[0, 0].numpy()
    np.testing.assert_array_equal(cross, q_ids[:, None].numpy() == kv_ids[None, :].numpy())


def test_key_padding_bool_and_lengths_agree() -> None:
    lengths = torch.tensor([3, 0, 7])
    valid = torch.arange(7)[None, :] < lengths[:, None]
    by_lengths, by_valid = M.key_padding(lengths), M.key_padding(valid)
    torch.testing.assert_close(by_lengths.to_dense(4, 7), by_valid.to_dense(4, 7).expand(3, 1, 4, 7))
    np.testing.assert_array_equal(by_valid.to_dense(4, 7)[1].numpy(), np.zeros((1, 4, 7), dtype=bool))
    for bq, bk in [(1, 1), (2, 3), (16, 16)]:
        torch.testing.assert_close(
            by_valid.layout(4, 7, bq, bk).states, states_from_dense(by_valid.to_dense(4, 7), bq, bk), rtol=0, atol=0
        )


def test_dense_and_per_head_predicate_layouts() -> None:
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(2, 3, 19, 23, generator=gen) > 0.6
    t[0, 1, 4:12, 5:17] = True  # a full region, so that FULL tiles exist
    t[1, :, :, 10:] = False  # an empty region
    for mask in (M.dense(t), M.predicate(lambda b, h, q, k: t[b, h, q, k], batch=2, heads=3)):
        torch.testing.assert_close(mask.to_dense(19, 23), t)
        for bq, bk in [(1, 1), (4, 4), (5, 8), (32, 32)]:
            states = mask.layout(19, 23, bq, bk).states
            torch.testing.assert_close(states, states_from_dense(t, bq, bk), rtol=0, atol=0)
    # a key-padding shaped dense mask (B, 1, 1, S) keeps its broadcast axes in the layout
    kp = M.dense(t[:, :1, :1, :])
    assert kp.layout(19, 23, 4, 4).states.shape == (2, 1, 5, 6)
    torch.testing.assert_close(kp.layout(19, 23, 4, 4).states, states_from_dense(kp.to_dense(19, 23), 4, 4), rtol=0, atol=0)


@given(
    L=st.integers(1, 40), S=st.integers(1, 40), left=st.integers(0, 12), right=st.integers(0, 12),
    n=st.integers(0, 10), bq=st.integers(1, 20), bk=st.integers(1, 20), align=st.sampled_from(["bottom-right", "top-left"]),
)
def test_interval_layouts_are_exact_for_any_size(
    L: int, S: int, left: int, right: int, n: int, bq: int, bk: int, align: str
) -> None:
    for mask in (M.causal(align), M.sliding_window(left, right, align=align), M.prefix_lm(n, align=align)):  # type: ignore[arg-type]
        torch.testing.assert_close(
            mask.layout(L, S, bq, bk).states, states_from_dense(mask.to_dense(L, S), bq, bk), rtol=0, atol=0
        )


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=12), bq=st.integers(1, 16), bk=st.integers(1, 16))
def test_sorted_document_layouts_are_exact(lengths: list[int], bq: int, bk: int) -> None:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = M.documents(ids)
    S = len(ids)
    for L in {S, max(1, S // 2)}:
        torch.testing.assert_close(
            mask.layout(L, S, bq, bk).states, states_from_dense(mask.to_dense(L, S), bq, bk), rtol=0, atol=0
        )


COMBINATIONS = [
    lambda S: M.sliding_window(4) & M.causal(),
    lambda S: M.documents(_doc_ids(S)) & M.causal(),
    lambda S: M.documents(_doc_ids(S)) & M.sliding_window(3, 3),
    lambda S: M.sliding_window(2) | M.prefix_lm(3),
    lambda S: (M.causal() & M.key_padding(torch.tensor([S - 3]))) | M.sliding_window(0, 2),
    lambda S: M.predicate(lambda b, h, q, k: k % 4 == 0) | M.documents(_doc_ids(S)),
]


@pytest.mark.parametrize("build", COMBINATIONS)
@pytest.mark.parametrize(("bq", "bk"), [(1, 1), (4, 4), (8, 3), (64, 64)])
def test_combined_layouts_are_sound(build, bq: int, bk: int) -> None:
    L = S = 37
    mask = build(S)
    states = mask.layout(L, S, bq, bk).states
    truth = states_from_dense(mask.to_dense(L, S), bq, bk)
    states, truth = torch.broadcast_tensors(states, truth)
    # FULL and EMPTY must be exact; PARTIAL may stand for either (the kernels stay exact)
    assert bool(((states == FULL) <= (truth == FULL)).all())
    assert bool(((states == EMPTY) <= (truth == EMPTY)).all())
    if (bq, bk) == (1, 1):  # single points are never ambiguous
        torch.testing.assert_close(states, truth, rtol=0, atol=0)


@pytest.mark.parametrize("build", COMBINATIONS)
def test_combined_to_dense_is_the_logical_combination(build) -> None:
    mask = build(29)
    a, b = mask.left.to_dense(23, 29), mask.right.to_dense(23, 29)
    want = (a & b) if mask.op == "and" else (a | b)
    torch.testing.assert_close(mask.to_dense(23, 29), torch.broadcast_to(want, mask.to_dense(23, 29).shape))


def test_empty_windows_leave_rows_without_keys() -> None:
    # L > S, bottom-right: the first queries sit before key 0 and their window holds no key
    dense = M.sliding_window(2).to_dense(8, 4)[0, 0]
    assert not dense[:4].any() and dense[4:].any(dim=1).all()
    layout = M.sliding_window(2).layout(8, 4, 4, 4)
    assert layout.states[0, 0, 0, 0] == EMPTY and layout.states[0, 0, 1, 0] == PARTIAL


def test_drawing_of_a_sliding_window() -> None:
    drawing = M.sliding_window(1).draw(4, 4)
    assert drawing.splitlines() == [
        "sliding_window(left=1, right=0): L=4 S=4, tiles of 1 queries x 1 keys",
        "q  keys 0..3 →",
        "0  █···",
        "1  ██··",
        "2  ·██·",
        "3  ··██",
        "█ full 7, ▒ partial 0, · empty 9: 7 of 16 tiles visited (43.8%)",
    ]


def test_drawing_of_causal_tiles_marks_the_diagonal_partial() -> None:
    lines = M.causal().draw(256, 256, block=64).splitlines()
    assert lines[2:6] == ["  0  ▒···", " 64  █▒··", "128  ██▒·", "192  ███▒"]
    assert "10 of 16 tiles visited" in lines[-1]
    # without a tile size the drawing stays at most 48 tiles wide
    assert max(len(line.split("  ")[-1]) for line in M.causal().draw(5000, 5000).splitlines()[2:-1]) <= 48


def test_masks_print_their_name() -> None:
    assert str(M.sliding_window(256, 256)) == "sliding_window(left=256, right=256)"
    assert str(M.documents(torch.tensor([0, 0, 1])) & M.causal()) == "(documents(2 documents, ids (1, 3)) & causal())"


@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (lambda: M.sliding_window(-1), ValueError, "left must be >= 0, got -1"),
        (lambda: M.sliding_window(2, 1.5), TypeError, "right must be an int"),  # type: ignore[arg-type]
        (lambda: M.sliding_window(2, align="middle"), ValueError, "'middle'"),  # type: ignore[arg-type]
        (lambda: M.prefix_lm(-3), ValueError, "n must be >= 0, got -3"),
        (lambda: M.documents(torch.tensor([0.0, 1.0])), TypeError, "torch.float32"),
        (lambda: M.documents([0, 1]), TypeError, "list"),  # type: ignore[arg-type]
        (lambda: M.documents(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError, "(2, 2, 2)"),
        (lambda: M.key_padding(torch.tensor([2, -1])), ValueError, "[2, -1]"),
        (lambda: M.key_padding(torch.ones(3, dtype=torch.bool)), ValueError, "(3,)"),
        (lambda: M.key_padding(torch.ones(3)), TypeError, "torch.float32"),
        (lambda: M.predicate("k < q"), TypeError, "str"),  # type: ignore[arg-type]
        (lambda: M.predicate(lambda b, h, q, k: q >= k, heads=0), ValueError, "heads must be >= 1"),
        (lambda: M.causal() & torch.ones(2, 2, dtype=torch.bool), TypeError, "qkv.masks.dense"),
        (lambda: M.key_padding(torch.tensor([1, 2])) & M.documents(torch.zeros(3, 4, dtype=torch.long)),
         ValueError, "batch"),
    ],
)
def test_bad_arguments_are_named(build, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        build()


def test_predicate_must_return_bool() -> None:
    with pytest.raises(TypeError, match="bool tensor"):
        M.predicate(lambda b, h, q, k: q - k).to_dense(3, 3)


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (M.documents(torch.tensor([0, 0, 1, 1])), "ids for 4 key positions, the keys have length S=6"),
        (M.key_padding(torch.tensor([2, 7])), "length 7 > S=6"),
        (M.key_padding(torch.ones(3, 6, dtype=torch.bool)), "batch size 3, the inputs have 2"),
        (M.predicate(lambda b, h, q, k: q >= k, heads=3), "covers 3 heads, the inputs have 4"),
    ],
)
def test_masks_that_do_not_fit_the_inputs_are_refused_before_any_work(mask: M.Mask, words: str) -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    for fn in (qkv.attention, qkv.explain):
        with pytest.raises(ValueError, match=words):
            fn(q, k, v, mask)


@pytest.mark.parametrize(
    ("build", "L", "S", "words"),
    [
        (lambda: M.documents(torch.tensor([0, 0, 1, 1, 1])), 7, 5, "L=7 queries on the last positions of the S=5 keys"),
        (lambda: M.documents(torch.tensor([0, 0, 1, 1, 1])), 3, 3, "ids for 5 key positions, the keys have length S=3"),
        (lambda: M.documents(torch.tensor([0, 1]), torch.tensor([0, 0, 1])), 4, 3, "2 query ids, the queries have L=4"),
        (lambda: M.key_padding(torch.tensor([[True, False, True]])), 2, 5, "shape (1, 3), the keys have length S=5"),
        (lambda: M.key_padding(torch.tensor([9])), 2, 3, "length 9 > S=3"),
        (lambda: M.causal() & M.dense(torch.ones(4, 4, dtype=torch.bool)), 4, 6, "does not broadcast to (..., 4, 6)"),
    ],
)
def test_rendering_refuses_sizes_the_mask_data_does_not_cover(build, L: int, S: int, words: str) -> None:
    # without the check, documents(ids) with L > S indexed ids with negative positions (wrapping
    # around to the end) and a layout of a shorter S came out with the ids' own size
    for render in (lambda m: m.to_dense(L, S), lambda m: m.layout(L, S, 2), lambda m: m.draw(L, S)):
        with pytest.raises(ValueError, match=re.escape(words)):
            render(build())


def test_drawing_refuses_a_batch_row_the_mask_does_not_have() -> None:
    mask = M.key_padding(torch.tensor([1, 2]))
    assert mask.draw(3, 3, batch=1).splitlines()[2:5] == ["0  ██·", "1  ██·", "2  ██·"]  # row 1: 2 valid keys
    with pytest.raises(ValueError, match=r"batch must be an int in \[0, 2\)"):
        mask.draw(3, 3, batch=2)
    # an axis the mask does not vary over draws the same for every index
    assert M.causal().draw(3, 3, batch=7, head=3) == M.causal().draw(3, 3)
