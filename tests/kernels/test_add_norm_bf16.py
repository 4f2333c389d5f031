"""The residual add + LayerNorm kernel (`qkv.native.add_norm_bf16`): results against
float64 LayerNorm, the bf16 copy, NaN/inf rows, when it runs, why it does not, its fallback.

The rule: the float32 result within twice the error of eager ``norm(x + y)`` in float32
plus a floor, against ``F.layer_norm`` in float64 of the same (rounded) inputs; the bf16 copy
equal to the float32 result rounded. A spy counts the kernel's calls, so a test fails if the
path silently stops running on a machine that can run it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.native import add_norm_bf16, switches
from qkv.native import build as compiled
from tests.kernels._compiler import REASON as FAILED_BUILD
from tests.kernels._compiler import use_failing_compiler
from tests.kernels._spy import CallSpy

BF16 = torch.bfloat16
CPU = torch.device("cpu")
FLOOR = 1e-5


def _can_run() -> bool:
    return compiled.static_reason(BF16, CPU) is None and not switches.is_off("add_norm_bf16")


def _spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    return CallSpy(monkeypatch, add_norm_bf16, "_fused")


def _norm(D: int, seed: int = 0, eps: float = 1e-12) -> nn.LayerNorm:
    gen = torch.Generator().manual_seed(seed)
    norm = nn.LayerNorm(D, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=gen))
        norm.bias.copy_(torch.randn(D, generator=gen))
    return norm


def _want(x: torch.Tensor, y: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    D = x.shape[-1]
    return F.layer_norm(x.double() + y.double(), (D,), norm.weight.double(), norm.bias.double(), norm.eps)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return 0.0 if want.numel() == 0 else (got.double() - want).abs().max().item()


# (shape (..., D), offset of x): the encoder's width, masked tails, one column, no rows
CASES = {
    "encoder": ((2, 33, 384), 0.0),
    "tail-45-offset": ((37, 45), 50.0),
    "one-vector": ((3, 16), -3.0),
    "D1": ((5, 1), 0.0),
    "D1000": ((2, 1000), 1e3),
    "no-rows": ((0, 8), 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, offset = CASES[case]
    gen = torch.Generator().manual_seed(3)
    x = offset + torch.randn(*shape, generator=gen)  # (..., D) float32
    y = torch.randn(*shape, generator=gen).to(BF16)  # (..., D)
    norm = _norm(shape[-1])
    spy = _spy(monkeypatch)
    with torch.no_grad():
        out, low = add_norm_bf16.add_norm(x, y, norm, BF16)
        eager = norm(x + y)
    assert spy.calls == (1 if _can_run() else 0)
    assert out.dtype == torch.float32 and low.dtype == BF16 and out.shape == low.shape == shape
    want = _want(x, y, norm)
    assert _err(out, want) <= 2 * _err(eager, want) + FLOOR
    assert torch.equal(low, out.to(BF16))


def test_strided_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(6, 2, 40).transpose(0, 1)  # (2, 6, 40), not contiguous
    y = torch.randn(2, 80).to(BF16)[:, ::2]  # (2, 40), strided last dim
    norm = _norm(40)
    spy = _spy(monkeypatch)
    with torch.no_grad():
        out, _ = add_norm_bf16.add_norm(x, y[:, None, :].expand(2, 6, 40), norm, BF16)
    assert spy.calls == (1 if _can_run() else 0)
    want = _want(x, y[:, None, :].expand(2, 6, 40), norm)
    assert _err(out, want) <= 2e-5


def test_nan_and_inf_rows_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 24)
    y = torch.randn(4, 24).to(BF16)
    y[1, 5] = float("nan")
    x[2, 0] = float("inf")
    norm = _norm(24)
    with torch.no_grad():
        out, low = add_norm_bf16.add_norm(x, y, norm, BF16)
        eager = norm(x + y)
    assert torch.equal(out.isnan(), eager.isnan())  # the rows with NaN or inf are NaN, the others not
    assert torch.equal(low.isnan(), eager.isnan())
    finite = ~eager.isnan()
    assert (out[finite] - eager[finite]).abs().max().item() < 1e-4


def test_huge_rows_are_normalized_not_flattened_to_the_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    # |x - mean| ~ 1e20: the float32 squares overflow; float64 LayerNorm still gives the
    # normalized values (eager float32 gives NaN). The kernel must not return the bias alone.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, generator=gen) * 1e20
    x[1] = torch.randn(40, generator=gen) * 1e37  # the float32 row sum overflows too
    y = torch.randn(3, 40, generator=gen).to(BF16)
    norm = _norm(40)
    spy = _spy(monkeypatch)
    with torch.no_grad():
        out, low = add_norm_bf16.add_norm(x, y, norm, BF16)
    if not _can_run():  # the documented fallback: the eager ops, NaN where float32 overflows
        assert spy.calls == 0
        with torch.no_grad():
            eager = norm(x + y)
        torch.testing.assert_close(out, eager, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(low.isnan(), eager.isnan())
        return
    assert spy.calls == 1
    want = _want(x, y, norm)
    assert _err(out, want) < 1e-5 * want.abs().max().item()
    assert torch.equal(low, out.to(BF16))


def test_reasons_and_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, norm = torch.randn(3, 8), torch.randn(3, 8).to(BF16), _norm(8)
    reason = add_norm_bf16.unavailable_reason
    assert reason(x, y.float(), norm) == "y must be bfloat16 (it is float32)"
    assert reason(x.to(BF16), y, norm) == "x must be float32 (it is bfloat16)"
    assert reason(x, y, nn.LayerNorm(8, elementwise_affine=False)).startswith("the norm is not a plain nn.LayerNorm")
    assert reason(x, y, _norm(8).to(BF16)) == "the norm's weight and bias must be float32"
    assert reason(x, y[:, :4], norm) == "x and y must have one shape (..., D) and the norm normalize D"
    assert reason(x, y, norm) == "a gradient is needed (training keeps the eager ops and their backward)"
    watched = _norm(8)
    watched.register_forward_hook(lambda module, args, out: None)
    with torch.no_grad():
        assert reason(x, y, watched).startswith("the norm is not a plain nn.LayerNorm")
        monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
        assert reason(x, y, norm) == "QKV_NO_COMPILED_KERNELS is set"
        monkeypatch.delenv("QKV_NO_COMPILED_KERNELS")
        spy = _spy(monkeypatch)
        with qkv.backends.disabled("add_norm_bf16"):
            assert reason(x, y, norm) == 'it is switched off (qkv.backends.disabled("add_norm_bf16"))'
            out, low = add_norm_bf16.add_norm(x, y, norm, BF16)  # the eager ops
        assert spy.calls == 0
        assert torch.equal(out, norm(x + y)) and torch.equal(low, out.to(BF16))
        same, also = add_norm_bf16.add_norm(x, y.float(), norm, torch.float32)  # float32 throughout
        assert torch.equal(same, norm(x + y.float())) and also is same


def test_a_gradient_takes_the_eager_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 8, requires_grad=True)
    y, norm = torch.randn(3, 8).to(BF16), _norm(8)
    spy = _spy(monkeypatch)
    out, _ = add_norm_bf16.add_norm(x, y, norm, BF16)
    (grad,) = torch.autograd.grad((out * torch.arange(8.0)).sum(), [x])
    (want,) = torch.autograd.grad((norm(x + y) * torch.arange(8.0)).sum(), [x])
    assert spy.calls == 0 and torch.equal(grad, want)


def test_a_failed_build_is_a_reason_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_failing_compiler(monkeypatch, tmp_path)
    monkeypatch.setattr(add_norm_bf16, "_built", {})
    monkeypatch.setattr(compiled, "static_reason", lambda *args, **kwargs: None)  # as on a machine that could run it
    x, y, norm = torch.randn(3, 8), torch.randn(3, 8).to(BF16), _norm(8)
    with torch.no_grad():
        out, low = add_norm_bf16.add_norm(x, y, norm, BF16)
        assert torch.equal(out, norm(x + y)) and torch.equal(low, out.to(BF16))
        assert add_norm_bf16.unavailable_reason(x, y, norm) == FAILED_BUILD


def test_a_wrong_kernel_fails_its_self_check() -> None:
    def wrong(x, y, weight, bias, eps):  # type: ignore[no-untyped-def]  # a kernel that forgets the bias
        out = F.layer_norm(x + y, x.shape[-1:], weight, None, eps)
        return out, out.bfloat16()

    assert str(add_norm_bf16._self_check(wrong)).startswith("its self-check failed (LayerNorm error")


def test_the_kernel_builds_where_nothing_is_missing() -> None:
    # on a machine with AVX-512, AMX and a compiler the kernel must build and pass its
    # self-check: otherwise every test above would quietly test the eager ops
    x, y, norm = torch.randn(3, 8), torch.randn(3, 8).to(BF16), _norm(8)
    with torch.no_grad():
        static = compiled.static_reason(BF16, CPU)
        if static is not None:
            assert add_norm_bf16.unavailable_reason(x, y, norm) == static
            return
        assert add_norm_bf16._fused(x, y, norm) is not None
        assert add_norm_bf16.unavailable_reason(x, y, norm) is None
