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
from qkv._private import torch as private_torch
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
    with pytest.raises(ValueError, match="reach beyond half the largest float32"):  # eager's type
        compiled(big_q * 1e19, big_k * 1e19, v)
    with pytest.raises(ValueError, match="beyond half the largest float32"):  # eager says the same, with the values
        qkv.attention(big_q * 1e19, big_k * 1e19, v, qkv.masks.causal())


# name -> the keyword arguments of qkv.attention for one tensor t of n entries (n a multiple of 8),
# built inside the traced function: its sizes are symbolic under dynamic=True
DYNAMIC_CASES: dict[str, Callable[[torch.Tensor], dict[str, Any]]] = {
    "documents & window": lambda t: {"mask": qkv.masks.documents(t.long() // 8) & qkv.masks.sliding_window(5)},
    "bool tensor mask": lambda t: {"mask": t[:, None] >= t[None, :] - 3},  # (n, n): key j visible up to 3 after i
    "key padding": lambda t: {"mask": qkv.masks.key_padding((t < t.shape[0] - 5).view(1, -1))},
    "alibi slopes": lambda t: {"mask": qkv.masks.causal(), "bias": qkv.bias.alibi(torch.linspace(0.5, 0.1, H, dtype=t.dtype))},
    "dense bias": lambda t: {"bias": (t[:, None] - t[None, :]).abs().neg() * 0.1},  # (n, n)
}


@pytest.mark.parametrize("name", list(DYNAMIC_CASES))
def test_dynamic_shapes_trace_whole_and_equal_the_math_path(name: str) -> None:
    """torch.compile(dynamic=True) traces whole at two lengths (symbolic sizes reach SDPA's
    enable_gqa, the masks' and biases' shape checks and their descriptions). The lengths are
    still specialized (Dynamo recompiles per length: the dispatch rules compare L and S as
    Python ints)."""
    compiled = torch.compile(
        lambda q, k, v, t: qkv.attention(q, k, v, **DYNAMIC_CASES[name](t)),
        backend="aot_eager", dynamic=True, fullgraph=True,  # a graph break would raise
    )
    for n in (24, 40):
        q, k, v = _inputs(torch.float64, n=n)
        t = torch.arange(n, dtype=torch.float64)
        expected = qkv.attention(q, k, v, backend="math", **DYNAMIC_CASES[name](t))
        torch.testing.assert_close(compiled(q, k, v, t), expected, atol=1e-12, rtol=0)


# name -> the keyword arguments of qkv.attention for (L, S) from q.shape and k.shape (symbolic
# under dynamic shapes) and a tensor t of S entries, at the block engine's sizes (from 256 x 256
# pairs per head its operators take structured masks while torch.compile traces)
ENGINE_DYNAMIC_CASES: dict[str, Callable[[int, int, torch.Tensor], dict[str, Any]]] = {
    "sliding_window": lambda L, S, t: {"mask": qkv.masks.sliding_window(40)},
    "window from the length": lambda L, S, t: {"mask": qkv.masks.sliding_window(L // 8)},
    "documents": lambda L, S, t: {"mask": qkv.masks.documents(t.long() // 100)},
    "varlen from the length": lambda L, S, t: {"mask": qkv.masks.varlen([L // 2, L - L // 2], causal=True)},
    "key padding & window": lambda L, S, t: {"mask": qkv.masks.key_padding((t < S - 9).view(1, -1)) & qkv.masks.sliding_window(64)},
}


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic=True", "automatic"])
@pytest.mark.parametrize("name", list(ENGINE_DYNAMIC_CASES))
def test_dynamic_shapes_at_the_block_engines_sizes(name: str, dynamic: bool | None) -> None:
    """Symbolic sizes reach the traced dispatch of structured masks: under dynamic=True, and
    under automatic dynamic shapes once a second length recompiles (formerly: "argument
    conversion failed" from the planned share, or a format spec given a symbolic size). Each
    length equals the float64 math path, forward and gradients."""
    ops: list[str] = []

    def recording(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)  # pyright: ignore[reportAttributeAccessIssue]

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, **ENGINE_DYNAMIC_CASES[name](q.shape[-2], k.shape[-2], t))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=recording, dynamic=dynamic, fullgraph=True)
    sizes = [(320, 320), (288, 288)] if name.startswith("varlen") else [(320, 320), (288, 288), (272, 320)]
    for L_, S_ in sizes:
        q, k, v = _inputs(torch.float32, seed=L_, n=S_)
        q = q[:, :, :L_]
        t = torch.arange(S_, dtype=torch.float32)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = compiled(*leaves, t)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        wide = [x.double().requires_grad_(True) for x in (q, k, v)]
        expected = qkv.attention(*wide, backend="math", **ENGINE_DYNAMIC_CASES[name](L_, S_, t))
        expected_grads = torch.autograd.grad(expected.square().sum(), wide)
        torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=0)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    assert any("qkv.blocks_forward" in op for op in ops), "no graph took the block engine: the sizes test nothing"


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
    with pytest.raises(ValueError, match="float mask holds NaN or \\+inf"):
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
    with pytest.raises(ValueError, match=r"must be finite|holds NaN"):
        compiled(q, k, v, bad)


@pytest.mark.parametrize("backend", ["flex", "decode"])
def test_engines_planned_on_the_host_refuse_tracing_by_name(backend: str) -> None:
    q, k, v = _inputs(torch.float32)
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal(), backend=backend), backend="eager", fullgraph=True)
    # fullgraph=True: Dynamo reports the ValueError raised while tracing, with its message
    with pytest.raises(Exception, match=r"torch\.compile, torch\.export and vmap"):
        fn(q[:, :, :4], k, v)


class _WithMask(torch.nn.Module):
    """``inner(x, mask=mask)`` as a module of x alone, as torch.export takes it."""

    def __init__(self, inner: torch.nn.Module, mask: Any) -> None:
        super().__init__()
        self.inner, self.mask = inner, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, mask=self.mask)


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

    exported = torch.export.export(_WithMask(module, mask), (x,))
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


# name -> keyword arguments of qkv.attention for L = S = n: the masks given by data and the score terms
ONNX_CASES: dict[str, Callable[[int], dict[str, Any]]] = {
    "documents": lambda n: {"mask": qkv.masks.documents(_ids(n))},
    "varlen": lambda n: {"mask": qkv.masks.varlen([n // 2, n // 3, n - n // 2 - n // 3], causal=True)},
    "key padding": lambda n: {"mask": qkv.masks.key_padding(torch.arange(n).view(1, n) < n - 4)},
    "alibi": lambda n: {"mask": qkv.masks.causal(), "bias": qkv.bias.alibi()},
    "alibi slopes": lambda n: {"bias": qkv.bias.alibi(torch.tensor([0.5, -0.25, 0.125, 0.0625]))},
    "relative": lambda n: {"bias": qkv.bias.relative(torch.linspace(-1.0, 1.0, H * 32).view(H, 32))},
    "float mask": lambda n: {"mask": torch.linspace(-2.0, 0.5, n * n).view(n, n)},
    "softcap": lambda n: {"mask": qkv.masks.causal(), "softcap": 2.0},
}


# the TorchScript exporter is deprecated; its caution on advanced indexing concerns negative
# indices, which qkv's graphs do not hold (the values are checked below)
@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning", "ignore:Exporting aten..index operator:UserWarning"
)
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(ONNX_CASES))
def test_onnx_export_of_data_masks_and_score_terms(name: str, exporter: str) -> None:
    """The dense paths of masks given by data and of biases export to ONNX, and onnx's reference
    evaluator runs them to the float64 math path. Formerly the dynamo exporter stopped on
    operators ONNX lacks: the traced NaN rule's searchsorted (documents), varlen's
    repeat_interleave with output_size, and amax / amin without dims (the bias and mask checks)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    n = 12

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = qkv.attention(q, k, v, **ONNX_CASES[name](n))
            assert isinstance(out, torch.Tensor)
            return out

    q, k, v = _inputs(torch.float32, n=n)
    if exporter == "dynamo":
        program = torch.onnx.export(Attend().eval(), (q, k, v), dynamo=True)
        assert program is not None
        model = program.model_proto
    else:
        buffer = io.BytesIO()
        torch.onnx.export(Attend().eval(), (q, k, v), buffer, dynamo=False)
        model = onnx.load_from_string(buffer.getvalue())
    evaluator = ReferenceEvaluator(model)
    (got,) = evaluator.run(None, dict(zip(evaluator.input_names, (q.numpy(), k.numpy(), v.numpy()), strict=True)))
    expected = qkv.attention(q.double(), k.double(), v.double(), backend="math", **ONNX_CASES[name](n))
    np.testing.assert_allclose(got, expected.numpy(), atol=2e-6, rtol=0)


# the TorchScript exporter is deprecated, and cautions on advanced indexing with negative
# indices, which qkv's graphs do not hold
@pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning", "ignore:Exporting aten..index operator:UserWarning"
)
@pytest.mark.parametrize("name", ["sliding_window", "alibi", "sinks", "documents & window", "blocks"])
def test_onnx_torchscript_export_at_block_engine_sizes_takes_the_dense_paths(name: str) -> None:
    """The TorchScript exporter traces readable tensors with sizes as tensors: 'auto' at the
    block engine's sizes formerly planned the engine there and failed ("L must be a positive
    int, got tensor(320)"), and backend='blocks' was not refused by name. The graph's values
    are checked at small sizes above (onnx's reference evaluator takes at most 64 keys)."""
    import onnx

    n = 320
    kwargs: dict[str, Any] = {
        "sliding_window": {"mask": qkv.masks.sliding_window(64)},
        "alibi": {"bias": qkv.bias.alibi()},
        "sinks": {"mask": qkv.masks.sliding_window(64), "sinks": torch.zeros(H)},
        "documents & window": {"mask": qkv.masks.documents(torch.arange(n) // 64) & qkv.masks.sliding_window(64)},
        "blocks": {"mask": qkv.masks.causal(), "backend": "blocks"},
    }[name]

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = qkv.attention(q, k, v, **kwargs)
            assert isinstance(out, torch.Tensor)
            return out

    q, k, v = _inputs(torch.float32, n=n)
    buffer = io.BytesIO()
    if name == "blocks":
        with pytest.raises(ValueError, match="backend='blocks' cannot be exported to ONNX"):
            torch.onnx.export(Attend().eval(), (q, k, v), buffer, dynamo=False)
        return
    torch.onnx.export(Attend().eval(), (q, k, v), buffer, dynamo=False)
    model = onnx.load_from_string(buffer.getvalue())
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}  # ONNX's own operators only


def test_every_engine_gate_of_auto_keeps_an_onnx_export_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """While torch.onnx exports (either exporter), 'auto' takes no engine path: structured masks,
    score terms, sinks and dense bfloat16 (where the fused bf16 interval kernel runs, 'auto'
    takes the engine eagerly; its gate formerly sent an export there, which then raised as if
    backend='blocks' had been asked). Eager calls are the control: they do take the engine."""
    n = 320
    q32, k32, v32 = _inputs(torch.float32, n=n)
    q16, k16, v16 = _inputs(torch.bfloat16, n=n)
    calls = {
        "bfloat16, no mask": ((q16, k16, v16), {}),
        "alibi": ((q32, k32, v32), {"bias": qkv.bias.alibi()}),
        "sinks": ((q32, k32, v32), {"mask": qkv.masks.sliding_window(64), "sinks": torch.zeros(H)}),
        "documents & window": ((q32, k32, v32), {"mask": qkv.masks.documents(torch.arange(n) // 64) & qkv.masks.sliding_window(64)}),
    }
    eager = {name: qkv.explain(*tensors, **kwargs).path for name, (tensors, kwargs) in calls.items()}
    monkeypatch.setattr(private_torch, "onnx_exporting", lambda: True)
    for name, (tensors, kwargs) in calls.items():
        assert qkv.explain(*tensors, **kwargs).path in ("fused", "math"), name
    assert eager["alibi"] == eager["sinks"] == "blocks"  # the control: these gates were open
    # (the bf16 gate is open eagerly where the fused interval kernel runs: AVX-512 BF16, a compiler)


# the exporter's note that q, k, v and t share the one length n
@pytest.mark.filterwarnings("ignore:# The axis name.*will not be used:UserWarning")
@pytest.mark.parametrize("name", ["documents", "key padding"])
def test_onnx_export_with_a_dynamic_length_runs_at_another_length(name: str) -> None:
    """A mask given by data, exported with a dynamic length: the traced NaN rule formerly
    evaluated it by chunks of 512 query rows in a Python loop, which fixed the exported length
    (the model then refused any other)."""
    from onnx.reference import ReferenceEvaluator

    def mask_of(t: torch.Tensor) -> qkv.masks.Mask:
        return qkv.masks.documents(t) if name == "documents" else qkv.masks.key_padding((t > 0).view(1, -1))

    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            out = qkv.attention(q, k, v, mask_of(t))
            assert isinstance(out, torch.Tensor)
            return out

    def data(n: int) -> torch.Tensor:
        return torch.arange(n) // 5 if name == "documents" else (torch.arange(n) < n - 3).long()  # ids, or 1 = a real key

    length = torch.export.Dim("n", min=2, max=64)
    q, k, v = _inputs(torch.float32, n=12)
    program = torch.onnx.export(
        Attend().eval(), (q, k, v, data(12)), dynamo=True,
        dynamic_shapes=({2: length}, {2: length}, {2: length}, {0: length}),
    )  # fmt: skip
    assert program is not None
    evaluator = ReferenceEvaluator(program.model_proto)
    for n in (12, 20):
        q, k, v = _inputs(torch.float32, seed=n, n=n)
        (got,) = evaluator.run(None, dict(zip(evaluator.input_names, (q.numpy(), k.numpy(), v.numpy(), data(n).numpy()), strict=True)))
        expected = qkv.attention(q.double(), k.double(), v.double(), mask_of(data(n)), backend="math")
        np.testing.assert_allclose(got, expected.numpy(), atol=2e-6, rtol=0)


def test_export_with_a_dynamic_length_keeps_the_block_engine() -> None:
    """torch.export with a dynamic length at the engine's sizes: a share of the score matrix
    compared with a threshold is a guard the exporter cannot prove for a symbolic length
    ("Constraints violated"), so an exported graph keeps the engine's operator at any share;
    its values at other lengths equal the module's eager calls."""
    torch.manual_seed(0)
    module = _WithMask(qkv.MultiHeadAttention(32, 4, num_kv_heads=2).eval(), qkv.masks.sliding_window(64))
    length = torch.export.Dim("n", min=256, max=2048)
    exported = torch.export.export(module, (torch.randn(1, 320, 32),), dynamic_shapes=({1: length},))
    assert "qkv.blocks_forward" in str(exported.graph)
    for n in (256, 333, 1000):
        x = torch.randn(1, n, 32)
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(x), module(x), atol=2e-6, rtol=0)


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


@pytest.fixture
def chosen_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every Plan `qkv.attention` chooses from now on, eager or traced, in order."""
    seen: list[str] = []
    real = dispatch.choose_path

    def spy(*args: Any, **kwargs: Any) -> dispatch.Plan:
        plan = real(*args, **kwargs)
        seen.append(plan.path)
        return plan

    monkeypatch.setattr(functional, "choose_path", spy)
    return seen


def test_traced_auto_takes_the_block_engine_where_eager_does(chosen_paths: list[str]) -> None:
    seen = chosen_paths
    big = tuple(torch.randn(1, 2, 1024, 16) for _ in range(3))
    qkv.attention(*big, qkv.masks.sliding_window(16))
    assert seen == ["blocks"]  # eagerly: the block engine
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.sliding_window(16)), backend="eager", fullgraph=True)(*big)
    assert seen[1:] == ["blocks"]  # traced: the same engine, as its operator
    # what cannot enter the operator keeps to the dense paths: a predicate (SDPA with the
    # rendered mask) and a score_mod (the math path)
    seen.clear()
    band = qkv.masks.predicate(lambda b, h, i, j: (i - j).abs() <= 16)
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, band), backend="eager", fullgraph=True)(*big)
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, score_mod=_distance_penalty), backend="eager", fullgraph=True)(*big)
    assert seen == ["fused", "math"]


@pytest.mark.parametrize(
    ("n", "E", "window", "path"),
    [(1024, 16, (16, 0), "blocks"), (1024, 16, (448, 224), "fused"), (512, 64, (96, 96), "fused"), (256, 16, (16, 0), "fused")],
    ids=["narrow", "near the share threshold", "the cost model's choice", "below the engine's fixed cost"],
)
def test_traced_auto_decides_by_the_planned_tiles_as_eager(n: int, E: int, window: tuple[int, int], path: str,
                                                           chosen_paths: list[str]) -> None:
    """Eager counts the planned tiles against the engine's threshold and its cost model; traced
    dispatch decides by the same share and the same model (B=1, H=2). At n = 1,024
    sliding_window(448, 224) leaves 53.7 % of the pairs visible but its tiles compute 60.2 %,
    over the threshold. At n = 512, E = 64, sliding_window(96, 96)'s tiles compute 51.4 %, and
    the model (`qkv.backends.blocks.crossover`) puts the engine above SDPA on every tier (1.71
    against 1.44 ms with AVX-512 products, 1.57 against 1.50 with AVX2's). At n = 256 the
    engine's fixed cost alone is above SDPA's estimate."""
    seen = chosen_paths
    big = tuple(torch.randn(1, 2, n, E) for _ in range(3))
    mask = qkv.masks.sliding_window(*window)
    qkv.attention(*big, mask)
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask), backend="eager", fullgraph=True)(*big)
    assert seen[0] == seen[1], seen
    assert seen[0] == path


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


# The block engine under tracing ---------------------------------------------------------------
# At n = 1,032 tokens (H=4, E=8) eager 'auto' takes the CPU block engine for these cases (at
# n = 768 its cost model, `qkv.backends.blocks.crossover`, estimates SDPA with a dense mask
# faster for the windows); traced, the same engine runs as the qkv::blocks_forward /
# qkv::blocks_backward operators. A multiple of 24: three and six documents, n // 8 windows.
ENGINE_N = 1032


def _engine_tensors(seed: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "slopes": torch.rand(H, generator=gen, dtype=torch.float64) * 0.2,
        "table": torch.randn(H, 16, generator=gen) * 0.5,
        "sinks": torch.randn(H, generator=gen),
        "valid": torch.arange(ENGINE_N).view(1, -1) < 300,
    }


def _engine_kwargs(name: str, t: dict[str, torch.Tensor]) -> dict[str, Any]:
    n = ENGINE_N
    return {
        "sliding_window": lambda: {"mask": qkv.masks.sliding_window(n // 8)},
        "prefix_lm window": lambda: {"mask": qkv.masks.sliding_window(40, 8) & qkv.masks.prefix_lm(16)},
        "documents": lambda: {"mask": qkv.masks.documents(_ids(n))},
        "varlen": lambda: {"mask": qkv.masks.varlen([n // 2, n // 3, n - n // 2 - n // 3], causal=True)},
        "key_padding": lambda: {"mask": qkv.masks.key_padding(t["valid"]) & qkv.masks.sliding_window(64)},
        "alibi": lambda: {"mask": qkv.masks.causal(), "bias": qkv.bias.alibi(t["slopes"])},
        "relative": lambda: {"mask": qkv.masks.sliding_window(64), "bias": qkv.bias.relative(t["table"], num_buckets=16)},
        "softcap": lambda: {"mask": qkv.masks.causal(), "softcap": 2.0},
        "sinks": lambda: {"mask": qkv.masks.sliding_window(48), "sinks": t["sinks"]},
    }[name]()


ENGINE_CASES = ["sliding_window", "prefix_lm window", "documents", "varlen", "key_padding", "alibi", "relative", "softcap", "sinks"]


def _ops_in_graph(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The qkv operators in the graph that torch.compile(fullgraph=True) traces for fn."""
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function" and "qkv" in str(node.target))
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ENGINE_CASES)
def test_the_block_engine_compiles_whole_and_equals_eager(name: str, dtype: torch.dtype) -> None:
    t = _engine_tensors()

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv.attention(q, k, v, **_engine_kwargs(name, t))

    q, k, v = _inputs(dtype, n=ENGINE_N)
    plan = dispatch.choose_path(
        functional.describe_problem(q, k, v, _engine_kwargs(name, t).get("mask"), None, 0.0,
                                    **{key: value for key, value in _engine_kwargs(name, t).items() if key != "mask"}),
        "auto", False, False,
    )
    assert plan.path == "blocks"  # eagerly the engine runs: the traced graph must hold it too
    report = torch._dynamo.explain(fn)(q, k, v)
    assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
    assert report.graph_count == 1
    assert "qkv.blocks_forward" in _ops_in_graph(fn, q, k, v)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert compiled.dtype == dtype
    # the same engine code runs on the same inputs: equal to eager, and both near float64
    torch.testing.assert_close(compiled, fn(q, k, v), atol=0, rtol=0)
    expected = qkv.attention(q.double(), k.double(), v.double(), backend="math",
                             **_engine_kwargs(name, {key: x.double() if x.is_floating_point() else x for key, x in t.items()}))
    torch.testing.assert_close(compiled.double(), expected, atol=TOLERANCE[dtype] if dtype == torch.bfloat16 else 5e-6, rtol=0)


def test_a_first_bfloat16_call_under_compile_traces_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernels' toolchain check (a PATH scan, kept per process) may first run while
    Dynamo traces, when no eager bf16 call came before: it must not break the graph there."""
    from qkv.native import build

    monkeypatch.setattr(build, "_TOOLCHAIN", {})  # as in a fresh process
    q, k, v = _inputs(torch.bfloat16, n=ENGINE_N)
    report = torch._dynamo.explain(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.sliding_window(ENGINE_N // 8)))(q, k, v)
    assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]


def _leaves(name: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a case that take gradients beyond q, k, v."""
    return {"alibi": {"slopes": t["slopes"]}, "relative": {"table": t["table"]}, "sinks": {"sinks": t["sinks"]}}.get(name, {})


# every case under aot_eager; Inductor (a minute a compile on 2 cores) on three that cover the
# operators' autograd: the plain engine, a bias gradient, the sinks' gradient
_GRADIENT_CASES = [
    *((name, "aot_eager") for name in ("sliding_window", "documents", "alibi", "relative", "softcap", "sinks")),
    *((name, "inductor") for name in ("sliding_window", "alibi", "sinks")),
]


@pytest.mark.parametrize(("name", "compiler"), _GRADIENT_CASES)
def test_compiled_block_engine_gradients_equal_eager(name: str, compiler: str) -> None:
    eager_t, compiled_t = _engine_tensors(), _engine_tensors()
    for leaf in (*_leaves(name, eager_t).values(), *_leaves(name, compiled_t).values()):
        leaf.requires_grad_(True)
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    eager_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    compiled_in = [x.clone().requires_grad_(True) for x in (q, k, v)]

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        out, lse = qkv.attention(q, k, v, return_lse=True, **_engine_kwargs(name, t))
        return out.sin().sum() + 0.1 * lse.sum()  # lse's gradient too

    loss(*eager_in, eager_t).backward()
    compiled = torch.compile(loss, backend=compiler, fullgraph=True)
    assert "qkv.blocks_forward" in _ops_in_graph(loss, *compiled_in, compiled_t)
    compiled(*compiled_in, compiled_t).backward()
    for want, got in zip(eager_in, compiled_in, strict=True):
        assert want.grad is not None and got.grad is not None
        # the same backward code on the same saved tensors; Inductor may reorder the loss's own sums
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5 if compiler == "inductor" else 0, rtol=0)
    for key in _leaves(name, eager_t):
        want, got = eager_t[key].grad, compiled_t[key].grad
        assert want is not None and got is not None
        # sums over every row: the gradients' memory order may change the order of the sum (an ulp)
        torch.testing.assert_close(got, want, atol=1e-5 if compiler == "inductor" else 1e-6, rtol=1e-6)


def test_nan_rule_and_overflow_refusal_on_the_compiled_block_engine() -> None:
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.sliding_window(32)), fullgraph=True)
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    q[0, 1, 3, 0] = float("inf")  # row 3 of head 1
    k[0, 0, 200, 2] = float("nan")  # key 200 of kv head 0: rows 200..232 of query heads 0 and 1
    out = compiled(q, k, v)
    bad = out.isnan().any(dim=-1)  # (1, H, n)
    expected_bad = torch.zeros(1, H, ENGINE_N, dtype=torch.bool)
    expected_bad[0, 1, 3] = True
    expected_bad[0, :2, 200:233] = True
    assert torch.equal(bad, expected_bad)
    assert out.isnan().all(dim=-1).eq(bad).all()
    torch.testing.assert_close(out, qkv.attention(q, k, v, qkv.masks.sliding_window(32)), atol=0, rtol=0, equal_nan=True)
    big_q, big_k, _ = _inputs(torch.float32, n=ENGINE_N)
    with pytest.raises(ValueError, match="beyond half the largest float32") as eager_error:
        qkv.attention(big_q * 1e19, big_k * 1e19, v, qkv.masks.sliding_window(32))
    # the operator runs eager's check: its message, values included
    with pytest.raises(ValueError, match="beyond half the largest float32") as compiled_error:
        compiled(big_q * 1e19, big_k * 1e19, v)
    assert str(compiled_error.value) == str(eager_error.value)


@pytest.mark.parametrize("name", ["sliding_window", "documents", "alibi", "softcap", "sinks"])
def test_compiled_block_engine_refuses_an_overflow_with_eagers_error(name: str) -> None:
    """Finite q and k whose scores overflow float32: the compiled block engine raises eager's
    ValueError, message and values included, before the engine runs."""
    t = _engine_tensors()
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    q, k = q * 1e19, k * 1e19  # |q_i| |k_j| ~ 1e39 * E: beyond half float32's largest (1.7e38)
    kwargs = _engine_kwargs(name, t)
    assert "qkv.blocks_forward" in _ops_in_graph(lambda q, k, v: qkv.attention(q / 1e19, k / 1e19, v, **kwargs), q, k, v)
    with pytest.raises(ValueError, match="beyond half the largest float32") as eager_error:
        qkv.attention(q, k, v, **kwargs)
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, **kwargs), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="beyond half the largest float32") as compiled_error:
        compiled(q, k, v)
    assert str(compiled_error.value) == str(eager_error.value)


def test_backend_blocks_compiles_and_refuses_what_cannot_enter_its_operator() -> None:
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    mask = qkv.masks.sliding_window(20)
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, backend="blocks"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), qkv.attention(q, k, v, mask, backend="blocks"), atol=0, rtol=0)
    with_mod = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, score_mod=_distance_penalty, backend="blocks"),
                             backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="score_mod is a Python function"):
        with_mod(q, k, v)
    with pytest.raises(ValueError, match=r"torch\.compile, torch\.export and vmap"):
        torch.func.vmap(lambda q, k, v: qkv.attention(q, k, v, mask, backend="blocks"))(q, k, v)


def test_explain_while_tracing_names_the_operator_and_where_score_mod_goes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode()
    q, k, v = (fake_mode.from_tensor(x) for x in _inputs(torch.float32, n=ENGINE_N))
    with fake_mode:
        window = qkv.explain(q, k, v, qkv.masks.sliding_window(ENGINE_N // 8))
        modded = qkv.explain(q, k, v, qkv.masks.sliding_window(ENGINE_N // 8), score_mod=_distance_penalty)
        wide = qkv.explain(q, k, v, qkv.masks.sliding_window(ENGINE_N, ENGINE_N))
    assert window.path == "blocks" and "qkv::blocks_forward" in window.reason and window.upper_bound
    visible = int(qkv.masks.sliding_window(ENGINE_N // 8).to_dense(ENGINE_N, ENGINE_N).sum())
    assert f"{visible / ENGINE_N**2:.1%} of the score matrix visible" in window.reason
    assert window.tiles == "planned when the traced graph runs, from the mask's values"
    assert modded.path == "math" and "score_mod" in modded.reason
    assert wide.path == "fused"  # every key visible: SDPA, as eager


def test_the_operators_carry_a_digest_of_their_implementation_into_the_graph() -> None:
    # TorchInductor's caches key a graph by its operators' names and arguments: the digest of
    # the file that holds the operators' fake kernels and autograd formula makes a changed
    # implementation a new graph (a stale cached graph fails its size asserts)
    import hashlib
    from pathlib import Path

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from qkv.backends.blocks import ops

    digest = hashlib.sha256(Path(ops.__file__).read_bytes()).hexdigest()[:16]
    last_args: dict[str, object] = {}

    def keep(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        for node in gm.graph.nodes:
            if node.op == "call_function" and "qkv.blocks_" in str(node.target):
                last_args[str(node.target).split(".")[1]] = node.args[-1]
        return make_boxed_func(gm)

    q, k, v = (x.requires_grad_(True) for x in _inputs(torch.float32, n=ENGINE_N))
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.sliding_window(32), backend="blocks"),
                             backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)  # fmt: skip
    compiled(q, k, v).sum().backward()
    assert last_args == {"blocks_forward": digest, "blocks_backward": digest}


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # opcheck's own
def test_operators_pass_opcheck() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, ENGINE_N, E, generator=gen) for _ in range(3))  # as kernel_inputs gives them
    t = _engine_tensors()
    slopes = t["slopes"].clone().requires_grad_(True)
    sinks = t["sinks"].view(1, H).clone().requires_grad_(True)
    ids = _ids(ENGINE_N).view(1, -1)
    window, documents = "('!',('sliding_window',32,0,'bottom-right',),)", "('!',('documents','@',None,),)"
    impl = "opcheck"  # the digest argument (`ops._IMPL`): the operators do not read it
    samples = [
        (None, [], [], window, "None", 0.3, None, "cpu_flash_tiles", "engine_per_call", True, impl),
        (sinks, [ids], [], documents, "None", 0.3, None, "cpu_flash_tiles", "engine_per_call", True, impl),
        (None, [], [slopes], "('!',('causal','bottom-right',),)", "('!',('alibi','@',),)", 0.3, 3.0, "score_tiles", "scored_per_call",
         True, impl),
        (None, [], [], "None", "None", 0.3, None, "cpu_flash_tiles", "engine_per_call", False, impl),
    ]
    for rest in samples:
        need_grad = rest[-2]
        q_, k_, v_ = (x.clone().requires_grad_(need_grad) for x in (q, k, v))
        torch.library.opcheck(torch.ops.qkv.blocks_forward.default, (q_, k_, v_, *rest))
    # the backward operator on a forward's saved outputs, with the lse's gradient and the sinks'
    out, lse, shift, rest_, p_sink, rows, nonfinite = torch.ops.qkv.blocks_forward(q, k, v, sinks.detach(), [ids], [], documents, "None", 0.3,
                                                                  None, "cpu_flash_tiles", "engine_per_call", True, impl)
    grad_out, grad_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    torch.library.opcheck(torch.ops.qkv.blocks_backward.default, (
        grad_out, grad_lse, q, k, v, out, lse, shift, rest_, sinks.detach(), p_sink, rows, nonfinite, [ids], [], documents, "None",
        0.3, None,
        "cpu_flash_tiles", "engine_per_call", True, [], impl,
    ))


@pytest.mark.parametrize("case", ["sliding_window", "alibi", "bool tensor"])
def test_export_of_multihead_attention_on_the_block_engine_saves_loads_and_equals_eager(case: str) -> None:
    n = ENGINE_N
    bool_mask = torch.ones(1, 1, n, n, dtype=torch.bool).tril(diagonal=-2) | torch.eye(n, dtype=torch.bool)
    kwargs, mask = {
        "sliding_window": ({}, qkv.masks.sliding_window(32)),
        "alibi": ({"position_bias": qkv.bias.alibi()}, qkv.masks.sliding_window(64)),
        "bool tensor": ({}, bool_mask),
    }[case]
    torch.manual_seed(0)
    module = qkv.MultiHeadAttention(32, 4, **kwargs).eval()
    x = torch.randn(1, n, 32)

    exported = torch.export.export(_WithMask(module, mask), (x,))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert ("qkv.blocks_forward.default" in targets) == (case != "bool tensor")  # a bool tensor stays on SDPA
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    with torch.no_grad():
        eager = module(x, mask=mask)
    torch.testing.assert_close(loaded.module()(x), eager, atol=1e-6, rtol=0)


def test_onnx_dynamo_export_at_block_engine_sizes_gives_the_dense_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX has no operator for qkv::blocks_forward: while torch.onnx exports, 'auto' keeps to the
    dense paths at sizes where torch.export alone takes the engine's operator, and
    backend='blocks' is refused by name. (The graph's values are checked at small sizes above:
    onnx's reference evaluator gathers with numpy.choose, which takes at most 64 keys.)"""
    torch.manual_seed(0)

    class Attend(torch.nn.Module):
        def __init__(self, backend: str) -> None:
            super().__init__()
            self.backend = backend

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = qkv.attention(q, k, v, qkv.masks.sliding_window(32), backend=self.backend)  # type: ignore[arg-type]
            assert isinstance(out, torch.Tensor)
            return out

    q, k, v = (torch.randn(1, 2, ENGINE_N, 16) for _ in range(3))
    assert qkv.explain(q, k, v, qkv.masks.sliding_window(32)).path == "blocks"  # eagerly: the engine
    program = torch.onnx.export(Attend("auto").eval(), (q, k, v), dynamo=True)
    assert program is not None
    assert all("blocks" not in node.op_type for node in program.model.graph)
    # qkv refuses backend='blocks' by name while torch.export traces for ONNX, and again when
    # torch.onnx retries with torch.export's strict mode (Dynamo, which folds
    # torch.onnx.is_in_onnx_export() to False: formerly the retry traced the operator and the
    # export failed later, on "no ONNX function for qkv.blocks_forward")
    with pytest.raises(Exception) as caught:  # noqa: PT011  # the exporter's own error type wraps qkv's
        torch.onnx.export(Attend("blocks").eval(), (q, k, v), dynamo=True)
    chain: list[BaseException] = []
    error: BaseException | None = caught.value
    while error is not None and len(chain) < 20:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any("backend='blocks' cannot be exported to ONNX" in str(e) for e in chain), [str(e)[:200] for e in chain]
    # the refusal itself, as torch.onnx's first strategy meets it: torch.export under its flag
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    with pytest.raises(ValueError, match="backend='blocks' cannot be exported to ONNX"):
        torch.export.export(Attend("blocks").eval(), (q, k, v))


@pytest.mark.parametrize("ids_order", ["sorted", "shuffled"])
def test_traced_nan_rule_for_documents_counts_bad_keys_per_document(ids_order: str) -> None:
    """The traced NaN rule finds a document's rows without rendering the L x S mask; expected
    rows from the rendered mask (`to_dense`), any order of ids."""
    n = ENGINE_N
    gen = torch.Generator().manual_seed(4)
    ids = torch.repeat_interleave(torch.arange(6), n // 6)
    if ids_order == "shuffled":
        ids = ids[torch.randperm(n, generator=gen)]
    mask = qkv.masks.documents(ids)
    q, k, v = _inputs(torch.float32, n=n)
    v[0, 1, 77, 0] = float("nan")  # key 77 of kv head 1: query heads 2 and 3
    q[0, 0, 5, 1] = float("-inf")
    expected_bad = torch.zeros(1, H, n, dtype=torch.bool)
    expected_bad[0, 2:, :] = mask.to_dense(n, n)[0, 0, :, 77]
    expected_bad[0, 0, 5] = True
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask), backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out.isnan().any(dim=-1), expected_bad)
    assert torch.equal(out.isnan().all(dim=-1), expected_bad)
    # traced, a documents mask goes to the engine by its size (its ids are not known); eagerly,
    # shuffled ids leave every tile non-empty and 'auto' takes SDPA: the engine's eager result
    torch.testing.assert_close(out, qkv.attention(q, k, v, mask, backend="blocks"), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["sliding_window", "alibi", "sinks"])
def test_nan_rule_gradients_on_the_compiled_block_engine_equal_eager(name: str) -> None:
    """The operators apply the NaN rule with the values at hand: the rows that read a bad entry
    are NaN and pass no gradient, the bad entries get none, every other gradient is eager's."""
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    q[0, 1, 3, 0] = float("inf")
    v[0, 0, 200, 2] = float("nan")
    results = []
    for compiled in (False, True):
        t = _engine_tensors()
        for leaf in _leaves(name, t).values():
            leaf.requires_grad_(True)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

        def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: dict[str, torch.Tensor] = t) -> torch.Tensor:
            out = qkv.attention(q, k, v, **_engine_kwargs(name, t))
            return out.nan_to_num(nan=0.0).sin().sum(), out

        run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
        total, out = run(*leaves)
        total.backward()
        results.append((out, [x.grad for x in leaves] + [x.grad for x in _leaves(name, t).values()]))
    (eager_out, eager_grads), (compiled_out, compiled_grads) = results
    assert eager_out.isnan().any()
    torch.testing.assert_close(compiled_out, eager_out, atol=0, rtol=0, equal_nan=True)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        assert got is not None and want is not None and not want.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_backward_operator_reuses_the_forwards_plan_for_mask_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents: the backward operator finds the plan the forward made from equal ids (eager's
    autograd Function keeps its plan too); ids with other values are planned anew, and the
    gradients equal eager's for both."""
    from qkv.backends.blocks import ops

    planned: list[int] = []
    original = ops.plan_for
    monkeypatch.setattr(ops, "_DATA_PLANS", [])
    monkeypatch.setattr(ops, "plan_for", lambda *args, **kwargs: planned.append(1) or original(*args, **kwargs))
    compiled = torch.compile(lambda q, k, v, ids: qkv.attention(q, k, v, qkv.masks.documents(ids)), backend="aot_eager", fullgraph=True)
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    first, second = _ids(ENGINE_N), torch.repeat_interleave(torch.tensor([0, 1, 2]), torch.tensor([100, 250, ENGINE_N - 350]))
    for ids, plans in ((first, 1), (second, 2)):
        eager_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
        compiled_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
        compiled(*compiled_in, ids).square().sum().backward()
        assert len(planned) == plans  # one plan per ids, made by the forward operator
        qkv.attention(*eager_in, qkv.masks.documents(ids)).square().sum().backward()  # plans by dispatch
        for got, want in zip(compiled_in, eager_in, strict=True):
            assert got.grad is not None and want.grad is not None
            torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_backward_operator_reuses_the_forwards_mask_tiles(monkeypatch: pytest.MonkeyPatch, with_sinks: bool) -> None:
    """A sliding window without score terms: the backward operator takes the forward's run and
    the mask tiles it built (eager's autograd Function keeps its run in its context), so one
    run serves forward and backward; every gradient equals eager's."""
    from qkv.backends.blocks import ops

    made: list[int] = []
    original = ops.BlockRun
    monkeypatch.setattr(ops, "_KEPT_RUNS", {})
    monkeypatch.setattr(ops, "BlockRun", lambda *args, **kwargs: made.append(1) or original(*args, **kwargs))
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = qkv.masks.sliding_window(32)
    extra = {"sinks": sinks} if with_sinks else {}
    compiled = torch.compile(lambda q, k, v: qkv.attention(q, k, v, mask, **extra), backend="aot_eager", fullgraph=True)
    compiled_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    eager_in = [x.clone().requires_grad_(True) for x in (q, k, v)]
    assert qkv.explain(*compiled_in, mask, **extra).path == "blocks"
    compiled(*compiled_in).square().sum().backward()
    assert len(made) == 1  # the forward's run, taken by the backward
    assert ops._KEPT_RUNS == {}
    qkv.attention(*eager_in, mask, **extra).square().sum().backward()
    for got, want in zip(compiled_in, eager_in, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bias", ["fixed table", "learnable table", "alibi"])
def test_backward_operator_reuses_the_forwards_bias_tiles(monkeypatch: pytest.MonkeyPatch, bias: str) -> None:
    """A relative bias or ALiBi on a sliding window: the backward operator takes the forward's
    scored run (plan, terms, bias tiles: eager's autograd Function keeps them too) instead of
    building it again, also where the compiled backward computes ALiBi's slopes again rather
    than saving them (AOTAutograd's partitioners recompute such cheap values: equal values at
    another address). A learnable table's gradient is taken against the backward's own tensors,
    so the run is built anew there. Every gradient equals eager's, the table's included."""
    from qkv.backends.blocks import ops, scored

    built: list[int] = []
    original = scored._ScoredRun
    monkeypatch.setattr(ops, "_KEPT_RUNS", {})
    monkeypatch.setattr(scored, "_ScoredRun", lambda *args, **kwargs: built.append(1) or original(*args, **kwargs))
    table = torch.randn(4, 32, generator=torch.Generator().manual_seed(8)) * 0.1
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    mask = qkv.masks.sliding_window(32)
    compiled_in = [x.clone().requires_grad_(True) for x in (q, k, v, table)]
    eager_in = [x.clone().requires_grad_(True) for x in (q, k, v, table)]
    if bias != "learnable table":
        compiled_in[3].requires_grad_(False)
        eager_in[3].requires_grad_(False)

    def make_bias(t: torch.Tensor) -> qkv.bias.Bias:
        return qkv.bias.alibi() if bias == "alibi" else qkv.bias.relative(t)

    compiled = torch.compile(lambda q, k, v, t: qkv.attention(q, k, v, mask, bias=make_bias(t)), backend="aot_eager", fullgraph=True)
    assert qkv.explain(*compiled_in[:3], mask, bias=make_bias(table)).path == "blocks"
    compiled(*compiled_in).square().sum().backward()
    assert len(built) == (2 if bias == "learnable table" else 1)  # the forward's run, and the backward's own for a learnable table
    assert ops._KEPT_RUNS == {}  # taken out by the backward
    qkv.attention(*eager_in[:3], mask, bias=make_bias(eager_in[3])).square().sum().backward()
    for got, want in zip(compiled_in, eager_in, strict=True):
        assert (got.grad is None) == (want.grad is None) == (not got.requires_grad)
        if got.grad is not None and want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("terms", ["alibi", "softcap", "learnable table"])
def test_backward_operator_records_no_graph_on_its_inputs(monkeypatch: pytest.MonkeyPatch, terms: str) -> None:
    """The scored backward runs with grad mode off inside the backward operator, as inside eager's
    autograd Function: q, k, v still require grad there, and with grad mode on every op on them
    recorded a graph that nothing used (a scored backward took 7 % longer at n = 1,024). The tiles it
    differentiates (softcap, a learnable table) turn grad mode on themselves; every gradient
    equals eager's."""
    from qkv.backends.blocks import scored

    grad_mode: dict[bool, list[bool]] = {False: [], True: []}
    compiled_now = [False]
    original = scored._backward

    def spy(*args: Any, **kwargs: Any) -> Any:
        grad_mode[compiled_now[0]].append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(scored, "_backward", spy)
    table = torch.randn(H, 32, generator=torch.Generator().manual_seed(3)) * 0.1
    kwargs: Callable[[torch.Tensor], dict[str, Any]] = {
        "alibi": lambda t: {"bias": qkv.bias.alibi()},
        "softcap": lambda t: {"softcap": 2.0},
        "learnable table": lambda t: {"bias": qkv.bias.relative(t)},
    }[terms]
    q, k, v = _inputs(torch.float32, n=ENGINE_N)
    mask = qkv.masks.sliding_window(32)
    grads: dict[bool, list[torch.Tensor | None]] = {}
    for compiled in (False, True):
        compiled_now[0] = compiled
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)] + [table.clone().requires_grad_(terms == "learnable table")]

        def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return qkv.attention(q, k, v, mask, **kwargs(t)).square().sum()

        assert qkv.explain(*leaves[:3], mask, **kwargs(leaves[3])).path == "blocks"
        (torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss)(*leaves).backward()
        grads[compiled] = [x.grad for x in leaves]
    assert grad_mode == {False: [False], True: [False]}
    for got, want in zip(grads[True], grads[False], strict=True):
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_nan_rows_pass_no_gradient_when_the_loss_reads_them(dtype: torch.dtype) -> None:
    """A loss that reads the NaN rows themselves (out.sum(), the lse too) sends them a gradient:
    the backward operator drops it as eager's masked_fill does, and the non-finite v entry at
    key 200 gets none; every gradient equals eager's (bfloat16 runs the fused interval kernels)."""
    q, k, v = _inputs(dtype, n=ENGINE_N)
    q[0, 1, 3, 0] = float("inf")
    v[0, 0, 200, 2] = float("nan")
    results = []
    for compiled in (False, True):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

        def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = qkv.attention(q, k, v, qkv.masks.sliding_window(ENGINE_N // 8), return_lse=True)
            return out.float().sum() + lse.sum(), out

        run = torch.compile(loss, backend="aot_eager", fullgraph=True) if compiled else loss
        total, out = run(*leaves)
        assert total.isnan()  # the loss reads the NaN rows
        total.backward()
        results.append((out, [x.grad for x in leaves]))
    (eager_out, eager_grads), (compiled_out, compiled_grads) = results
    torch.testing.assert_close(compiled_out, eager_out, atol=0, rtol=0, equal_nan=True)
    for got, want in zip(compiled_grads, eager_grads, strict=True):
        assert got is not None and want is not None and not want.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-6 if dtype == torch.float32 else 1e-2)


def _bad_entries(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sets q[0, 1, 3, 0] = inf and v[0, 0, 40, 2] = NaN in place; returns (1, H, L) bool, the rows
    that read them under a causal mask (row 3 of query head 1; rows 40.. of query heads 0 and 1,
    which share kv head 0)."""
    q[0, 1, 3, 0] = float("inf")
    v[0, 0, 40, 2] = float("nan")
    bad = torch.zeros(1, H, q.shape[2], dtype=torch.bool)
    bad[0, 1, 3] = True
    bad[0, :2, 40:] = True
    return bad


def _loss_of_finite_rows(out: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    return torch.where(bad.unsqueeze(-1), 0.0, out).square().sum()


def _clean_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad: torch.Tensor) -> list[torch.Tensor]:
    """The expected gradients of `_loss_of_finite_rows`: the float64 math path on the inputs with
    their non-finite entries replaced by 0. The rows that read one are left out of the loss, so
    no gradient reaches the replaced entries, as the NaN rule asks."""
    leaves = [x.double().nan_to_num(nan=0.0, posinf=0.0).requires_grad_(True) for x in (q, k, v)]
    _loss_of_finite_rows(qkv.attention(*leaves, qkv.masks.causal(), backend="math"), bad).backward()
    return [x.grad for x in leaves]  # type: ignore[misc]


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_nan_rule_gradients_on_the_compiled_dense_path_equal_the_math_path(compiler: str) -> None:
    """The dense path's traced NaN rule cleans q, k, v with the ``qkv::finite_entries`` operator,
    whose backward is an operator too: the gradients reach every finite entry as the float64
    math path gives them on the cleaned inputs and are 0 at the non-finite ones; a loss that
    reads the NaN rows too (out.sum()) sends them none, as eagerly."""
    q, k, v = _inputs(torch.float32)
    bad = _bad_entries(q, v)
    fn = torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal()), backend=compiler, fullgraph=True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves)
    assert qkv.explain(q, k, v, qkv.masks.causal()).path != "blocks"
    assert torch.equal(out.isnan().all(dim=-1), bad)
    _loss_of_finite_rows(out, bad).backward()
    for got, want in zip(leaves, _clean_grads(q, k, v, bad), strict=True):
        assert got.grad is not None
        torch.testing.assert_close(got.grad.double(), want, atol=2e-5, rtol=0)
    assert leaves[0].grad is not None and leaves[2].grad is not None
    assert leaves[0].grad[0, 1, 3, 0] == 0 and leaves[2].grad[0, 0, 40, 2] == 0
    # the loss reads the NaN rows: their gradient is dropped, the others stay as above
    eager = [x.clone().requires_grad_(True) for x in (q, k, v)]
    qkv.attention(*eager, qkv.masks.causal()).sum().backward()
    compiled = [x.clone().requires_grad_(True) for x in (q, k, v)]
    fn(*compiled).sum().backward()
    for got, want in zip(compiled, eager, strict=True):
        assert got.grad is not None and want.grad is not None and not want.grad.isnan().any()
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-6)


def test_vmap_of_grad_with_non_finite_entries_equals_the_math_path() -> None:
    """Under vmap the NaN rule runs as tensor operations on the whole batch (its operators'
    vmap rules): a batch entry with a non-finite q and v entry gets NaN in the rows that read
    them and the cleaned problem's gradients elsewhere; the other entries are unaffected."""
    q, k, v = _inputs(torch.float64, batch=3)
    bad = torch.zeros(3, H, L, dtype=torch.bool)
    bad[1:2] = _bad_entries(q[1:2], v[1:2])

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        return _loss_of_finite_rows(qkv.attention(q, k, v, qkv.masks.causal()), bad)

    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v, bad)
    outs = torch.func.vmap(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal()))(q, k, v)
    assert torch.equal(outs.isnan().all(dim=-1), bad)
    for i in range(3):
        expected = _clean_grads(q[i : i + 1], k[i : i + 1], v[i : i + 1], bad[i : i + 1])
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got[i : i + 1], want, atol=1e-12, rtol=0, msg=f"batch entry {i}")


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_compiled_vmap_with_non_finite_entries_equals_the_math_path() -> None:
    """torch.compile of a vmapped call: the traced NaN rule's operators run batched (their vmap
    rules), forward and backward. (Dispatch cannot see vmap's wrappers while Dynamo traces, so
    the call takes SDPA, which has no batching rule: PyTorch warns of its slower loop.)"""
    q, k, v = _inputs(torch.float64, batch=3)
    bad = torch.zeros(3, H, L, dtype=torch.bool)
    bad[:1] = _bad_entries(q[:1], v[:1])  # the first entry: a batch in the wrong order shows

    def batched_loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.func.vmap(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal()))(q, k, v)
        return _loss_of_finite_rows(out, bad), out

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    total, out = torch.compile(batched_loss, backend="aot_eager", fullgraph=True)(*leaves)
    assert torch.equal(out.isnan().all(dim=-1), bad) and torch.equal(out.isnan().any(dim=-1), bad)
    total.backward()
    for i in range(3):
        expected = _clean_grads(q[i : i + 1], k[i : i + 1], v[i : i + 1], bad[i : i + 1])
        for got, want in zip(leaves, expected, strict=True):
            assert got.grad is not None
            torch.testing.assert_close(got.grad[i : i + 1], want, atol=1e-12, rtol=0, msg=f"batch entry {i}")


def test_traced_nan_rule_cleans_through_its_operator_under_compile_only() -> None:
    """torch.compile's graph of a dense path cleans q, k and v with ``qkv::finite_entries``
    (the graph code would make Inductor write bool masks, slowly); an exported program holds
    PyTorch's operators only, as ONNX and AOTInductor need."""
    targets: list[str] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    q, k, v = _inputs(torch.float32)
    torch.compile(lambda q, k, v: qkv.attention(q, k, v, qkv.masks.causal()), backend=capture, fullgraph=True)(q, k, v)
    assert sum("qkv.finite_entries" in t for t in targets) == 3
    layer = qkv.MultiHeadAttention(16, 4)
    exported = torch.export.export(layer, (torch.randn(2, 8, 16),))
    assert not [n for n in exported.graph.nodes if n.op == "call_function" and "qkv" in str(n.target)]


def test_attention_varlen_traces_whole_and_checks_its_offsets_when_the_graph_runs() -> None:
    """FlashAttention's packed signature under torch.compile(fullgraph=True): cu_seqlens'
    checks read its values, which a trace cannot (formerly a data-dependent guard,
    "Could not guard on data-dependent expression"); they now run inside the graph and raise
    eager's ValueError type. Values equal the float64 math path."""
    cu = torch.tensor([0, 20, 44, 48], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(48, H, E, generator=gen), torch.randn(48, G, E, generator=gen), torch.randn(48, G, E, generator=gen)
    compiled = torch.compile(lambda q, k, v, cu: qkv.attention_varlen(q, k, v, cu, causal=True), backend="aot_eager", fullgraph=True)
    expected = qkv.attention_varlen(q.double(), k.double(), v.double(), cu, causal=True, backend="math")
    torch.testing.assert_close(compiled(q, k, v, cu).double(), expected, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, never decrease and end at the packed tensor's 48 rows"):
        compiled(q, k, v, torch.tensor([0, 30, 20, 48], dtype=torch.int32))
