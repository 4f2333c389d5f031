"""`qkv.compat.from_xformers` and `memory_efficient_attention` against a float64 re-implementation
of xformers' documented bias semantics (xformers is not installed).

The stand-in classes below carry xformers' class names and the attributes its
``attn_bias.py`` documents; `allowed` writes out each type's rule as its docstring and
``materialize`` state it (per block: top-left diagonal j <= i, bottom-right j <= i + lk - lq,
local attention keeping the last ``window_size`` positions, padded / gappy keys using only
the first seqlen slots of their block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import qkv
from qkv.compat import from_xformers, memory_efficient_attention
from tests.compat._reference import attend


@dataclass
class _SeqLenInfo:
    seqstart_py: list[int]


@dataclass
class _PaddedSeqLenInfo:
    seqstart_py: list[int]
    seqlen_py: list[int]


def _seqinfo(lengths: list[int]) -> _SeqLenInfo:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return _SeqLenInfo(starts)


def _named(name: str, **attributes: object) -> object:
    """An object whose class is called ``name``, as xformers' bias of that name."""
    return type(name, (), {})() if not attributes else _with(type(name, (), {})(), attributes)


def _with(obj: object, attributes: dict) -> object:
    for key, value in attributes.items():
        setattr(obj, key, value)
    return obj


@dataclass
class Case:
    name: str
    attributes: dict = field(default_factory=dict)
    L: int = 9
    S: int = 13


Q_LENS, K_LENS = [3, 1, 5], [4, 6, 3]  # blocks with more, more and fewer keys than queries
PAD = 6  # the padded / gappy key layouts: block d starts at d * PAD (gappy: at GAPPY_STARTS)
GAPPY_STARTS = [0, 5, 11, 16]

CASES = [
    Case("LowerTriangularMask"),
    Case("LowerTriangularMask", L=13, S=9),
    Case("LowerTriangularFromBottomRightMask"),
    Case("LowerTriangularFromBottomRightMask", L=13, S=9),
    Case("LowerTriangularFromBottomRightLocalAttentionMask", {"_window_size": 3}),
    Case("LocalAttentionFromBottomRightMask", {"window_left": 2, "window_right": 1}),
    Case("BlockDiagonalMask", L=9, S=13),
    Case("BlockDiagonalCausalMask", L=9, S=13),
    Case("BlockDiagonalCausalFromBottomRightMask", L=9, S=13),
    Case("BlockDiagonalCausalLocalAttentionMask", {"_window_size": 2}, L=9, S=13),
    Case("BlockDiagonalCausalLocalAttentionFromBottomRightMask", {"_window_size": 2}, L=9, S=13),
    Case("BlockDiagonalPaddedKeysMask", L=9, S=3 * PAD),
    Case("BlockDiagonalCausalWithOffsetPaddedKeysMask", L=9, S=3 * PAD),
    Case("BlockDiagonalCausalLocalAttentionPaddedKeysMask", {"_window_size": 2}, L=9, S=3 * PAD),
    Case("BlockDiagonalGappyKeysMask", L=9, S=GAPPY_STARTS[-1]),
    Case("BlockDiagonalCausalWithOffsetGappyKeysMask", L=9, S=GAPPY_STARTS[-1]),
]


def _bias_object(case: Case) -> object:
    attributes = dict(case.attributes)
    if case.name.startswith("BlockDiagonal"):
        attributes["q_seqinfo"] = _seqinfo(Q_LENS)
        if "PaddedKeys" in case.name:
            attributes["k_seqinfo"] = _PaddedSeqLenInfo([0, PAD, 2 * PAD, 3 * PAD], K_LENS)
        elif "GappyKeys" in case.name:
            attributes["k_seqinfo"] = _PaddedSeqLenInfo(GAPPY_STARTS, K_LENS)
        else:
            attributes["k_seqinfo"] = _seqinfo(K_LENS)
    return _named(case.name, **attributes)


def allowed(case: Case) -> torch.Tensor:
    """(L, S) bool: the pairs xformers' bias of this type leaves at 0 (the others are -inf)."""
    L, S, name, a = case.L, case.S, case.name, case.attributes
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    if not name.startswith("BlockDiagonal"):
        shift = 0 if name == "LowerTriangularMask" else S - L
        if name == "LocalAttentionFromBottomRightMask":
            return (j >= i + shift - a["window_left"]) & (j <= i + shift + a["window_right"])
        keep = j <= i + shift
        if "_window_size" in a:
            keep &= j >= i + shift - a["_window_size"] + 1
        return keep
    result = torch.zeros(L, S, dtype=torch.bool)
    q0 = 0
    for d, (lq, lk) in enumerate(zip(Q_LENS, K_LENS, strict=True)):
        k0 = d * PAD if "PaddedKeys" in name else GAPPY_STARTS[d] if "GappyKeys" in name else sum(K_LENS[:d])
        bi, bj = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        block = torch.ones(lq, lk, dtype=torch.bool)
        if "Causal" in name:
            shift = 0 if name in ("BlockDiagonalCausalMask", "BlockDiagonalCausalLocalAttentionMask") else lk - lq
            block &= bj <= bi + shift
            if "_window_size" in a:
                block &= bj >= bi + shift - a["_window_size"] + 1
        result[q0 : q0 + lq, k0 : k0 + lk] = block
        q0 += lq
    return result


@pytest.mark.parametrize("case", CASES, ids=[f"{c.name}-{c.L}x{c.S}" for c in CASES])
def test_each_bias_type_follows_its_documented_rule(case: Case) -> None:
    H, G, E = 4, 2, 8
    gen = torch.Generator().manual_seed(case.L * case.S)
    B = 1 if case.name.startswith("BlockDiagonal") else 2
    q = torch.randn(B, case.L, H, E, generator=gen, dtype=torch.float64)
    k = torch.randn(B, case.S, G, E, generator=gen, dtype=torch.float64)
    v = torch.randn(B, case.S, G, 5, generator=gen, dtype=torch.float64)
    attn_bias = _bias_object(case)
    want, _, want_probs = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed(case))
    out = memory_efficient_attention(q, k, v, attn_bias=attn_bias)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-10, rtol=0)
    converted = from_xformers(attn_bias)
    _, weights = qkv.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **converted, return_weights=True)
    torch.testing.assert_close(weights, want_probs, atol=1e-10, rtol=0)


def test_tensor_biases() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64)
    bias = torch.randn(2, 2, 6, 6, generator=gen, dtype=torch.float64)
    bias[1, 0, 3] = float("-inf")  # a row that sees nothing
    qt = q.transpose(1, 2)
    want = attend(qt, qt, qt, None, bias.masked_fill(torch.isneginf(bias), 0.0), None)[0]
    want[1, 0, 3] = 0.0
    torch.testing.assert_close(memory_efficient_attention(q, q, q, attn_bias=bias), want.transpose(1, 2), atol=1e-10, rtol=0)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    with_bias = _named("LowerTriangularMaskWithTensorBias", _bias=bias[:, :, :, :].clamp(min=-5.0))
    want = attend(qt, qt, qt, causal, bias.clamp(min=-5.0))[0]
    torch.testing.assert_close(memory_efficient_attention(q, q, q, attn_bias=with_bias), want.transpose(1, 2), atol=1e-10, rtol=0)


def test_varlen_where_it_is_exact_and_intervals_where_not() -> None:
    same = _named("BlockDiagonalCausalMask", q_seqinfo=_seqinfo([2, 3]), k_seqinfo=_seqinfo([2, 3]))
    assert isinstance(from_xformers(same)["mask"], qkv.masks.Varlen)
    other = _named("BlockDiagonalCausalMask", q_seqinfo=_seqinfo([2, 3]), k_seqinfo=_seqinfo([4, 3]))
    assert "BlockDiagonalCausalMask" in from_xformers(other)["mask"].describe()  # type: ignore[union-attr]


def test_unknown_and_paged_types_are_named() -> None:
    with pytest.raises(TypeError, match="does not know the attn_bias type SomethingElse"):
        from_xformers(_named("SomethingElse"))
    with pytest.raises(TypeError, match="PagedBlockDiagonalPaddedKeysMask reads a paged KV cache"):
        from_xformers(_named("PagedBlockDiagonalPaddedKeysMask"))
    with pytest.raises(TypeError, match="must be floating point"):
        from_xformers(torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="_window_size must be a positive int"):
        from_xformers(_named("LowerTriangularFromBottomRightLocalAttentionMask", _window_size=0))
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"\(batch, seqlen, heads, headdim\)"):
        memory_efficient_attention(q[None], q[None], q[None])
