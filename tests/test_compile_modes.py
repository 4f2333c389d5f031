"""qkv.attention under PyTorch's tracing modes: torch.compile, torch.export, torch.func.

Every path (no mask, causal, sliding_window, documents, varlen, ALiBi, softcap, score_mod)
traces as one graph (``torch._dynamo.explain``: 0 graph breaks) in float32 and bfloat16 and
the compiled function equals the float64 math path; the NaN rule and the overflow refusal
hold in compiled code; a MultiHeadAttention with structured masks and biases exports;
vmap, grad and jacrev go through `qkv.attention`. Expected values come from the float64
math path (`backend="math"`) on float64 copies of the inputs, from a Python loop over the
batch, or from finite differences, never from the compiled code itself.

Most compiled checks use the ``aot_eager`` backend (the whole AOT trace, no C++ build: a
few seconds per case on 2 cores); the NaN rule, the refusal and one sliding-window case run
under Inductor.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import qkv
from qkv.attention import dispatch, functional

L = S = 48
H, G, E = 4, 2, 8


def _ids(n: int) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(3), n // 3)  # (n,): three documents of n / 3 tokens


def _distance_penalty(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return score - 0.05 * (i - j).abs()


# path name -> keyword arguments of qkv.attention beyond q, k, v for L = S = n (n a multiple of 12),
# built inside the traced function as a model would
CASES: dict[str, Callable[[int], dict[str, Any]]] = {
    "no mask": lambda n: {},
    "causal": lambda n: {"mask": qkv.masks.causal()},
    "sliding_window": lambda n: {"mask": qkv.masks.sliding_window(n // 8)},
    "documents": lambda n: {"mask": qkv.masks.documents(_ids(n))},
    "varlen": lambda n: {"mask": qkv.masks.varlen([n // 2, n // 3, n - n // 2 - n // 3], causal=True)},
    "alibi": lambda n: {"mask": qkv.masks.causal(), "bias": qkv.bias.alibi()},
    "softcap": lambda n: {"mask": qkv.masks.causal(), "softcap": 2.0},
    "score_mod": lambda n: {"score_mod": _distance_penalty},
}


def _inputs(
    dtype: torch.dtype, seed: int = 0, batch: int = 1, n: int = L
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, n, E, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, G, n, E, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, G, n, E, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _reference(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The float64 math path on float64 copies: the expected values."""
    return qkv.attention(q.double(), k.double(), v.double(), backend="math", **CASES[name](q.shape[-2]))


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_one_graph_and_compiled_equals_the_math_path(name: str, dtype: torch.dtype) -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, **CASES[name](L))

    q, k, v = _inputs(dtype)
    report = torch._dynamo.explain(fn)(q, k, v)
    assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
    assert report.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    expected = _reference(name, q, k, v)
    assert compiled.dtype == dtype
    torch.testing.assert_close(compiled.double(), expected, atol=TOLERANCE[dtype], rtol=0)
    if dtype == torch.float32:  # eager bf16 may build a compiled kernel first (a minute); its tests are elsewhere
        torch.testing.assert_close(fn(q, k, v).double(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_inductor_sliding_window_with_gradients_equals_the_math_path() -> None:
    q, k, v = (t.requires_grad_(True) for t in _inputs(torch.float32))
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.sliding_window(6)), fullgraph=True)
    out = compiled(q, k, v)
    out.square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    expected = qkv.attention(q64, k64, v64, qkv.masks.sliding_window(6), backend="math")
    expected.square().sum().backward()
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
    for got, want in ((q, q64), (k, k64), (v, v64)):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-5, rtol=0)


def test_nan_rule_and_overflow_refusal_hold_under_inductor() -> None:
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal()), fullgraph=True)
    q, k, v = _inputs(torch.float32)
    q[0, 1, 3, 0] = float("inf")  # row 3 of head 1
    k[0, 0, 40, 2] = float("nan")  # key 40 of kv head 0: rows 40.. of query heads 0 and 1
    out = compiled(q, k, v)
    bad = out.isnan().any(dim=-1)  # (1, H, L)
    expected_bad = torch.zeros(1, H, L, dtype=torch.bool)
    expected_bad[0, 1, 3] = True
    expected_bad[0, :2, 40:] = True  # causal: queries 40.. see key 40
    assert torch.equal(bad, expected_bad)
    assert out.isnan().all(dim=-1).eq(bad).all()  # a NaN row is NaN throughout
    # the other rows are exact: the problem with the bad entries zeroed gives them
    clean_q, clean_k = q.nan_to_num(posinf=0.0), k.nan_to_num(nan=0.0)
    expected = qkv.attention(clean_q.double(), clean_k.double(), v.double(), qkv.masks.causal(), backend="math")
    torch.testing.assert_close(out[~bad].double(), expected[~bad], atol=2e-6, rtol=0)
    # overflow: scores beyond half of float32's range are refused when the graph runs
    big_q, big_k, _ = _inputs(torch.float32)
    with pytest.raises(RuntimeError, match="reach beyond half the largest float32"):
        compiled(big_q * 1e19, big_k * 1e19, v)
    with pytest.raises(ValueError, match="beyond half the largest float32"):  # eager says the same, with the values
        qkv.attention(big_q * 1e19, big_k * 1e19, v, qkv.masks.causal())


def test_dynamic_shapes_trace_whole_and_equal_the_math_path() -> None:
    """torch.compile(dynamic=True) traces whole at two lengths (symbolic sizes reach SDPA's
    enable_gqa and the masks' descriptions). The lengths are still specialized (Dynamo
    recompiles per length: the dispatch rules compare L and S as Python ints)."""
    compiled = torch.compile(
        lambda q, k, v, ids: qkv.attention(q, k, v, qkv.masks.documents(ids) & qkv.masks.sliding_window(5)),
        backend="aot_eager", dynamic=True, fullgraph=True,  # a graph break would raise
    )
    for n in (24, 36):
        q, k, v = _inputs(torch.float64, n=n)
        ids = torch.arange(n) // 8  # documents of 8 tokens
        expected = qkv.attention(q, k, v, qkv.masks.documents(ids) & qkv.masks.sliding_window(5), backend="math")
        torch.testing.assert_close(compiled(q, k, v, ids), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["no mask", "sliding_window", "documents", "varlen"])
def test_nan_rows_under_compile_are_the_rows_that_read_a_bad_entry(name: str) -> None:
    q, k, v = _inputs(torch.float32)
    q[0, 1, 3, 0] = float("inf")  # row 3 of query head 1
    v[0, 0, 40, 2] = float("nan")  # key 40 of kv head 0, read by query heads 0 and 1
    expected_bad = torch.zeros(1, H, L, dtype=torch.bool)
    expected_bad[0, 1, 3] = True
    readers = {"no mask": slice(0, L), "sliding_window": slice(40, 47), "documents": slice(32, 48), "varlen": slice(40, 48)}
    # a window sees 6 keys back; documents 32..47; varlen packs 24, 16, 8: key 40 starts the third
    expected_bad[0, :2, readers[name]] = True
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, **CASES[name](L)), backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out.isnan().any(dim=-1), expected_bad)
    assert torch.equal(out.isnan().all(dim=-1), expected_bad)
    expected = qkv.attention(q.nan_to_num(posinf=0.0).double(), k.double(), v.nan_to_num(nan=0.0).double(), backend="math",
                             **CASES[name](L))
    torch.testing.assert_close(out[~expected_bad].double(), expected[~expected_bad], atol=2e-6, rtol=0)


def test_float_mask_with_nan_is_refused_in_compiled_code() -> None:
    q, k, v = _inputs(torch.float32)
    mask = torch.zeros(L, S)
    compiled = torch.compile(lambda q, k, v, m: qkv.attention(q, k, v, m), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, mask).double(), qkv.attention(q.double(), k.double(), v.double(), backend="math"),
                               atol=2e-6, rtol=0)
    mask[2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="float mask holds NaN or \\+inf"):
        compiled(q, k, v, mask)


@pytest.mark.parametrize("kind", ["alibi slopes", "dense bias", "sinks"])
def test_bad_score_terms_are_refused_in_compiled_code(kind: str) -> None:
    q, k, v = _inputs(torch.float32)
    good = {"alibi slopes": torch.rand(H), "dense bias": torch.randn(L, S), "sinks": torch.randn(H)}[kind]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if kind == "sinks":
            return qkv.attention(q, k, v, sinks=t)
        return qkv.attention(q, k, v, bias=qkv.bias.alibi(t) if kind == "alibi slopes" else qkv.bias.dense(t))

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    expected = qkv.attention(q.double(), k.double(), v.double(), backend="math",
                             **({"sinks": good.double()} if kind == "sinks" else
                                {"bias": qkv.bias.alibi(good.double()) if kind == "alibi slopes" else qkv.bias.dense(good.double())}))
    torch.testing.assert_close(compiled(q, k, v, good).double(), expected, atol=2e-6, rtol=0)
    bad = good.clone()
    bad.view(-1)[1] = float("nan")
    with pytest.raises(RuntimeError, match=r"must be finite|holds NaN"):
        compiled(q, k, v, bad)


@pytest.mark.parametrize("backend", ["blocks", "decode"])
def test_engines_planned_on_the_host_refuse_tracing_by_name(backend: str) -> None:
    q, k, v = _inputs(torch.float32)
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal(), backend=backend), backend="eager", fullgraph=True)
    # fullgraph=True: Dynamo reports the ValueError raised while tracing, with its message
    with pytest.raises(Exception, match=r"torch\.compile, torch\.export and vmap"):
        fn(q[:, :, :4], k, v)


def _module_masks() -> dict[str, tuple[dict[str, Any], Any]]:
    """MultiHeadAttention constructor arguments and the forward mask, per case."""
    bool_mask = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(3)) > 0.3
    bool_mask[:, :, 5] = False  # a query row that sees no key: zeros
    return {
        "sliding_window": ({}, qkv.masks.sliding_window(3)),
        "alibi": ({"position_bias": qkv.bias.alibi()}, qkv.masks.causal()),
        "bool tensor": ({}, bool_mask),
    }


@pytest.mark.parametrize("case", ["sliding_window", "alibi", "bool tensor"])
def test_export_of_multihead_attention_equals_eager_and_the_math_path(case: str) -> None:
    kwargs, mask = _module_masks()[case]
    torch.manual_seed(0)
    module = qkv.MultiHeadAttention(16, 4, **kwargs).eval()
    x = torch.randn(2, 12, 16)

    class WithMask(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x, mask=mask)

    exported = torch.export.export(WithMask(), (x,))
    got = exported.module()(x)
    torch.testing.assert_close(got, module(x, mask=mask), atol=1e-6, rtol=0)
    wide = qkv.MultiHeadAttention(16, 4, **kwargs).double().eval()
    wide.load_state_dict(module.state_dict())
    torch.testing.assert_close(got.double(), wide(x.double(), mask=mask), atol=2e-6, rtol=0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")  # the TorchScript exporter is deprecated
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("mask", [None, "causal", "sliding_window"])
def test_onnx_export_of_the_dense_paths_runs_equal_to_eager(mask: str | None, exporter: str) -> None:
    """Both of torch's ONNX exporters give a model that onnx's own reference evaluator (NumPy,
    independent of PyTorch) runs to eager's output: grouped-query heads included (the
    TorchScript exporter used to stop on enable_gqa traced as a tensor, then on enable_gqa
    itself), and the traced NaN rule's prefix sums and gathers."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    torch.manual_seed(0)
    structured = {None: None, "causal": qkv.masks.causal(), "sliding_window": qkv.masks.sliding_window(2)}[mask]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = qkv.MultiHeadAttention(16, 4, num_kv_heads=2).eval()  # grouped-query heads

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attention(x, mask=structured)

    block = Block().eval()
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        expected = block(x).numpy()
    if exporter == "dynamo":
        program = torch.onnx.export(block, (x,), dynamo=True)
        assert program is not None
        model = program.model_proto
    else:
        buffer = io.BytesIO()
        torch.onnx.export(block, (x,), buffer, dynamo=False)
        model = onnx.load_from_string(buffer.getvalue())
    evaluator = ReferenceEvaluator(model)
    (got,) = evaluator.run(None, {evaluator.input_names[0]: x.numpy()})
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_vmap_over_the_batch_equals_a_loop() -> None:
    for name in CASES:
        q, k, v = _inputs(torch.float64, batch=3, n=12)
        kwargs = CASES[name](12)

        def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
            return qkv.attention(q, k, v, **kwargs)

        batched = torch.func.vmap(one)(q, k, v)
        looped = torch.stack([qkv.attention(q[i], k[i], v[i], backend="math", **kwargs) for i in range(3)])
        torch.testing.assert_close(batched, looped, atol=1e-12, rtol=0, msg=name)


def test_grad_and_jacrev_equal_finite_differences_and_the_math_path() -> None:
    q, k, v = _inputs(torch.float64, n=12)
    for name in CASES:
        kwargs = CASES[name](12)

        def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
            return qkv.attention(q, k, v, **kwargs).sin().sum()

        grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
        leaves = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
        qkv.attention(*leaves, backend="math", **kwargs).sin().sum().backward()
        for got, leaf in zip(grads, leaves, strict=True):
            assert leaf.grad is not None
            torch.testing.assert_close(got, leaf.grad, atol=1e-12, rtol=0, msg=name)
        # one entry of q's gradient by central differences, independent of any backward
        step = 1e-6
        bump = torch.zeros_like(q)
        bump[0, 1, 7, 3] = step
        numeric = (loss(q + bump, k, v) - loss(q - bump, k, v)) / (2 * step)
        torch.testing.assert_close(grads[0][0, 1, 7, 3], numeric, atol=1e-7, rtol=0, msg=name)
        jac = torch.func.jacrev(lambda q, kwargs=kwargs: qkv.attention(q, k, v, **kwargs))(q)  # (*out, *q)
        assert jac.shape == (1, H, 12, E, *q.shape)
        # the Jacobian's entry for output (0, 1, 7, 0) is that output's gradient in q
        probe = q.clone().requires_grad_(True)
        qkv.attention(probe, k, v, backend="math", **kwargs)[0, 1, 7, 0].backward()
        assert probe.grad is not None
        torch.testing.assert_close(jac[0, 1, 7, 0], probe.grad, atol=1e-12, rtol=0, msg=name)


def test_the_dense_paths_are_chosen_while_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = dispatch.choose_path

    def spy(*args: Any, **kwargs: Any) -> dispatch.Plan:
        plan = real(*args, **kwargs)
        seen.append(plan.path)
        return plan

    monkeypatch.setattr(functional, "choose_path", spy)
    big = tuple(torch.randn(1, 2, 512, 16) for _ in range(3))
    qkv.attention(*big, qkv.masks.sliding_window(16))
    assert seen == ["blocks"]  # eagerly: the block engine
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.sliding_window(16)), backend="eager", fullgraph=True)(*big)
    assert seen[1:] == ["fused"]  # traced: SDPA with the window as a dense mask


def test_sinks_compile_whole_and_equal_the_float64_math_path() -> None:
    # the traced call takes the math path (the tile paths plan on the host); one graph, no break
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 4, 300, 16, generator=gen) for _ in range(3))
    sinks = torch.randn(4, generator=gen)
    mask = qkv.masks.sliding_window(40)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, mask, sinks=sinks)

    explained = torch._dynamo.explain(call)(q, k, v, sinks)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    expected = qkv.attention(q.double(), k.double(), v.double(), mask, sinks=sinks.double(), backend="math")
    torch.testing.assert_close(compiled.double(), expected, rtol=1e-5, atol=1e-5)
