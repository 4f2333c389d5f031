"""The math path by query chunks (`qkv.backends.query_chunks`), which torch.compile takes for
what cannot enter the block engine's operators (a score_mod, a predicate mask), against the
float64 reference.

The reference cannot differentiate a score_mod, so the score_mods here are additive: the same
term reaches the reference as a bias array, whose gradients are `reference.attention_grads`'s
(and, for a tensor the score_mod closes over, `reference.logit_grads` summed by hand over the
pairs each entry touches). Chunks are made small (`CHUNK_SCORE_BYTES`) so that problems of a
few hundred rows split into several, with sizes that leave a short last chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.attention import dispatch
from qkv.backends import query_chunks

H, G, E = 4, 2, 24
L, S = 300, 260  # 78,000 pairs per head: above the threshold of the tile paths and the chunks
SLOPE = 0.02


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Chunks of 64 rows for these sizes (the 16 MiB default would hold every row in one)."""
    monkeypatch.setattr(query_chunks, "CHUNK_SCORE_BYTES", 64 * 2 * H * S * 4)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _distance(
    score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    return score - SLOPE * (h + 1) * (i - j).abs()


def _distance_array(batch: int, Lq: int, Sk: int) -> np.ndarray:
    """_distance's term by hand, (1, H, L, S)."""
    i = np.arange(Lq)[:, None]
    j = np.arange(Sk)[None, :]
    return -SLOPE * (np.arange(H) + 1)[None, :, None, None] * np.abs(i - j)[None, None]


def _inputs(
    dtype: torch.dtype, batch: int = 2, Lq: int = L, Sk: int = S, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, Lq, E, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, G, Sk, E, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, G, Sk, E + 8, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_(True) for t in (q, k, v))


def _masks(batch: int, Lq: int, Sk: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    ids = torch.sort(torch.randint(0, 4, (Sk,), generator=gen)).values
    q_ids = ids[-Lq:] if Lq <= Sk else torch.sort(torch.randint(0, 4, (Lq,), generator=gen)).values
    return {
        "none": None,
        "causal": M.causal(),
        "causal top-left": M.causal(align="top-left"),
        "window": M.sliding_window(37, 5),
        "prefix & window": M.prefix_lm(20) & M.sliding_window(50),
        "window | causal top-left": M.sliding_window(10, 10) | M.causal(align="top-left"),
        "documents": M.documents(q_ids, ids),
        "key_padding": M.key_padding(torch.rand(batch, Sk, generator=gen) > 0.3),
        "predicate": M.predicate(lambda b, h, i, j: (i + 2 * j + h) % 5 != 0),
        "key_padding of one row": M.key_padding(torch.rand(1, Sk, generator=gen) > 0.3),
        "dense per head": M.dense(torch.rand(batch, H, Lq, Sk, generator=gen) > 0.3),
        "bool tensor": torch.rand(batch, 1, Lq, Sk, generator=gen) > 0.4,
        "float tensor": torch.randn(1, H, Lq, Sk, generator=gen, dtype=torch.float64).float(),
    }


def _dense(mask: Any, batch: int, Lq: int, Sk: int) -> np.ndarray | None:
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask.double().numpy() if mask.is_floating_point() else mask.numpy()
    return mask.to_dense(Lq, Sk).numpy()


@pytest.fixture
def chunk_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``rows`` of every call of `chunked_attention` from now on (traced calls at trace
    time): the kernel that ran, against the one the Plan names."""
    from qkv.attention import execute

    calls: list[int] = []
    real = execute.chunked_attention

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(kwargs["rows"])
        return real(*args, **kwargs)

    monkeypatch.setattr(execute, "chunked_attention", spy)
    return calls


def _check_against_reference(
    fn: Callable[..., torch.Tensor],
    mask: Any,
    dtype: torch.dtype,
    *,
    batch: int = 2,
    Lq: int = L,
    Sk: int = S,
    softcap: float | None = None,
) -> None:
    q, k, v = _inputs(dtype, batch, Lq, Sk)
    out = fn(q, k, v)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out.backward(d_out.to(dtype))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    trace = R.attention(
        q.detach().double().numpy(), k.detach().double().numpy(), v.detach().double().numpy(),
        _dense(mask, batch, Lq, Sk), bias=_distance_array(batch, Lq, Sk), softcap=softcap,
    )  # fmt: skip
    want = (trace.output, *R.attention_grads(trace, d_out.numpy()))
    got = (out, q.grad, k.grad, v.grad)
    tolerance = 2e-5 if dtype == torch.float32 else 4e-2
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(a.detach().double().numpy()).all(), name
        np.testing.assert_allclose(
            a.detach().double().numpy(), b, atol=tolerance, rtol=0, err_msg=name
        )


@pytest.mark.parametrize("name", list(_masks(2, L, S)))
def test_compiled_chunks_equal_the_float64_reference_forward_and_backward(
    name: str, plans: list[dispatch.Plan], chunk_calls: list[int]
) -> None:
    mask = _masks(2, L, S)[name]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, mask, score_mod=_distance)

    _check_against_reference(
        torch.compile(fn, backend="aot_eager", fullgraph=True), mask, torch.float32
    )
    assert [p.forward_kernel for p in plans] == ["math_chunks"] and plans[0].chunk_rows == 64
    assert chunk_calls == [64]


@pytest.mark.parametrize(
    ("Lq", "Sk"),
    [(300, 260), (260, 300), (64 * 5 + 1, 300)],
    ids=["L > S", "L < S", "a last chunk of 1 row"],
)
@pytest.mark.parametrize("name", ["causal", "window", "documents"])
def test_rows_that_see_no_key_and_awkward_chunks(
    name: str, Lq: int, Sk: int, chunk_calls: list[int]
) -> None:
    # with L > S bottom-right, the first rows of a causal mask or window see no key: zero rows
    mask = _masks(2, Lq, Sk)[name]
    compiled = torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance),
        backend="aot_eager",
        fullgraph=True,
    )
    _check_against_reference(compiled, mask, torch.float32, Lq=Lq, Sk=Sk)
    assert chunk_calls


def test_bfloat16_softcap_and_score_mod_under_inductor(chunk_calls: list[int]) -> None:
    mask = M.sliding_window(40, 3)
    compiled = torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, mask, softcap=3.0, score_mod=_distance),
        fullgraph=True,
    )
    _check_against_reference(compiled, mask, torch.bfloat16, batch=1, softcap=3.0)
    assert chunk_calls == [128]  # one batch row: twice the rows of two


def test_float32_under_inductor_equals_eager_on_the_block_engine() -> None:
    q, k, v = _inputs(torch.float32)
    mask = M.causal()
    eager = qkv.attention(q, k, v, mask, score_mod=_distance)
    compiled = torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance), fullgraph=True
    )(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=2e-6, rtol=0)


def test_a_tensor_the_score_mod_closes_over_gets_its_gradient() -> None:
    # a learned table by distance, read by the score_mod: its gradient is the sum of the logits'
    # gradients over the pairs at each distance, by hand from the reference
    table = torch.linspace(-1.0, 1.0, L + S - 1, dtype=torch.float64).requires_grad_(True)

    def learned(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
    ) -> torch.Tensor:
        return score + table[i - j + S - 1].to(score.dtype)

    q, k, v = (t.detach().requires_grad_(True) for t in _inputs(torch.float32, batch=1))
    mask = M.sliding_window(60, 60)
    fn = torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=learned),
        backend="aot_eager",
        fullgraph=True,
    )
    out = fn(q, k, v)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out.backward(d_out.float())
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    index = i - j + S - 1  # (L, S)
    trace = R.attention(q.detach().double().numpy(), k.detach().double().numpy(), v.detach().double().numpy(),
                        mask.to_dense(L, S).numpy(), bias=table.detach().numpy()[index])  # fmt: skip
    d_logits = R.logit_grads(trace, d_out.numpy())  # (1, H, L, S)
    want = np.zeros(L + S - 1)
    np.add.at(want, np.broadcast_to(index, d_logits.shape), d_logits)
    assert table.grad is not None
    np.testing.assert_allclose(table.grad.numpy(), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.detach().double().numpy(), trace.output, atol=2e-6, rtol=0)


def test_sinks_and_lse_by_chunks() -> None:
    q, k, v = (t.detach() for t in _inputs(torch.float32))
    sinks = torch.linspace(-1.0, 2.0, H)
    mask = M.causal()

    def fn(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = qkv.attention(q, k, v, mask, score_mod=_distance, sinks=sinks, return_lse=True)
        return out, lse

    out, lse = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, sinks)
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask.to_dense(L, S).numpy(),
                        bias=_distance_array(2, L, S), sinks=sinks.double().numpy())  # fmt: skip
    np.testing.assert_allclose(out.double().numpy(), trace.output, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse.double().numpy(), trace.lse, atol=2e-5, rtol=0)


def test_the_nan_rule_holds_by_chunks() -> None:
    # a NaN in one key: eager's rule NaNs the rows that see it (docs/design.md), the compiled
    # chunks give the same rows
    q, k, v = (t.detach() for t in _inputs(torch.float32, batch=1))
    k[0, 1, 150, 3] = float("nan")
    mask = M.sliding_window(30)
    eager = qkv.attention(q, k, v, mask, score_mod=_distance)
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance), backend="aot_eager",
                             fullgraph=True)(q, k, v)  # fmt: skip
    nan_rows = torch.isnan(eager).any(-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(torch.isnan(compiled).any(-1), nan_rows)
    torch.testing.assert_close(compiled[~nan_rows], eager[~nan_rows], atol=2e-6, rtol=0)


def test_explain_names_the_chunks_and_the_switch_turns_them_off() -> None:
    q, k, v = (t.detach() for t in _inputs(torch.float32))
    seen: list[Any] = []

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append(qkv.explain(q, k, v, M.causal(), score_mod=_distance))
        return qkv.attention(q, k, v, M.causal(), score_mod=_distance)

    torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
    chunked = seen[-1]
    assert chunked.path == "math" and "by chunks of 64 query rows" in chunked.reason
    assert chunked.kernels == ("math_chunks", "math_chunks")
    torch._dynamo.reset()
    with qkv.backends.disabled("math_chunks"):
        torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
    whole = seen[-1]
    assert "chunks" not in whole.reason and whole.kernels == ("math", "math")
    # causal, L = 300 > S = 260 (bottom-right: query i sees keys 0..i - 40): chunk c of 64 rows
    # reads keys 0..min(64 c + 63 - 40, 259); the largest chunk's scores, exponentials and
    # weights, and the chunks' outputs and lse, against L x S three times
    keys = [min(64 * c + 63 - 40, S - 1) + 1 for c in range(5)]  # 24, 88, 152, 216, 260
    rows = [64, 64, 64, 64, L - 256]
    acc, batch = 4, 2
    assert chunked.peak_extra_bytes == 3 * batch * H * max(r * n for r, n in zip(rows, keys, strict=True)) * acc + batch * H * L * (acc + (E + 8) * 4)
    assert whole.peak_extra_bytes == 3 * batch * H * L * S * acc
    # the work: the pairs of every chunk's rows and keys, 2 (E + Ev) FLOPs each, per batch row and head
    pairs = sum(r * n for r, n in zip(rows, keys, strict=True))
    assert chunked.flops == batch * H * pairs * 2 * (E + E + 8)
    assert whole.flops == batch * H * L * S * 2 * (E + E + 8)


def test_eager_exports_and_weights_keep_the_whole_formula(plans: list[dispatch.Plan]) -> None:
    q, k, v = (t.detach() for t in _inputs(torch.float32))
    qkv.attention(q, k, v, score_mod=_distance, backend="math")  # eager: never chunks
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, score_mod=_distance, return_weights=True), backend="eager",
                  fullgraph=True)(q, k, v)  # fmt: skip
    assert [p.forward_kernel for p in plans] == ["math", "math"]
    small = tuple(t[:, :, :200, :] for t in (q, k, v))  # 40,000 pairs: one formula
    torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, score_mod=_distance), backend="eager", fullgraph=True
    )(*small)
    assert plans[-1].forward_kernel == "math"


@pytest.mark.parametrize(
    ("mask", "Lq", "Sk"),
    [
        (M.causal(), 300, 260),
        (M.causal(), 260, 300),
        (M.causal(align="top-left"), 300, 260),
        (M.sliding_window(37, 5), 300, 260),
        (M.sliding_window(0, 0, align="top-left"), 100, 100),
        (M.prefix_lm(20), 90, 120),
        (M.prefix_lm(200), 90, 120),
        (M.prefix_lm(20) & M.sliding_window(5), 90, 120),
        (M.sliding_window(3) | M.causal(align="top-left"), 120, 90),
        (M.sliding_window(3, align="top-left") & M.sliding_window(2, align="top-left"), 120, 90),
        (M.documents(torch.arange(120) // 50), 120, 120),
    ],
    ids=str,
)
def test_key_span_holds_every_visible_key_of_its_rows(mask: M.Mask, Lq: int, Sk: int) -> None:
    dense = mask.to_dense(Lq, Sk)[0, 0]  # (L, S)
    # one interval per query: the span is exact; a combination gives a bound; data masks all keys
    exact = isinstance(mask, (M.Causal, M.SlidingWindow, M.PrefixLM))
    if isinstance(mask, M.Documents):
        assert mask.key_span(0, Lq - 1, Lq, Sk) == (0, Sk - 1)
    for first in range(0, Lq, 17):
        last = min(Lq, first + 17) - 1
        lo, hi = mask.key_span(first, last, Lq, Sk)
        assert lo > hi or (lo >= 0 and hi <= Sk - 1)
        cols = dense[first : last + 1].any(0).nonzero().flatten()
        if cols.numel() == 0:  # rows that see no key: an exact span is empty, a bound may be anything
            if exact:
                assert lo > hi, (first, lo, hi)
            continue
        assert lo <= int(cols[0]) and int(cols[-1]) <= hi, (first, lo, hi, cols[0], cols[-1])
        if exact:
            assert (lo, hi) == (int(cols[0]), int(cols[-1])), (first, lo, hi)


@pytest.mark.parametrize("kind", ["predicate", "bool tensor"])
# without a score_mod, SDPA with the rendered mask; with one, the chunks (a bool tensor) or,
# without gradients, FlexAttention (a predicate: tests/test_traced_flex.py)
@pytest.mark.parametrize("score_mod", [None, _distance], ids=["no score_mod", "score_mod"])
def test_the_traced_nan_rule_renders_a_mask_by_pieces_of_rows_as_eagerly(kind: str, score_mod: Any) -> None:
    # 700 rows: two pieces of the traced rule's rendering (512 rows each at most); a NaN key
    # that rows of both pieces see, and rows of both that do not
    n = 700
    q, k, v = (t.detach() for t in _inputs(torch.float32, batch=1, Lq=n, Sk=n))
    k[0, 0, 333, 5] = float("nan")
    gen = torch.Generator().manual_seed(6)
    mask = M.predicate(lambda b, h, i, j: (i * 7 + j) % 3 != 0) if kind == "predicate" else torch.rand(1, 1, n, n, generator=gen) > 0.5
    eager = qkv.attention(q, k, v, mask, score_mod=score_mod)
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=score_mod), backend="aot_eager",
                             fullgraph=True)(q, k, v)  # fmt: skip
    nan_rows = torch.isnan(eager).any(-1)  # (1, H, n)
    assert nan_rows[..., :512].any() and nan_rows[..., 512:].any() and not nan_rows[..., 512:].all()
    assert torch.equal(torch.isnan(compiled).any(-1), nan_rows)
    # the rows that see key 333 by the mask itself, by hand: heads 0 and 1 read k's head 0
    dense = mask.to_dense(n, n)[0, 0] if kind == "predicate" else mask[0, 0]
    assert torch.equal(nan_rows[0, :2], dense[:, 333].expand(2, n)) and not nan_rows[0, 2:].any()
    torch.testing.assert_close(compiled[~nan_rows], eager[~nan_rows], atol=2e-6, rtol=0)
