"""Every compiled kernel of qkv is a PyTorch operator under the namespace ``qkv``
(`torch.library.custom_op`): registered at import whether or not it can run here, with a fake
implementation that gives its outputs' shapes, dtypes and strides without running it, and for
the interval pair an autograd formula (the forward operator's backward is the backward
operator). Expected values come from hand-written shapes and float64 autograd."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from qkv.native import build as compiled
from qkv.native import decode as native_decode
from qkv.native import (
    interval_bf16,
    interval_bf16_backward,
    inventory,
    magnitude,
    short_bf16,
    short_wide,
)

BF16 = torch.bfloat16
CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _window(L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi (1, L): a sliding window over S keys with one row that sees nothing."""
    rows = torch.arange(L)
    lo, hi = (rows - 20).clamp(min=0).view(1, L), (rows + 30).clamp(max=S - 1).view(1, L)
    hi[0, 3] = -1
    return lo, hi


def _interval_args(seed: int = 0) -> tuple:  # type: ignore[type-arg]
    g = _gen(seed)
    q, k = (torch.randn(1, 2, T, 64, generator=g).to(BF16) for T in (70, 150))
    v = torch.randn(1, 2, 150, 40, generator=g).to(BF16)
    return (q, k, v, *_window(70, 150), 0.125, False)


def _backward_args(seed: int = 1) -> tuple:  # type: ignore[type-arg]
    g = _gen(seed)
    q, k = (torch.randn(1, 2, T, 64, generator=g).to(BF16) for T in (70, 150))
    v = torch.randn(1, 2, 150, 32, generator=g).to(BF16)
    grad_out = torch.randn(1, 2, 70, 32, generator=g).to(BF16)
    out, lse = torch.randn(1, 2, 70, 32, generator=g), torch.randn(1, 2, 70, generator=g)
    return (grad_out, q, k, v, out, lse, torch.randn(1, 2, 70, generator=g), *_window(70, 150), 0.125)


def _short_args(seed: int = 2) -> tuple:  # type: ignore[type-arg]
    g = _gen(seed)
    q = torch.randn(2, 7, 4, 33, generator=g).to(BF16).transpose(1, 2)  # (N, H, L, E), strided
    k = torch.randn(2, 2, 37, 33, generator=g).to(BF16)
    v = torch.randn(2, 2, 37, 20, generator=g).to(BF16)
    return (q, k, v, torch.rand(2, 37, generator=g) < 0.7, 0.2)


def _short_wide_args(seed: int = 2) -> tuple:  # type: ignore[type-arg]
    return (*_short_args(seed), "")  # the machine's build


def _add_norm_args(seed: int = 3) -> tuple:  # type: ignore[type-arg]
    g = _gen(seed)
    x, y = torch.randn(3, 5, 45, generator=g), torch.randn(3, 5, 45, generator=g).to(BF16)
    return (x, y, torch.randn(45, generator=g), torch.randn(45, generator=g), 1e-5)


def _magnitude_args(seed: int = 4) -> tuple:  # type: ignore[type-arg]
    g = _gen(seed)
    return ([torch.randn(3, 50, 45, generator=g).to(BF16).transpose(0, 1), torch.randn(1000, generator=g)], "")


def _decode_args(seed: int = 5) -> tuple:  # type: ignore[type-arg]
    g = _gen(seed)
    q = torch.randn(2, 6, 3, 40, generator=g).to(BF16)  # (N, H, L, E)
    k = torch.randn(2, 2, 300, 40, generator=g).to(BF16)  # (N, G, S, E)
    v = torch.randn(2, 2, 300, 24, generator=g).to(BF16)  # (N, G, S, Ev)
    lo, hi = torch.tensor([[0, 10, 20]]), torch.tensor([[280, 290, 299]])  # (1, L)
    return (q, k, v, 0.15, 0, 300, 2, lo, hi, torch.rand(2, 300, generator=g) < 0.8, torch.zeros(1, 6), "")


# stem -> (operator name, example arguments, the shapes and dtypes its outputs must have)
CASES: dict[str, tuple[str, Callable[[], tuple], list[tuple[tuple[int, ...], torch.dtype]]]] = {  # type: ignore[type-arg]
    "interval_bf16": ("interval_bf16_forward", _interval_args, [((1, 2, 70, 40), torch.float32), ((1, 2, 70), torch.float32)]),
    "interval_bf16_backward": (
        "interval_bf16_backward", _backward_args, [((1, 2, 70, 64), BF16), ((1, 2, 150, 64), BF16), ((1, 2, 150, 32), BF16)],
    ),
    "short_bf16": ("short_bf16", _short_args, [((2, 4, 7, 20), BF16)]),
    "short_wide": ("short_wide", _short_wide_args, [((2, 4, 7, 20), BF16)]),
    "add_norm_bf16": ("add_norm_bf16", _add_norm_args, [((3, 5, 45), torch.float32), ((3, 5, 45), BF16)]),
    "magnitude": ("magnitude", _magnitude_args, [((2,), torch.int32)]),
    "decode": ("decode", _decode_args, [((2, 6, 3, 24), torch.float32), ((2, 6, 3), torch.float32)]),
}


def _static_reason(stem: str) -> str | None:
    """Why this kernel cannot run on this machine, from facts that need no build."""
    if stem == "decode":  # float32 and bf16, from AVX2 up
        return compiled.tier_reason(native_decode.TIERS, BF16, CPU, native_decode.DTYPES)
    if stem == "magnitude":  # float32, bf16 and fp16, from AVX2 up
        return compiled.tier_reason(magnitude.TIERS, BF16, CPU, magnitude.DTYPES)
    if stem == "short_wide":  # bf16, from AVX2 up
        return compiled.tier_reason(short_wide.TIERS, BF16, CPU, short_wide.DTYPES)
    if stem in ("interval_bf16", "interval_bf16_backward"):  # bf16, amx or avx512 with AVX-512 BF16
        return compiled.interval_reason(BF16, CPU)
    return compiled.static_reason(BF16, CPU)


def _outputs(result: object) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple | list) else [result]  # type: ignore[list-item]


def test_every_kernel_is_an_operator_of_the_qkv_namespace() -> None:
    # the decode kernel is built per tier (stems decode_<tier>), one operator for all; the
    # inventory (`qkv doctor`) lists the kernels built for one tier
    assert native_decode._TIERED.kernel("avx2").stem == "decode_avx2"
    assert magnitude._TIERED.kernel("avx2").stem == "magnitude_avx2"
    assert short_wide._TIERED.kernel("avx512").stem == "short_wide_avx512"
    tiered = {"decode", "magnitude", "short_wide"}
    assert {t.stem for t in inventory._TIERED} == tiered
    assert set(inventory.OPERATORS) == {m.__name__.rsplit(".", 1)[1] for m in inventory._MODULES} == set(CASES) - tiered
    for stem, name in [*inventory.OPERATORS.items(), *((t, t) for t in sorted(tiered))]:
        assert CASES[stem][0] == name
        assert getattr(torch.ops.qkv, name).default._schema.name == f"qkv::{name}"


@pytest.mark.parametrize("stem", sorted(CASES))
def test_the_fake_implementation_gives_the_output_shapes(stem: str) -> None:
    name, make, want = CASES[stem]
    args = make()
    with FakeTensorMode() as mode:
        fake_args = [
            [mode.from_tensor(t) for t in a] if isinstance(a, list) else mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
            for a in args
        ]  # fmt: skip
        result = _outputs(getattr(torch.ops.qkv, name)(*fake_args))
    assert [(tuple(t.shape), t.dtype) for t in result] == want


def test_the_short_kernels_fake_output_has_the_heads_side_by_side() -> None:
    """Its output (N, H, L, Ev) is a view of a (N, L, H, Ev) tensor, fake or real."""
    with FakeTensorMode() as mode:
        q, k, v, valid, scale = _short_args()
        out = torch.ops.qkv.short_bf16(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), mode.from_tensor(valid), scale)
    assert out.stride() == (7 * 4 * 20, 20, 4 * 20, 1)


def test_bad_arguments_are_refused_before_any_work() -> None:
    q, k, v, lo, hi, scale, rounded = _interval_args()
    k1, q33, k33 = k[:, :1], q[..., :33], k[..., :33]
    with FakeTensorMode() as mode:
        fq, fk, fv, flo, fhi = (mode.from_tensor(t) for t in (q, k1, v, lo, hi))
        with pytest.raises(ValueError, match="shapes do not match"):
            torch.ops.qkv.interval_bf16_forward(fq, fk, fv, flo, fhi, scale, rounded)
    with FakeTensorMode() as mode:
        fq, fk, fv, flo, fhi = (mode.from_tensor(t) for t in (q33, k33, v, lo, hi))
        with pytest.raises(ValueError, match="E must be a positive multiple of 32"):
            torch.ops.qkv.interval_bf16_forward(fq, fk, fv, flo, fhi, scale, rounded)
    q, k, v, valid, scale = _short_args()
    few = valid[:, :5]
    with FakeTensorMode() as mode:
        fq, fk, fv, few = (mode.from_tensor(t) for t in (q, k, v, few))
        with pytest.raises(ValueError, match="key_valid must be bool"):
            torch.ops.qkv.short_bf16(fq, fk, fv, few, scale)


# AOT autograd's own fake-tensor conversion reads .grad of the non-leaf copies it makes
# (torch/_subclasses/meta_utils.py safe_grad, which hides the warning from everyone but an
# "error" filter like this project's): torch's internals, not the operator under test
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("stem", sorted(CASES))
def test_opcheck(stem: str) -> None:
    """torch.library.opcheck: schema, fake implementation against the real one, autograd
    registration, AOT dispatch. Where the kernel cannot run here the operator says why."""
    name, make, _ = CASES[stem]
    args = make()
    op = getattr(torch.ops.qkv, name)
    reason = _static_reason(stem)
    if reason is not None:
        with pytest.raises(RuntimeError, match="cannot run here"):
            op(*args)
        return
    if stem == "interval_bf16":  # with inputs that need a gradient: the autograd formula is checked too
        args = (*(t.requires_grad_(True) for t in args[:3]), *args[3:])
    torch.library.opcheck(op, args)


def test_gradients_flow_through_the_interval_operators() -> None:
    """The forward operator's autograd runs the backward operator: dq, dk, dv of a loss on
    the output and lse, against float64 autograd of the same masked attention."""
    if _static_reason("interval_bf16") is not None:
        assert interval_bf16.unavailable_reason(BF16, CPU) is not None
        return
    q, k, v, lo, hi, scale, _ = _interval_args(seed=5)
    v = torch.randn(1, 2, 150, 64, generator=_gen(6)).to(BF16)
    g = _gen(7)
    d_out, d_lse = torch.randn(1, 2, 70, 64, generator=g), torch.randn(1, 2, 70, generator=g)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = torch.ops.qkv.interval_bf16_forward(*leaves, lo, hi, scale, False)
    finite = torch.isfinite(lse.detach())
    loss = (out * d_out).sum() + (lse[finite] * d_lse[finite]).sum()
    got = torch.autograd.grad(loss, leaves)
    keys = torch.arange(150).view(1, 150)
    visible = (keys >= lo.view(70, 1)) & (keys <= hi.view(70, 1))  # (L, S)
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))  # (N, H, L, S)
    lse64 = torch.logsumexp(s, dim=-1)  # (N, H, L)
    out64 = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v64  # (N, H, L, Ev)
    loss64 = (out64 * d_out.double()).sum() + (lse64[finite] * d_lse.double()[finite]).sum()
    want = torch.autograd.grad(loss64, (q64, k64, v64))
    for a, b in zip(got, want, strict=True):  # bf16 gradients of float32 sums: a few bf16 ulps
        assert a.dtype == BF16 and a.shape == b.shape
        assert float((a.double() - b).abs().max()) < 2e-2 * float(b.abs().max())
    assert bool((got[0][:, :, 3] == 0).all())  # the row that sees no key has no gradient
    # the same kernels as the engine's own backward, to the bit
    direct = interval_bf16_backward.backward(d_out, q, k, v, out.detach(), lse.detach(), lo, hi, scale, d_lse)
    assert direct is not None and all(torch.equal(a, b) for a, b in zip(got, direct, strict=True))


def test_a_rounded_forward_has_no_gradient() -> None:
    if _static_reason("interval_bf16") is not None:
        return  # the operator does not run here (test_opcheck checks that it says why)
    q, k, v, lo, hi, scale, _ = _interval_args()
    q = q.clone().requires_grad_(True)
    out, _ = torch.ops.qkv.interval_bf16_forward(q, k, v, lo, hi, scale, True)
    assert out.dtype == BF16
    with pytest.raises(RuntimeError, match="rounded=True keeps no float32 output"):
        out.float().sum().backward()


def test_the_operators_exist_where_the_kernels_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registration needs no compiler and no AMX: with the compiled kernels switched off the
    operators are still there, and calling one says why it cannot run."""
    monkeypatch.setenv("QKV_NO_COMPILED_KERNELS", "1")
    q, k, v, valid, scale = _short_args()
    with pytest.raises(RuntimeError, match="QKV_NO_COMPILED_KERNELS is set"):
        torch.ops.qkv.short_bf16(q, k, v, valid, scale)
    assert short_bf16.forward(q, k, v, valid, scale) is None  # the caller's path: None, then SDPA


def test_a_dispatch_mode_sees_the_operator_and_the_same_result() -> None:
    """Eager calls run the kernel directly (`compiled.direct_call`); under a dispatch mode (a
    tracer, FlopCounterMode) the wrappers call the operator, which the mode sees; both give
    the same bits."""
    q, k, v, valid, scale = _short_args()
    if _static_reason("short_bf16") is not None:
        assert short_bf16.forward(q, k, v, valid, scale) is None
        return

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    direct = short_bf16.forward(q, k, v, valid, scale)
    with Seen() as mode:
        seen = short_bf16.forward(q, k, v, valid, scale)
    assert "qkv.short_bf16.default" in mode.ops
    assert direct is not None and seen is not None
    assert torch.equal(direct.view(torch.int16), seen.view(torch.int16)) and direct.stride() == seen.stride()
