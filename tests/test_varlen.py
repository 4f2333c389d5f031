"""Variable-length sequences: `masks.varlen`, `masks.padded` and `attention_varlen` against a
loop of dense attention over each document alone (causal aligned bottom-right to the
document, as FlashAttention's varlen kernels and xformers' BlockDiagonalCausalFromBottomRightMask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.masks import EMPTY, FULL
from qkv.masks._layout import states_from_dense

# (q_lengths, k_lengths): equal, keys longer (a cache), queries longer (empty rows), empty docs
LENGTHS = [
    ([5, 1, 9], None),
    ([3, 4, 2], [7, 4, 9]),
    ([6, 2, 5], [2, 2, 3]),
    ([0, 4, 3, 0], [2, 0, 5, 3]),
    ([97], [130]),
]
OPTIONS = [{"causal": False}, {"causal": True}, {"window": (2, 1)}, {"causal": True, "window": (3, 0)}]


def _per_document(q, k, v, q_lengths, k_lengths, causal=False, window=None, bias=None):
    """Each document alone through the float64 reference with plain bottom-right masks."""
    outs, lses = [], []
    qs = ks = 0
    for ql, kl in zip(q_lengths, k_lengths, strict=True):
        qd, kd, vd = q[..., qs : qs + ql, :], k[..., ks : ks + kl, :], v[..., ks : ks + kl, :]
        qs, ks = qs + ql, ks + kl
        if ql == 0:
            continue
        if kl == 0:
            outs.append(np.zeros((*qd.shape[:-1], v.shape[-1])))
            lses.append(np.full(qd.shape[:-1], -np.inf))
            continue
        mask = None
        if causal:
            mask = M.causal()
        if window is not None:
            w = M.sliding_window(*window)
            mask = w if mask is None else mask & w
        dense = None if mask is None else mask.to_dense(ql, kl).numpy()
        b = None if bias is None else bias.to_dense(ql, kl, H=q.shape[-3], dtype=torch.float64).numpy()
        trace = R.attention(qd.numpy(), kd.numpy(), vd.numpy(), dense, bias=b)
        outs.append(trace.output)
        lses.append(trace.lse)
    return np.concatenate(outs, axis=-2), np.concatenate(lses, axis=-1)


@pytest.mark.parametrize(("q_lengths", "k_lengths"), LENGTHS)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("backend", ["math", "blocks", "fused"])
def test_varlen_equals_a_loop_over_documents(q_lengths, k_lengths, options, backend) -> None:
    k_lengths = k_lengths or q_lengths
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, sum(q_lengths), 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, sum(k_lengths), 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, sum(k_lengths), 3, generator=gen, dtype=torch.float64)
    mask = M.varlen(q_lengths, k_lengths, **options)
    out, lse = qkv.attention(q, k, v, mask, return_lse=True, backend=backend)
    want, want_lse = _per_document(q, k, v, q_lengths, k_lengths, **options)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-10)
    np.testing.assert_array_equal(np.isneginf(lse.numpy()), np.isneginf(want_lse))


def test_varlen_with_alibi_uses_each_documents_own_positions() -> None:
    q_lengths, k_lengths = [3, 6, 2], [8, 6, 5]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 11, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 4, 19, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 4, 19, 8, generator=gen, dtype=torch.float64)
    table = torch.randn(4, 32, generator=gen, dtype=torch.float64)
    for bias in (qkv.bias.alibi(), qkv.bias.relative(table)):
        want, _ = _per_document(q, k, v, q_lengths, k_lengths, causal=True, bias=bias)
        for backend in ("math", "blocks", "fused"):
            out = qkv.attention(q, k, v, M.varlen(q_lengths, k_lengths, causal=True), bias=bias, backend=backend)
            np.testing.assert_allclose(out.numpy(), want, atol=1e-10, err_msg=f"{bias} {backend}")


def test_documents_and_causal_differ_from_varlen_when_lengths_differ() -> None:
    # the problem the issue names: documents(q_ids, kv_ids) & causal() aligns causal to the
    # whole packed matrix, not to each document
    q_ids = torch.tensor([0, 0, 1, 1])
    kv_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    old = (M.documents(q_ids, kv_ids) & M.causal()).to_dense(4, 6)[0, 0].int()
    new = M.varlen([2, 2], [3, 3], causal=True).to_dense(4, 6)[0, 0].int()
    # each document: 2 queries over 3 keys, bottom-right: query 0 sees keys 0..1, query 1 keys 0..2
    block = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.int32)
    assert torch.equal(new[:2, :3], block) and torch.equal(new[2:, 3:], block)
    assert not torch.equal(old, new)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_padded_equals_a_loop_over_rows(options) -> None:
    q_lengths, k_lengths = [3, 5, 1], [6, 2, 4]
    L, S = 6, 7
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, L, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(3, 2, S, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 2, S, 5, generator=gen, dtype=torch.float64)
    mask = M.padded(q_lengths, k_lengths, **options)
    for backend in ("math", "blocks", "fused"):
        out = qkv.attention(q, k, v, mask, backend=backend)
        for b, (ql, kl) in enumerate(zip(q_lengths, k_lengths, strict=True)):
            want, _ = _per_document(q[b : b + 1, :, :ql], k[b : b + 1, :, :kl], v[b : b + 1, :, :kl], [ql], [kl], **options)
            np.testing.assert_allclose(out[b : b + 1, :, :ql].numpy(), want, atol=1e-10)
            assert (out[b, :, ql:] == 0).all()  # padded queries see nothing


def test_attention_varlen_matches_the_varlen_mask_and_flash_layout() -> None:
    gen = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9, 12], dtype=torch.int64)
    q = torch.randn(11, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(12, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(12, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    out, lse = qkv.attention_varlen(q, k, v, cu_q, cu_k, causal=True, window=(4, 0), softcap=3.0, return_lse=True)
    assert out.shape == (11, 4, 5) and lse.shape == (4, 11)
    mask = M.varlen([4, 0, 7], [6, 3, 3], causal=True, window=(4, 0))
    want, want_lse = qkv.attention(
        q.detach().transpose(0, 1)[None], k.detach().transpose(0, 1)[None], v.detach().transpose(0, 1)[None],
        mask, softcap=3.0, return_lse=True, backend="math",
    )
    torch.testing.assert_close(out.detach(), want[0].transpose(0, 1), atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse[0], atol=1e-12, rtol=0)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and torch.isfinite(k.grad).all()


def test_attention_varlen_refuses_bad_lengths() -> None:
    q = k = v = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match="ends at 4 but the packed tensor holds 5"):
        qkv.attention_varlen(q, k, v, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="start at 0 and never decrease"):
        qkv.attention_varlen(q, k, v, torch.tensor([0, 3, 2, 5]))
    with pytest.raises(TypeError, match="int32 or int64"):
        qkv.attention_varlen(q, k, v, torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="describes 2 sequences, cu_seqlens_k 1"):
        qkv.attention_varlen(q, k, v, torch.tensor([0, 2, 5]), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"shape \(total, heads, dim\)"):
        qkv.attention_varlen(q[None], k, v, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="packs 5 queries and 5 keys"):
        qkv.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None][:, :, :4], v.transpose(0, 1)[None][:, :, :4], M.varlen([5]))
    with pytest.raises(ValueError, match="window"):
        M.varlen([2], window=(1, -1))
    with pytest.raises(ValueError, match="k_lengths has 1"):
        M.padded([2, 3], [2])


@pytest.mark.parametrize("mask", [
    M.varlen([5, 1, 9, 0, 40], [7, 3, 9, 2, 30], causal=True),
    M.varlen([70, 30], window=(5, 5)),
    M.padded([3, 60, 1], [60, 20, 0], causal=True, window=(10, 0)),
], ids=str)
def test_layouts_are_sound(mask: M.Mask) -> None:
    L = S = 0
    if isinstance(mask, M.Varlen):
        L, S = mask.total_q, mask.total_k
    else:
        L, S = 64, 60
    truth = states_from_dense(mask.to_dense(L, S), 8, 16)
    layout = mask.layout(L, S, 8, 16).states
    assert ((layout == EMPTY) <= (truth == EMPTY)).all()  # an empty tile is truly empty
    assert ((layout == FULL) <= (truth == FULL)).all()  # a full tile truly full
    assert ((truth == FULL) & (layout != FULL)).sum() == 0  # interval tiles: full ones found
    lo, hi = mask.row_intervals(L, S)
    keys = torch.arange(S)
    dense = mask.to_dense(L, S)[:, 0]
    assert torch.equal((keys >= lo[..., None]) & (keys <= hi[..., None]), dense)


@pytest.mark.parametrize("window", [(0, 2**63 - 1), (2**63 - 1, 0), (10**30, 0), (10**30, 10**30)])
@pytest.mark.parametrize("kind", ["varlen", "padded"])
@pytest.mark.parametrize("backend", ["math", "blocks"])
def test_huge_windows_are_clamped_to_the_same_mask(window: tuple[int, int], kind: str, backend: str) -> None:
    # window + position used to wrap around int64 (sys.maxsize hid 12 of 20 keys' rows) or not
    # fit it at all (10**30: OverflowError); wider than the documents, it is no window
    make = M.varlen if kind == "varlen" else M.padded
    lengths = [8, 12] if kind == "varlen" else [20]
    mask = make(lengths, window=window)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 20, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out = qkv.attention(q, k, v, mask, backend=backend)
    # each document sees itself; a left size beyond it is no limit on the left, as a right one
    visible = np.zeros((20, 20), dtype=bool)
    for start, n in ((0, 8), (8, 12)) if kind == "varlen" else ((0, 20),):
        i, t = np.arange(n)[:, None], np.arange(n)[None, :]
        left = t >= i if window[0] == 0 else True
        right = t <= i if window[1] == 0 else True
        visible[start : start + n, start : start + n] = left & right
    trace = R.attention(q.numpy(), k.numpy(), v.numpy(), visible)
    np.testing.assert_allclose(out.numpy(), trace.output, atol=1e-12)


def test_lengths_beyond_int64_positions_are_refused_and_huge_ones_allocate_nothing() -> None:
    with pytest.raises(ValueError, match=r"q_lengths add up to 9\.223e\+18 positions, more than 2\*\*62"):
        M.varlen([2**62, 2**62])
    with pytest.raises(ValueError, match="k_lengths add up to"):
        M.padded([1], [2**63 - 1])
    # 2**41 tokens: the per-query tables would take 48 TiB; they are built only once the
    # lengths match the inputs, so the mismatch is refused first
    mask = M.varlen([2**40, 2**40])
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match=r"varlen\(\) packs 2199023255552 queries .* L=4 and S=4"):
        qkv.attention(q, q, q, mask)
    assert "_cache" not in mask.__dict__
