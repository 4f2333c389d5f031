"""qkv._private.torch, checked against torch 2.15: each private operator exists with the
schema qkv calls, and each wrapper gives what the public API gives."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version
from torch import nn
from torch.overrides import TorchFunctionMode

from qkv._private import torch as private_torch
from tests._private._bounds import assert_checked_release_is_allowed


def test_checked_release_is_inside_the_declared_range() -> None:
    assert private_torch.CHECKED_WITH == "2.15"
    assert_checked_release_is_allowed("torch", private_torch.CHECKED_WITH)


@pytest.mark.parametrize(("namespace", "name", "overload"), private_torch.PRIVATE_OPS)
def test_private_operators_exist(namespace: str, name: str, overload: str) -> None:
    packet = getattr(getattr(torch.ops, namespace), name)
    assert overload in packet.overloads()


def test_flash_forward_and_backward_match_the_formula() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    assert private_torch.has_cpu_flash_attention()
    out, lse = private_torch.cpu_flash_attention(q, k, v, 0.0, True, scale=0.5)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))
    grad_out = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    dq, dk, dv = private_torch.cpu_flash_attention_backward(grad_out, q, k, v, out, lse, 0.0, True, scale=0.5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.5).backward(grad_out)
    for ours, expected in zip((dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(ours, expected.grad)


def test_softmax_backward_matches_autograd() -> None:
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(logits, dim=-1)
    grad = torch.randn(4, 7, dtype=torch.float64)
    probs.backward(grad)
    torch.testing.assert_close(private_torch.softmax_backward(grad, probs.detach(), -1, torch.float64), logits.grad)


def test_onednn_linear_pointwise_is_the_fused_linear() -> None:
    x, weight, bias = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    out = private_torch.onednn_linear_pointwise()(x, weight, bias, "none", [], "")
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_wrapped_tensors_are_recognised() -> None:
    plain = torch.ones(3)
    assert not private_torch.is_wrapped_tensor(plain)
    seen = []
    torch.vmap(lambda row: seen.append(private_torch.is_wrapped_tensor(row)) or row)(torch.ones(2, 3))
    assert seen == [True]


def test_modes_and_hooks_are_seen() -> None:
    assert not private_torch.mode_active()
    with TorchFunctionMode():
        assert private_torch.mode_active()
    layer = nn.Linear(2, 2)
    assert not private_torch.hooks_would_run(layer)
    handle = layer.register_forward_hook(lambda *args: None)
    assert private_torch.hooks_would_run(layer)
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert private_torch.hooks_would_run(layer)
    finally:
        handle.remove()
    assert not private_torch.hooks_would_run(layer)


def test_real_tensors_inside_a_fake_tensor_mode() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3)
        with private_torch.real_tensors():
            real = torch.arange(3)
            total = int(real.sum())  # a fake tensor has no values to read
    assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor) and total == 3


@pytest.mark.parametrize("feature", sorted(private_torch.CPU_FEATURE_QUERIES))
def test_cpu_feature_queries_answer_or_claim_nothing(feature: str) -> None:
    # every query exists in the release they were checked against; an older torch may lack one
    # (2.5 has no _is_amx_fp16_supported), and then the feature is simply not claimed
    query = getattr(torch.cpu, private_torch.CPU_FEATURE_QUERIES[feature], None)
    if query is None:
        assert Version(torch.__version__).release < Version(private_torch.CHECKED_WITH).release
        assert private_torch.cpu_supports(feature) is False
        return
    assert private_torch.cpu_supports(feature) == bool(query())


def test_nonfinite_rows_under_inductor_finds_every_nonfinite_row() -> None:
    # Inductor in PyTorch 2.10, 2.12 and 2.13 folded x * 0 to 0, and the traced test found no row; the
    # expected rows are written out by hand
    x = torch.full((2, 5, 8), 3e38)  # huge but finite: no row
    x[0, 1, 2], x[0, 3, 7], x[1, 0, 0], x[1, 4, 5] = float("nan"), float("inf"), float("-inf"), float("nan")
    x[1, 4, 6] = float("inf")
    expected = torch.zeros(2, 5, dtype=torch.bool)
    expected[0, 1] = expected[0, 3] = expected[1, 0] = expected[1, 4] = True
    torch._dynamo.reset()
    try:
        compiled = torch.compile(private_torch.nonfinite_rows, fullgraph=True)
        found, empty_rows = compiled(x), compiled(torch.empty(2, 5, 0))
    finally:
        torch._dynamo.reset()
    assert torch.equal(found, expected)
    assert torch.equal(private_torch.nonfinite_rows(x), expected)  # eager's bool test
    assert torch.equal(empty_rows, torch.zeros(2, 5, dtype=torch.bool))


def test_is_exporting_answers_true_only_while_torch_export_traces() -> None:
    # Dynamo in PyTorch 2.7 to 2.10 answered torch.compiler.is_exporting() with True inside any
    # torch.compile; qkv's answer must be False there, and True under both kinds of export.
    # The answer is baked into what each mode returns: x + 1 while exporting, x + 2 otherwise.
    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + (1.0 if private_torch.is_exporting() else 2.0)

    x = torch.zeros(3)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(Probe(), backend="eager", fullgraph=True)(x)
        exported = torch.export.export(Probe(), (x,), strict=False).module()(x)
        strictly_exported = torch.export.export(Probe(), (x,), strict=True).module()(x)
    finally:
        torch._dynamo.reset()
    assert Probe()(x).tolist() == [2.0] * 3 and compiled.tolist() == [2.0] * 3
    # PyTorch 2.6 has no export flag: there an export answers False too (documented)
    while_exporting = 1.0 if hasattr(torch.compiler, "_is_exporting_flag") else 2.0
    assert exported.tolist() == [while_exporting] * 3 and strictly_exported.tolist() == [while_exporting] * 3
