"""FlexAttention's CPU kernel under torch.compile (`qkv.attention.dispatch._traced_flex`): a
score_mod or a predicate with a mask whose data decides what it hides, traced without
gradients on the CPU, against the float64 reference and against eager qkv.

The score_mod here is additive, so the reference takes it as a bias array built by hand. The
Inductor cases compile FlexAttention's C++ kernel (a few seconds each); the others run on
``backend="aot_eager"``, where FlexAttention runs its own reference implementation, to check
the plan and the NaN rule cheaply.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv import masks as M
from qkv import reference as R
from qkv.attention import dispatch, execute
from qkv.backends import flex, query_chunks
from tests.test_query_chunks import (  # 300 x 260, beyond the tile paths' threshold
    E,
    G,
    H,
    L,
    S,
    _distance,
    _distance_array,
)

pytestmark = pytest.mark.skipif(
    flex.cpu_kernel_reason(torch.float32) is not None,
    reason=f"Inductor's CPU FlexAttention kernel does not run here: {flex.cpu_kernel_reason(torch.float32)}",
)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(dtype: torch.dtype, batch: int = 2, Lq: int = L, Sk: int = S) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, H, Lq, E, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, G, Sk, E, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, G, Sk, E + 8, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v))


def _ids(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, 5, (n,), generator=gen)).values


def _masks() -> dict[str, M.Mask]:
    gen = torch.Generator().manual_seed(4)
    ids = _ids(S, 1)
    return {
        "documents": M.documents(ids[-L:] if L <= S else _ids(L, 2), ids),
        "documents by batch row": M.documents(torch.stack([_ids(L, 3), _ids(L, 5)]), torch.stack([_ids(S, 3), _ids(S, 5)])),
        "documents & causal": M.documents(_ids(L, 2), _ids(S, 2)) & M.causal(),
        "key_padding": M.key_padding(torch.rand(2, S, generator=gen) > 0.3),
        "key_padding | window": M.key_padding(torch.rand(1, S, generator=gen) > 0.7) | M.sliding_window(20),
        "predicate": M.predicate(lambda b, h, i, j: (i // 40 + j // 30 + h) % 3 != 0),
        "dense per head": M.dense(torch.rand(2, H, L, S, generator=gen) > 0.6),
    }


@pytest.fixture
def flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For every call of `flex_attention_layout` from now on, whether torch.compile was tracing
    it (its graph then holds FlexAttention's own call): the kernel that ran, against the one
    the Plan names."""
    calls: list[bool] = []
    real = execute.flex_attention_layout

    def spy(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)

    monkeypatch.setattr(execute, "flex_attention_layout", spy)
    return calls


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: M.Mask) -> np.ndarray:
    Lq, Sk = q.shape[2], k.shape[2]
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), mask.to_dense(Lq, Sk).numpy(),
                        bias=_distance_array(1, Lq, Sk))  # fmt: skip
    return trace.output


# Inductor compiles FlexAttention's CPU kernel for each (a few seconds when its cache is cold);
# aot_eager runs FlexAttention's own reference on the same plan, BlockMask and mask_mod
# (a per-batch, per-head BlockMask; a predicate whose layout and mask_mod must agree on h)
_INDUCTOR = ("predicate", "dense per head")


@pytest.mark.parametrize("name", list(_masks()))
def test_float32_equals_the_float64_reference(
    name: str, plans: list[dispatch.Plan], flex_calls: list[bool]
) -> None:
    mask = _masks()[name]
    q, k, v = _inputs(torch.float32)
    backend = "inductor" if name in _INDUCTOR else "aot_eager"
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance), backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(q, k, v)
    assert [(p.path, p.forward_kernel, p.backward_kernel) for p in plans] == [("flex", "flex", "none")]
    assert flex_calls == [True]  # FlexAttention's own call in the graph
    np.testing.assert_allclose(out.double().numpy(), _reference(q, k, v, mask), atol=2e-6, rtol=0)


@pytest.mark.parametrize(("dtype", "backend"), [(torch.bfloat16, "inductor"), (torch.float16, "aot_eager")], ids=str)
def test_low_precision_equals_the_reference_within_its_rounding(dtype: torch.dtype, backend: str, flex_calls: list[bool]) -> None:
    # bfloat16 runs the kernel in float32: its bfloat16 build miscomputed qkv's score terms,
    # whose score_mod ends with a cast (`flex._cpu_kernel`); this fails by ~1.2 without it
    mask = _masks()["documents & causal"]
    q, k, v = _inputs(dtype)
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance), backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(q, k, v)
    assert out.dtype == dtype and flex_calls == [True]
    # the reference on the rounded inputs; the output's own rounding (2^-8 of |out| <= ~2.5) and
    # the score_mod's float32 arithmetic make the rest
    np.testing.assert_allclose(out.double().numpy(), _reference(q, k, v, mask), atol=1.6e-2, rtol=0)


def test_rows_that_see_no_key_give_zero_and_pointwise_code_after_it_compiles() -> None:
    # query ids 9 have no key of their document: those rows are 0, as everywhere in qkv. The
    # caller's pointwise code after the call would be fused into FlexAttention's C++ kernel,
    # which refuses it (a failed compile) without `flex._flex_output`
    q_ids = _ids(L, 2).clone()
    q_ids[:50] = 9
    mask = M.documents(q_ids, _ids(S, 2))
    q, k, v = _inputs(torch.float32, batch=1)
    gate = torch.rand(1, H, L, E + 8, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(
        lambda q, k, v, gate: qkv.attention(q, k, v, mask, score_mod=_distance) * torch.sigmoid(gate), fullgraph=True
    )
    with torch.no_grad():
        out = compiled(q, k, v, gate)
    want = _reference(q, k, v, mask) * torch.sigmoid(gate).double().numpy()
    assert not out[:, :, :50].any()
    np.testing.assert_allclose(out.double().numpy(), want, atol=2e-6, rtol=0)


def test_a_score_mod_that_hides_whole_rows_gives_what_eager_gives(plans: list[dispatch.Plan]) -> None:
    # -inf on every key of the rows 100..149: no visible key there, as eagerly
    def hide_rows(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        hidden = (i >= 100) & (i < 150)
        return torch.where(hidden, torch.full_like(score, float("-inf")), score)

    mask = _masks()["documents"]
    q, k, v = _inputs(torch.float32)
    eager = qkv.attention(q, k, v, mask, score_mod=hide_rows)
    with torch.no_grad():
        compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=hide_rows), fullgraph=True)(q, k, v)
    assert [p.path for p in plans] == ["blocks", "flex"]  # eager, then traced
    assert not eager[:, :, 100:150].any()
    torch.testing.assert_close(compiled, eager, atol=2e-6, rtol=0)


def test_the_nan_rule_and_the_overflow_refusal_hold() -> None:
    mask = _masks()["documents"]
    q, k, v = _inputs(torch.float32, batch=1)
    k[0, 1, 150, 3] = float("nan")
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance), fullgraph=True)
    eager = qkv.attention(q, k, v, mask, score_mod=_distance)
    with torch.no_grad():
        compiled = fn(q, k, v)
    nan_rows = torch.isnan(eager).any(-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(torch.isnan(compiled).any(-1), nan_rows)
    torch.testing.assert_close(compiled[~nan_rows], eager[~nan_rows], atol=2e-6, rtol=0)
    # scores beyond float32's range: eager refuses, and so does the compiled graph
    huge_q, huge_k = q * 1e20, torch.nan_to_num(k) * 1e20
    with pytest.raises(ValueError, match="overflow"):
        qkv.attention(huge_q, huge_k, v, mask, score_mod=_distance)
    with torch.no_grad(), pytest.raises(ValueError, match="overflow"):
        fn(huge_q, huge_k, v)


def test_symbolic_floats_keep_to_the_chunks(plans: list[dispatch.Plan]) -> None:
    # FlexAttention refuses a score_mod that reads a float torch.compile traces as a variable:
    # with dynamic=True (_distance's SLOPE), or once a float argument changed. The math path
    # takes those graphs (whole with symbolic sizes, by chunks with static ones), same values
    # Dynamo refuses the float while it traces, whatever the backend
    fn = torch.compile(lambda q, k, v, mask: qkv.attention(q, k, v, mask, score_mod=_distance), backend="aot_eager",
                       fullgraph=True, dynamic=True)  # fmt: skip
    for n in (300, 340):
        mask = M.documents(_ids(n, 7))
        q, k, v = _inputs(torch.float32, batch=1, Lq=n, Sk=n)
        with torch.no_grad():
            out = fn(q, k, v, mask)
        np.testing.assert_allclose(out.double().numpy(), _reference(q, k, v, mask), atol=2e-6, rtol=0)
    assert {p.forward_kernel for p in plans} == {"math"}
    torch._dynamo.reset()
    del plans[:]
    mask = _masks()["documents"]
    q, k, v = _inputs(torch.float32)

    def tempered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, temperature: float) -> torch.Tensor:
        def cool(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return score / temperature

        return qkv.attention(q, k, v, mask, score_mod=cool)

    compiled = torch.compile(tempered, backend="aot_eager", fullgraph=True)
    traced: list[str] = []
    for temperature in (1.0, 0.5, 0.25):
        with torch.no_grad():
            out = compiled(q, k, v, temperature)
        traced += [p.forward_kernel for p in plans]
        torch.testing.assert_close(out, tempered(q, k, v, temperature), atol=2e-6, rtol=0)
        del plans[:]
    # the first graph took FlexAttention; those compiled for a symbolic temperature, the math
    # path (one chunk holds these sizes: the whole formula)
    assert traced[0] == "flex" and len(traced) > 1 and set(traced[1:]) == {"math"}


def test_gradients_outputs_and_interval_masks_keep_to_the_chunks(plans: list[dispatch.Plan], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query_chunks, "CHUNK_SCORE_BYTES", 64 * 2 * H * S * 4)  # chunks of 64 rows at these sizes
    documents = _masks()["documents"]
    q, k, v = _inputs(torch.float32)

    def run(fn: Any, *args: torch.Tensor, grad: bool = False) -> str:
        torch._dynamo.reset()
        with torch.set_grad_enabled(grad):
            torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
        return plans[-1].forward_kernel

    assert run(lambda q, k, v: qkv.attention(q, k, v, documents, score_mod=_distance), q, k, v) == "flex"
    trained = q.clone().requires_grad_(True)
    assert run(lambda q, k, v: qkv.attention(q, k, v, documents, score_mod=_distance), trained, k, v, grad=True) == "math_chunks"
    assert run(lambda q, k, v: qkv.attention(q, k, v, documents, score_mod=_distance, return_lse=True)[0], q, k, v) == "math_chunks"
    sinks = torch.zeros(H)
    assert run(lambda q, k, v, s: qkv.attention(q, k, v, documents, score_mod=_distance, sinks=s), q, k, v, sinks) == "math_chunks"
    # an interval mask: the chunks skip what it hides by its parameters
    assert run(lambda q, k, v: qkv.attention(q, k, v, M.causal(), score_mod=_distance), q, k, v) == "math_chunks"
    # a softcap without a score_mod enters the block engine's operators
    run(lambda q, k, v: qkv.attention(q, k, v, documents, softcap=5.0), q, k, v)
    assert plans[-1].path == "blocks"
    with qkv.backends.disabled("flex"):
        assert run(lambda q, k, v: qkv.attention(q, k, v, documents, score_mod=_distance), q, k, v) == "math_chunks"
    # eagerly, the block engine
    with torch.no_grad():
        qkv.attention(q, k, v, documents, score_mod=_distance)
    assert plans[-1].path == "blocks"


def test_explain_names_the_kernel() -> None:
    mask = _masks()["documents"]
    q, k, v = _inputs(torch.float32)
    seen: list[Any] = []

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seen.append(qkv.explain(q, k, v, mask, score_mod=_distance))
        return qkv.attention(q, k, v, mask, score_mod=_distance)

    with torch.no_grad():
        torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
    explained = seen[-1]
    assert explained.path == "flex" and explained.kernels == ("flex", "none")
    assert "Inductor lowers to its CPU kernel" in explained.reason
    # memory: the float32 output (float32 inputs are not copied) and the BlockMask's two int32
    # indices per 128 x 128 tile, 3 x 3 of them for one batch row of ids
    assert explained.peak_extra_bytes == 2 * H * L * (E + 8) * 4 + 3 * 3 * 2 * 4


def test_the_kernel_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert flex.cpu_kernel_reason(torch.float64) is not None and "float64" in str(flex.cpu_kernel_reason(torch.float64))
    monkeypatch.setattr(torch, "__version__", "2.14.1+cpu")
    assert "2.15" in str(flex.cpu_kernel_reason(torch.float32))


def test_backend_flex_on_the_cpu_runs_low_precision_in_float32_and_names_a_dtype_it_cannot_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # backend='flex' eagerly: FlexAttention compiled once per process, on the same float32
    # kernel (before, bfloat16 with this score_mod came out 4.8 off)
    mask = M.causal()
    q, k, v = _inputs(torch.bfloat16, batch=1)
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask, score_mod=_distance, backend="flex")
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.double().numpy(), _reference(q, k, v, mask), atol=1.6e-2, rtol=0)
    # refused before any work: no BlockMask is built
    monkeypatch.setattr(flex, "block_mask_from_layout", lambda *args: pytest.fail("a BlockMask was built before the refusal"))
    with pytest.raises(ValueError, match=r"not torch\.float64; use backend='blocks' or 'auto'$"):
        qkv.attention(*_inputs(torch.float64, batch=1), mask, score_mod=_distance, backend="flex")
