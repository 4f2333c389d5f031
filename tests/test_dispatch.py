"""qkv.attention.dispatch: every decision of a call is in its Plan, and explain runs no kernel.

The expected routes are the design's (docs/design.md, the module docstring of qkv.attention.dispatch): SDPA's
is_causal only for top-left-equal causal masks, no mask at all where causality hides nothing,
tiles for the structured engines. Numbers for the memory model are counted by hand.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv import masks as M
from qkv.attention import execute as execute_module
from qkv.attention import functional as functional_module
from qkv.attention.dispatch import choose_path, ring_block_path, weights_plan
from qkv.attention.problem import describe_problem
from qkv.native import interval_bf16
from qkv.native.machine import cpu_features


def _plan(L: int, S: int, mask: object, *, backend: str = "auto", weights: bool = False, lse: bool = False,
          grad: bool = False, E: int = 8, Ev: int = 8, **terms: object):
    q = torch.randn(1, 2, L, E, requires_grad=grad)
    k, v = torch.randn(1, 2, S, E), torch.randn(1, 2, S, Ev)
    return choose_path(describe_problem(q, k, v, mask, **terms), backend, weights, lse)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("L", "S", "mask", "backend", "path", "route"),
    [
        (16, 16, None, "auto", "fused", "none"),
        (16, 16, "causal", "auto", "fused", "is_causal"),  # offset 0: SDPA's top-left flag is ours
        (1, 40, "causal", "auto", "fused", "none"),  # a decoding step sees its whole cache
        (10, 40, "causal", "auto", "fused", "dense"),  # bottom-right with L != S: SDPA cannot say it
        (16, 16, "bool", "auto", "fused", "dense"),
        (16, 16, "window", "auto", "fused", "dense"),  # too small for the block engine
        (1024, 1024, "window", "auto", "blocks", "tiles"),
        (16, 16, "causal", "math", "math", "causal_offset"),
        (16, 16, "window", "math", "math", "dense"),
        (16, 16, None, "blocks", "blocks", "tiles"),
    ],
)
def test_each_mask_kind_reaches_the_kernel_as_the_plan_says(L, S, mask, backend, path, route) -> None:
    made = {"causal": M.causal(), "window": M.sliding_window(32), "bool": torch.rand(L, S) > 0.5, None: None}[mask]
    plan = _plan(L, S, made, backend=backend)
    assert (plan.path, plan.mask) == (path, route)
    assert (plan.layout is not None) == (route == "tiles")


def test_score_terms_reach_each_path_as_the_plan_says() -> None:
    assert _plan(16, 16, None, bias=qkv.bias.alibi()).scores == "dense_mask"  # joins SDPA's float mask
    assert _plan(16, 16, None, softcap=20.0).scores == "formula"  # SDPA cannot cap: the math path
    assert _plan(512, 512, M.causal(), softcap=20.0).scores == "tiles"  # large: the engine applies it
    assert _plan(16, 16, None).scores == "none"
    with pytest.raises(ValueError, match="softcap or score_mod"):
        _plan(16, 16, None, backend="fused", softcap=20.0)


def test_where_weights_and_lse_come_from() -> None:
    fused = _plan(16, 16, None, lse=True)
    assert (fused.weights, fused.lse) == ("none", "kernel")  # PyTorch's CPU flash kernel returns it
    both = _plan(16, 16, None, weights=True, lse=True)
    assert (both.weights, both.lse) == ("dense", "dense")  # recomputed together by the dense formula
    math = _plan(16, 16, None, backend="math", weights=True)
    assert (math.weights, math.lse) == ("kernel", "kernel")
    window = M.sliding_window(32)
    engine = _plan(1024, 1024, window, weights=True)
    assert (engine.path, engine.weights, engine.lse) == ("blocks", "tiles", "kernel")
    graded = _plan(1024, 1024, window, weights=True, grad=True)
    assert (graded.path, graded.weights) == ("blocks", "dense")  # weights a loss differentiates
    assert graded.causal_offset is None and _plan(1024, 1024, M.causal(), backend="blocks", weights=True,
                                                   grad=True).causal_offset == 0


def test_a_learned_float_mask_takes_its_lse_from_the_dense_formula() -> None:
    # the CPU flash kernel gives no gradient to a float mask: the plan must not take its lse
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 11, 4), torch.randn(1, 2, 11, 4)
    mask = torch.randn(9, 11, requires_grad=True)
    plan = choose_path(describe_problem(q, k, v, mask), "fused", False, True)
    assert plan.lse == "dense"
    assert choose_path(describe_problem(q, k, v, mask.detach()), "fused", False, True).lse == "kernel"
    out, lse = qkv.attention(q, k, v, mask, return_lse=True, backend="fused")
    (out.sum() + lse.sum()).backward()
    grad = mask.grad.clone()
    mask.grad = None
    out_m, lse_m = qkv.attention(q, k, v, mask, return_lse=True, backend="math")
    (out_m.sum() + lse_m.sum()).backward()
    torch.testing.assert_close(grad, mask.grad, atol=1e-5, rtol=1e-5)


def test_attention_weights_plan() -> None:
    q = torch.randn(1, 2, 8, 4)
    assert weights_plan(describe_problem(q, q, q, M.causal())).weights == "tiles"
    assert weights_plan(describe_problem(q, q, q, None)).mask == "tiles"
    dense = weights_plan(describe_problem(q, q, q, torch.ones(8, 8, dtype=torch.bool)))
    assert (dense.path, dense.mask, dense.weights) == ("math", "dense", "dense")


def test_ring_blocks_follow_the_dispatchers_sub_rule() -> None:
    q, v, v_narrow = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 3)
    assert ring_block_path(q, v) == "cpu-flash"
    assert ring_block_path(q, v_narrow) == "tiles"  # the ring does not pad head dims for the kernel
    assert ring_block_path(q, v, cpu_flash=False) == "tiles"
    from qkv.distributed import blockwise

    assert blockwise.block_path(q, v) == "cpu-flash"


_KERNELS = ("fused_attention", "math_attention", "block_attention", "scored_block_attention", "flex_attention_layout",
            "attention_weights_dense", "dense_lse", "block_lse", "block_weights")


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"mask": M.causal(), "return_lse": True},
        {"mask": M.sliding_window(48), "return_weights": True},
        {"mask": M.sliding_window(48), "softcap": 30.0, "bias": qkv.bias.alibi()},
        {"mask": "bool", "backend": "math", "return_weights": True, "return_lse": True},
        {"mask": M.documents(torch.arange(640) // 200), "backend": "blocks", "return_lse": True},
    ],
)
def test_explain_runs_no_kernel(monkeypatch: pytest.MonkeyPatch, kwargs: dict) -> None:
    q = torch.randn(1, 2, 640, 8)
    kwargs = dict(kwargs)
    if kwargs.get("mask") == "bool":
        kwargs["mask"] = torch.rand(640, 640) > 0.5

    def no_kernel(*args: object, **kw: object) -> None:
        raise AssertionError("explain ran a kernel")

    for name in _KERNELS:
        monkeypatch.setattr(execute_module, name, no_kernel)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_kernel)
    e = qkv.explain(q, q, q, **kwargs)
    assert e.flops > 0 and e.peak_extra_bytes > 0
    with pytest.raises(AssertionError, match="explain ran a kernel"):  # the patch does catch a kernel
        qkv.attention(q, q, q, **kwargs)


def test_memory_model_counts_what_the_plan_builds() -> None:
    B, H, L, S, E = 1, 2, 1, 700, 8
    q, k = torch.randn(B, H, L, E), torch.randn(B, H, S, E)
    # a decoding step under causal builds no mask: the same memory as no mask at all
    assert qkv.explain(q, k, k, M.causal()).peak_extra_bytes == qkv.explain(q, k, k).peak_extra_bytes
    # the bool mask of a bottom-right causal step with L != S: one byte per (query, key) pair
    q10 = torch.randn(B, H, 10, E)
    dense = qkv.explain(q10, k, k, M.causal()).peak_extra_bytes - qkv.explain(q10, k, k).peak_extra_bytes
    assert dense == 10 * S
    # the math path: scores, exponentials and weights, float32, per (batch, head, query, key)
    assert qkv.explain(q10, k, k, backend="math").peak_extra_bytes == 3 * B * H * 10 * S * 4


def test_attention_varlen_goes_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = []

    def recording(*args: object, **kwargs: object):
        plan = choose_path(*args, **kwargs)  # type: ignore[arg-type]
        chosen.append(plan)
        return plan

    monkeypatch.setattr(functional_module, "choose_path", recording)
    q = torch.randn(2400, 4, 16)  # large enough for the engine to beat SDPA with a dense mask
    cu = torch.tensor([0, 800, 2400], dtype=torch.int32)
    qkv.attention_varlen(q, q, q, cu, causal=True)
    assert [p.path for p in chosen] == ["blocks"] and chosen[0].mask == "tiles"


def test_explain_says_how_the_plan_routes_mask_scores_weights_and_lse() -> None:
    q, cache = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 40, 8)
    assert qkv.explain(q, cache, cache, M.causal()).route == "no mask is passed"  # a decoding step
    q = torch.randn(1, 2, 16, 8)
    assert qkv.explain(q, q, q, M.causal(), return_lse=True).route == "the mask is SDPA's is_causal; lse from the kernel"
    biased = qkv.explain(q, q, q, M.sliding_window(4), bias=qkv.bias.alibi(), return_weights=True)
    assert biased.route == ("the mask is a dense tensor; the bias joins SDPA's float mask; "
                            "weights from the dense formula; lse from the dense formula")
    long = torch.randn(1, 2, 1024, 8)
    engine = qkv.explain(long, long, long, M.sliding_window(64), softcap=30.0, return_weights=True)
    assert engine.route == "the mask reaches the kernel as tiles; the score terms are applied tile by tile; weights from the tiles"
    assert "route: the mask reaches the kernel as tiles" in str(engine)


def test_explain_counts_the_pairs_of_sdpas_causal_route_by_hand() -> None:
    # L = S with causal(): SDPA's is_causal route; row i sees i + 1 keys, 1 + 2 + ... + 7 = 28
    q = torch.randn(1, 1, 7, 4)
    e = qkv.explain(q, q, q, qkv.masks.causal(), backend="fused")
    assert "is_causal" in e.route
    assert e.visited_fraction == 28 / 49


def test_auto_sends_dense_bf16_to_the_fused_kernel_where_it_wins() -> None:
    gen = torch.Generator().manual_seed(3)
    # 600 keys: past the short-sequence kernel's 512 (its problems stay its own)
    q, k, v = (torch.randn(1, 2, 600, 64, generator=gen).to(torch.bfloat16) for _ in range(3))
    kernel = interval_bf16.unavailable_reason(torch.bfloat16, torch.device("cpu")) is None
    for mask in (None, M.causal()):
        said = qkv.explain(q, k, v, mask)
        assert said.path == ("blocks" if kernel else "fused")
        assert ("beats PyTorch's CPU flash kernel" in said.reason) == kernel
        with torch.no_grad():
            out = qkv.attention(q, k, v, mask)
            want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=mask is not None)
        assert (out.float() - want).abs().max() < 2e-2  # the output's bf16 rounding and P's
    heads_128 = [torch.randn(1, 2, 600, 128, generator=gen).to(torch.bfloat16) for _ in range(3)]
    assert qkv.explain(*heads_128).path == ("blocks" if kernel else "fused")
    # the avx512 build (AVX-512 BF16, no AMX) takes training and heads up to 256 too, from 128
    # queries; on AMX, SDPA keeps those
    dot = kernel and not cpu_features().amx
    wide = [torch.randn(1, 2, 600, 192, generator=gen).to(torch.bfloat16) for _ in range(3)]
    assert qkv.explain(*wide).path == ("blocks" if dot else "fused")
    assert qkv.explain(q.requires_grad_(True), k, v).path == ("blocks" if dot else "fused")
    assert qkv.explain(q[:, :, :255].detach(), k, v).path == ("blocks" if dot else "fused")  # few queries over 600 keys
    # where SDPA stays everywhere: wider heads, small problems, float32
    wider = [torch.randn(1, 2, 600, 288, generator=gen).to(torch.bfloat16) for _ in range(3)]
    assert qkv.explain(*wider).path == "fused"
    assert qkv.explain(q[:, :, :100].detach(), k[:, :, :100], v[:, :, :100], M.causal()).path == "fused"
    assert qkv.explain(q[:, :, :127].detach(), k, v).path == "fused"
    assert qkv.explain(q[:, :, :256].detach(), k, v).path == ("blocks" if kernel else "fused")
    assert qkv.explain(q.detach().float(), k.float(), v.float()).path == "fused"


def test_the_avx512_build_trains_dense_bf16_on_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an AVX-512 BF16 CPU without AMX (forced on an AMX machine): 'auto' sends dense
    bf16 training to the interval kernels, and their gradients match float64 autograd."""
    monkeypatch.setenv("QKV_CPU_TIER", "avx512")  # ignored on a lower machine: then SDPA runs
    gen = torch.Generator().manual_seed(11)
    leaves = [torch.randn(2, 3, 200, 80, generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in range(3)]
    d_out = torch.randn(2, 3, 200, 80, generator=gen).to(torch.bfloat16)
    runs = interval_bf16.unavailable_reason(torch.bfloat16, torch.device("cpu")) is None
    for mask in (None, M.causal()):
        said = qkv.explain(*leaves, mask)
        assert said.kernels == (("interval_bf16", "interval_bf16_backward") if runs else ("sdpa", "sdpa"))
        out = qkv.attention(*leaves, mask)
        grads = torch.autograd.grad(out, leaves, d_out)
        wide = [x.detach().double().requires_grad_(True) for x in leaves]
        want = torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=mask is not None)
        want_grads = torch.autograd.grad(want, wide, d_out.double())
        assert (out.double() - want).abs().max().item() < 2e-2
        for got, expected in zip(grads, want_grads, strict=True):
            scale = expected.abs().max().item()
            assert (got.double() - expected).abs().max().item() < 3e-2 * scale
