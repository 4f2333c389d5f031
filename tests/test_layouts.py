"""Every documented layout of `qkv.attention` on every path: (H, L, E) without a batch dim,
(B, H, L, E), and several batch dims (B1, B2, H, L, E); anything else is refused before any
work with a message that names the layout.

Each layout is checked against the same problem in the (B, H, L, E) layout on the math path
(float64), with every mask kind a path takes: none, causal, a sliding window, key padding
that varies over the batch, bool and float tensors, and a bias.
"""

from __future__ import annotations

import functools

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.backends.flex import flex_attention_layout

H, G, L, S, E, EV = 4, 2, 9, 11, 8, 5
LAYOUTS = {"(H, L, E)": (), "(B, H, L, E)": (3,), "(B1, B2, H, L, E)": (2, 3)}
BACKENDS = ("auto", "fused", "math", "blocks", "flex")
MASKS = ("none", "causal", "sliding_window", "key_padding", "bool", "float", "alibi+window")
TENSOR_MASKS = ("bool", "float")  # the tile paths (blocks, flex) take qkv.masks objects only


def _inputs(batch: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(len(batch))
    q = torch.randn(*batch, H, L, E, generator=gen, dtype=torch.float64)
    k = torch.randn(*batch, G, S, E, generator=gen, dtype=torch.float64)
    v = torch.randn(*batch, G, S, EV, generator=gen, dtype=torch.float64)
    return q, k, v


def _mask(kind: str, batch: tuple[int, ...]) -> tuple[object, dict]:
    """(mask, extra keyword arguments) for the caller's batch dims."""
    n = 1
    for size in batch:
        n *= size
    gen = torch.Generator().manual_seed(7)
    if kind == "none":
        return None, {}
    if kind == "causal":
        return M.causal(), {}
    if kind == "sliding_window":
        return M.sliding_window(3, 1), {}
    if kind == "key_padding":  # one row per flattened batch item, the last one sees no key
        valid = torch.rand(n, S, generator=gen) > 0.4
        valid[-1] = False
        return M.key_padding(valid), {}
    if kind == "bool":
        return torch.rand(*batch, 1, L, S, generator=gen) > 0.4, {}
    if kind == "float":
        return torch.randn(H, L, S, generator=gen, dtype=torch.float64), {}
    if kind == "alibi+window":
        return M.sliding_window(4), {"bias": qkv.bias.alibi()}
    raise AssertionError(kind)


def _batched(mask: object, batch: tuple[int, ...]) -> object:
    """The same mask for the inputs with one batch dim (N, H, L, E)."""
    if isinstance(mask, torch.Tensor) and mask.ndim == len(batch) + 3:
        return mask.reshape(-1, *mask.shape[-3:])  # (N, 1, L, S)
    return mask


def _run_flex_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="flex" with FlexAttention's eager reference: the compiled CPU kernel takes a
    minute to build and returns no lse; the layout handling around it is the same."""
    from qkv.attention import execute as execute_module

    monkeypatch.setattr(execute_module, "flex_attention_layout", functools.partial(flex_attention_layout, compiled=False))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_on_every_path(layout: str, kind: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = LAYOUTS[layout]
    if backend in ("blocks", "flex") and kind in TENSOR_MASKS:
        mask, extra = _mask(kind, batch)
        with pytest.raises(ValueError, match=r"takes a qkv\.masks object"):
            qkv.attention(*_inputs(batch), mask, backend=backend, **extra)  # type: ignore[arg-type]
        return
    if backend == "flex":
        _run_flex_eagerly(monkeypatch)
    q, k, v = _inputs(batch)
    mask, extra = _mask(kind, batch)
    want_weights = backend not in ("flex", "blocks")  # their weights come from other code (tested there)
    result = qkv.attention(
        q, k, v, mask, backend=backend, return_weights=want_weights, return_lse=True, **extra  # type: ignore[arg-type]
    )
    out, lse = result[0], result[-1]
    assert out.shape == (*batch, H, L, EV)
    assert lse.shape == (*batch, H, L)

    flat = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))  # (N, H | G, L | S, E | Ev)
    ref_out, ref_weights, ref_lse = qkv.attention(
        *flat, _batched(mask, batch), backend="math", return_weights=True, return_lse=True, **extra  # type: ignore[arg-type]
    )
    torch.testing.assert_close(out, ref_out.reshape(out.shape), atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse.reshape(lse.shape), atol=1e-10, rtol=0)
    if want_weights:
        torch.testing.assert_close(result[1], ref_weights.reshape(*batch, H, L, S), atol=1e-10, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explain_and_attention_weights_take_every_layout(layout: str) -> None:
    batch = LAYOUTS[layout]
    q, k, v = _inputs(batch)
    mask = M.sliding_window(2)
    assert qkv.explain(q, k, v, mask).path in ("blocks", "fused", "math")
    weights = qkv.attention_weights(q, k, v, mask, heads=[1], rows=[0, 5])
    assert weights.shape == (*batch, 1, 2, S)
    full = qkv.attention(q, k, v, mask, backend="math", return_weights=True)[1]
    torch.testing.assert_close(weights, full[..., [1], :, :][..., [0, 5], :], atol=1e-10, rtol=0)


def test_unbatched_keys_and_values_with_batched_queries_are_named() -> None:
    q = torch.randn(2, H, L, E)
    k, v = torch.randn(G, S, E), torch.randn(G, S, EV)
    with pytest.raises(ValueError, match="same rank"):
        qkv.attention(q, k, v, M.sliding_window(2))


@pytest.mark.parametrize("shape", [(L, E), (E,)])
def test_fewer_than_three_dims_are_refused_naming_the_layout(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape)
    with pytest.raises(ValueError, match=r"\(\.\.\., heads, length, dim\)"):
        qkv.attention(x, x, x, M.sliding_window(2))
