"""oneDNN's fused bf16 linear (`qkv.native.onednn_linear`): results, the erf GELU, when it
runs, why it does not, and its check at first use.

Expected values come from float64 math on the bf16-rounded inputs; the rule is docs/design.md's
(error at most twice that of eager ``F.linear`` / ``F.gelu`` in bfloat16, plus a floor). A
spy counts the fused calls, so a test fails if the path silently stops running on a machine
that can run it; where it cannot, the same tests check the fallback and its reason.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.native import onednn_linear
from qkv.native.machine import cpu_features
from tests.kernels._spy import CallSpy

BF16 = torch.bfloat16
FLOOR = 1e-3


def _can_run() -> bool:
    return onednn_linear.unavailable_reason(torch.ones(1, 2, dtype=BF16), torch.ones(3, 2, dtype=BF16)) is None


def _spy(monkeypatch: pytest.MonkeyPatch) -> CallSpy:
    return CallSpy(monkeypatch, onednn_linear, "_fused")


@pytest.fixture(autouse=True)
def _switch_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the op and its reasons; QKV_NO_COMPILED_KERNELS (set by CI's
    kernels-off run) would come first and hide them. Its own effect is tested in test_reasons."""
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)


def _machine_reason() -> str | None:
    """Why this machine cannot run the op at all (no oneDNN, or no native bf16: oneDNN then has
    no bf16 inner product), or None: the reason that comes before any check of the op."""
    x, weight = torch.ones(1, 2, dtype=BF16), torch.ones(3, 2, dtype=BF16)
    if not cpu_features().native(BF16) or not torch.backends.mkldnn.is_available():
        reason = onednn_linear.unavailable_reason(x, weight)
        assert reason is not None and ("not native on this CPU" in reason or "without oneDNN" in reason)
        return reason
    return None


def _problem(shape: tuple[int, ...], N: int, bias: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    K = shape[-1]
    x = torch.randn(*shape, generator=gen).to(BF16)  # (..., K)
    weight = (torch.randn(N, K, generator=gen) / math.sqrt(max(K, 1))).to(BF16)  # (N, K)
    b = torch.randn(N, generator=gen).to(BF16) if bias else None  # (N,)
    return x, weight, b


def _exact(x, weight, bias):  # type: ignore[no-untyped-def]
    out = x.double() @ weight.double().T  # (..., N)
    return out if bias is None else out + bias.double()


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return 0.0 if want.numel() == 0 else (got.double() - want).abs().max().item()


# (input shape (..., K), N, bias)
CASES = {
    "encoder-qkv": ((2, 33, 384), 1152, True),
    "3d-awkward": ((3, 7, 40), 20, True),
    "one-row": ((1, 97), 59, True),
    "no-bias": ((5, 64), 17, False),
    "K1": ((6, 1), 9, True),
    "empty-rows": ((3, 0, 16), 8, True),
}


@pytest.mark.parametrize("case", CASES)
def test_linear_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, N, bias = CASES[case]
    x, weight, b = _problem(shape, N, bias)
    want = _exact(x, weight, b)
    spy = _spy(monkeypatch)
    out = onednn_linear.linear(x, weight, b)
    assert spy.calls == (1 if _can_run() else 0)
    assert out.dtype == BF16 and out.shape == (*shape[:-1], N)
    assert _err(out, want) <= 2 * _err(F.linear(x, weight, b), want) + FLOOR


@pytest.mark.parametrize("case", CASES)
def test_linear_gelu_by_the_tolerance_rule(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shape, N, bias = CASES[case]
    x, weight, b = _problem(shape, N, bias, seed=1)
    want = F.gelu(_exact(x, weight, b), approximate="none")
    spy = _spy(monkeypatch)
    out = onednn_linear.linear_gelu(x, weight, b)
    assert spy.calls == (1 if _can_run() else 0)
    assert out.dtype == BF16 and out.shape == (*shape[:-1], N)
    eager = F.gelu(F.linear(x, weight, b), approximate="none")
    assert _err(out, want) <= 2 * _err(eager, want) + FLOOR


def test_the_gelu_is_the_exact_erf_form() -> None:
    # an identity weight leaves the product exact; at x in [-3.5, -2.5] the tanh form is off
    # by 3-24 %, bf16 rounding of the erf form by well under 1 % (hand check: gelu(-3) =
    # -3 * Phi(-3) = -0.00405, tanh form -0.00364)
    x = torch.linspace(-3.5, -2.5, 4 * 32, dtype=torch.float64).reshape(4, 32).to(BF16)  # (4, K)
    out = onednn_linear.linear_gelu(x, torch.eye(32, dtype=BF16), torch.zeros(32, dtype=BF16))
    erf = 0.5 * x.double() * (1 + torch.erf(x.double() / math.sqrt(2)))
    assert ((out.double() - erf) / erf).abs().max().item() < 2**-6
    at_minus_3 = onednn_linear.linear_gelu(torch.full((1, 1), -3.0, dtype=BF16), torch.ones(1, 1, dtype=BF16))
    assert at_minus_3.item() == pytest.approx(-0.00405, rel=5e-3)


def test_row_padding_leaves_the_rows_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    # rows padded to a bucket (primitive reuse) give the same rows as the product on the rows
    # alone (each output row depends on its own input row only)
    x, weight, b = _problem((3, 43, 64), 40, True, seed=5)  # 129 rows: 127 padded rows at 128
    monkeypatch.setattr(onednn_linear, "ROW_BUCKET", 128)
    padded = onednn_linear.linear_gelu(x, weight, b)
    monkeypatch.setattr(onednn_linear, "ROW_BUCKET", 1)
    alone = onednn_linear.linear_gelu(x, weight, b)
    assert padded.shape == alone.shape == (3, 43, 40) and padded.is_contiguous()
    assert torch.equal(padded, alone)
    want = F.gelu(_exact(x, weight, b), approximate="none")
    assert _err(padded, want) <= 2 * _err(F.gelu(F.linear(x, weight, b)), want) + FLOOR


def test_no_input_features_take_f_linear() -> None:
    x, weight, b = torch.ones(4, 0, dtype=BF16), torch.ones(3, 0, dtype=BF16), torch.arange(3.0).to(BF16)
    assert onednn_linear.unavailable_reason(x, weight, b) == "there are no input features (K = 0: the output is the bias)"
    assert torch.equal(onednn_linear.linear(x, weight, b), b.expand(4, 3))


def test_the_live_weight_is_read_on_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # nothing is kept between calls: in-place and .data updates are seen
    layer = nn.Linear(40, 24).to(BF16)
    x = torch.randn(9, 40).to(BF16)
    spy = _spy(monkeypatch)
    with torch.no_grad():
        before = onednn_linear.run(layer, x)
        layer.weight.data.mul_(-2)
        layer.bias.data = torch.ones(24, dtype=BF16)
        after = onednn_linear.run(layer, x)
    assert spy.calls == (2 if _can_run() else 0)
    want = _exact(x, layer.weight, layer.bias)
    assert _err(after, want) <= 2 * _err(F.linear(x, layer.weight, layer.bias), want) + FLOOR
    assert _err(before, want) > 1.0  # the update really changed the answer


def test_gradients_keep_f_linear_and_its_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = nn.Linear(16, 8).to(BF16)
    x = torch.randn(5, 16).to(BF16)
    assert onednn_linear.unavailable_reason(x, layer.weight, layer.bias) == (
        "a gradient is needed (training keeps F.linear and its backward)"
    )
    spy = _spy(monkeypatch)
    (ours,) = torch.autograd.grad(onednn_linear.run_gelu(layer, x).float().sum(), [layer.weight])
    (eager,) = torch.autograd.grad(F.gelu(layer(x)).float().sum(), [layer.weight])
    assert spy.calls == 0 and torch.equal(ours, eager)
    with torch.no_grad():  # the same layer without a gradient takes the fused op
        onednn_linear.run(layer, x)
    assert spy.calls == (1 if _can_run() else 0)


def test_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight, b = _problem((4, 8), 6, True)
    reason = onednn_linear.unavailable_reason
    assert reason(x.float(), weight.float(), b.float()) == "it runs bfloat16 only (inputs are float32)"
    assert reason(x, weight.float(), b) == "it runs bfloat16 only (inputs are bfloat16, float32)"
    assert reason(x, weight[:, :5], b).startswith("the shapes are not (..., K), (N, K), (N,)")
    assert reason(x[0], weight, b).startswith("the shapes are not")  # a 1-D input
    if _machine_reason() is None:
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
        assert reason(x, weight, b) == "PyTorch's oneDNN is switched off (torch.backends.mkldnn.enabled is False)"
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    else:
        assert reason(x, weight, b) == _machine_reason()
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    assert reason(x, weight, b) == "QKV_NO_COMPILED_KERNELS is set"
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "0")
    spy = _spy(monkeypatch)
    with qkv.backends.disabled("onednn_linear"):
        assert reason(x, weight, b) == 'it is switched off (qkv.backends.disabled("onednn_linear"))'
        out = onednn_linear.linear(x, weight, b)  # the fallback: F.linear itself
    assert spy.calls == 0 and torch.equal(out, F.linear(x, weight, b))


def test_bad_shapes_raise_f_linears_error() -> None:
    x, weight, b = _problem((4, 8), 6, True)
    with pytest.raises(RuntimeError) as ours:
        onednn_linear.linear(x, weight[:, :5], b)
    with pytest.raises(RuntimeError) as theirs:
        F.linear(x, weight[:, :5], b)
    assert str(ours.value) == str(theirs.value)


def test_hooks_and_subclasses_are_called(monkeypatch: pytest.MonkeyPatch) -> None:
    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    x = torch.randn(3, 8).to(BF16)
    doubled = Doubled(8, 4).to(BF16)
    hooked = nn.Linear(8, 4).to(BF16)
    seen = []
    hooked.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    spy = _spy(monkeypatch)
    with torch.no_grad():
        assert torch.equal(onednn_linear.run(doubled, x), 2 * F.linear(x, doubled.weight, doubled.bias))
        onednn_linear.run_gelu(hooked, x)
    assert spy.calls == 0 and seen == [torch.Size([3, 4])]


def _broken(kind: str):  # type: ignore[no-untyped-def]
    """A stand-in for oneDNN's op that is wrong in one way."""
    real = onednn_linear._op()

    def op(x, weight, bias, attr, scalars, algorithm):  # type: ignore[no-untyped-def]
        if kind == "raises":
            raise RuntimeError("could not create a primitive descriptor")
        if kind == "tanh" and attr == "gelu":
            return real(x, weight, bias, attr, scalars, "tanh")
        if kind == "no-bias":
            return real(x, weight, None, attr, scalars, algorithm)
        return real(x, weight, bias, attr, scalars, algorithm)

    return op


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("raises", "oneDNN's linear raised at its check (RuntimeError: could not create a primitive descriptor)"),
        ("tanh", "oneDNN's GELU is not the exact erf GELU here"),
        ("no-bias", "oneDNN's linear is off by"),
    ],
)
def test_a_failing_check_is_a_reason_and_f_linear_runs(kind: str, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if _machine_reason() is not None:  # the op cannot run here: the machine's reason, and F.linear
        x, weight, b = _problem((4, 8), 6, True)
        assert onednn_linear.unavailable_reason(x, weight, b) == _machine_reason()
        assert torch.equal(onednn_linear.linear(x, weight, b), F.linear(x, weight, b))
        return
    op = _broken(kind)
    monkeypatch.setattr(onednn_linear, "_op", lambda: op)
    monkeypatch.setattr(onednn_linear, "_checked", {})
    x, weight, b = _problem((4, 8), 6, True)
    assert str(onednn_linear.unavailable_reason(x, weight, b)).startswith(reason)
    spy = _spy(monkeypatch)
    assert torch.equal(onednn_linear.linear(x, weight, b), F.linear(x, weight, b))
    assert spy.calls == 0


def test_a_missing_op_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing():  # type: ignore[no-untyped-def]
        raise AttributeError("'_OpNamespace' 'mkldnn' object has no attribute '_linear_pointwise'")

    monkeypatch.setattr(onednn_linear, "_op", missing)
    monkeypatch.setattr(onednn_linear, "_checked", {})
    x, weight, b = _problem((4, 8), 6, True)
    if _machine_reason() is None:
        assert onednn_linear.unavailable_reason(x, weight, b) == (
            "this PyTorch has no torch.ops.mkldnn._linear_pointwise (AttributeError)"
        )
    else:
        assert onednn_linear.unavailable_reason(x, weight, b) == _machine_reason()
    assert torch.equal(onednn_linear.linear_gelu(x, weight, b), F.gelu(F.linear(x, weight, b)))


def test_it_runs_where_onednn_is_available() -> None:
    # where PyTorch has oneDNN the op must pass its check: otherwise the tests above would
    # quietly test F.linear
    # quietly test F.linear; where bf16 is not native, oneDNN has no bf16 inner product at all
    x, weight, b = _problem((4, 8), 6, True)
    assert onednn_linear.unavailable_reason(x, weight, b) == _machine_reason()


def test_a_strided_bias_is_read_as_it_is() -> None:
    # oneDNN reads the bias buffer as contiguous: a strided (N,) view must be made contiguous
    x, weight, _ = _problem((4, 16), 8, False)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(5)).to(BF16)[::2]  # (N,), stride 2
    with torch.no_grad():
        got = onednn_linear.linear(x, weight, bias)
    want = _exact(x, weight, bias)
    assert _err(got, want) <= 2 * _err(F.linear(x, weight, bias), want) + FLOOR


def test_float16_autocast_keeps_f_linear_and_its_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # under CPU autocast to float16, F.linear computes and returns float16; the fused op would
    # return bfloat16. Under bf16 autocast the first call runs the one-time check, which must pass.
    monkeypatch.setattr(onednn_linear, "_checked", {})
    x, weight, b = _problem((4, 16), 8, True)
    spy = _spy(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert onednn_linear.unavailable_reason(x, weight, b) == "CPU autocast to float16 is on"
        got = onednn_linear.linear(x, weight, b)
        want = F.linear(x, weight, b)
    assert spy.calls == 0 and got.dtype == want.dtype == torch.float16 and torch.equal(got, want)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = onednn_linear.linear(x, weight, b)  # bf16 autocast: bf16 inputs stay bf16, the op runs
    if _can_run():
        assert spy.calls == 1 and fused.dtype == BF16
    # the outcome kept from the check under bf16 autocast is the one a plain check gives
    if _machine_reason() is None:
        assert onednn_linear.unavailable_reason(x, weight, b) == onednn_linear._check()
    else:
        assert onednn_linear.unavailable_reason(x, weight, b) == _machine_reason()
