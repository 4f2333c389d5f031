"""Residual add + LayerNorm + cast in one pass, for a float32 residual stream whose sublayers
run in bfloat16 (the mixed precision of `qkv.models.BertEncoder.set_matmul_dtype`).

Each sublayer of a post-LN block ends with ``x = norm(x + y)`` (x float32, y the sublayer's
bfloat16 output), and the next product needs ``x`` in bfloat16. Eager PyTorch runs that as
four passes over (rows, D): y widened to float32 (the mixed-dtype add copies it), the sum,
the LayerNorm, the cast; at an encoder batch (1,984 rows, D = 384, 1 thread) 1.6 ms per
sublayer. The compiled kernel (``add_norm_bf16.cpp``) reads x and y once per row and writes
both results: ``out`` float32 (the residual stream, LayerNorm statistics in float32 as
PyTorch's) and ``low = out`` rounded to bfloat16.

`add_norm` runs it when `unavailable_reason` is None: x float32 and y bfloat16 on the CPU,
a plain ``nn.LayerNorm`` over the last dim with float32 weight and bias, no gradient needed,
the compiled kernels allowed here (`qkv.native.build.static_reason`) and built and
self-checked against float64 math (once per process, seconds the first time). Otherwise it
runs ``norm(x + y)`` and the cast: same signature, same result to float32 rounding. The
kernel is the PyTorch operator ``torch.ops.qkv.add_norm_bf16`` (with a fake implementation
for tracing; no gradient: training keeps the eager ops).

Shape legend: R rows (any leading dims), D the normalized width.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn

from qkv.native import build as compiled
from qkv.native import onednn_linear, switches

__all__ = ["KERNEL_NAME", "add_norm", "unavailable_reason"]

# qkv.backends.disabled("add_norm_bf16") switches it off (benchmarks time the eager ops so);
# QKV_NO_COMPILED_KERNELS=1 too.

KERNEL_NAME = "residual add + LayerNorm kernel"
# the kernel's source and build (`qkv.native.build`): no torch header, no torch library
NATIVE = compiled.NativeKernel("add_norm_bf16", Path(__file__).with_name("add_norm_bf16.cpp"), KERNEL_NAME)

# the outcome of the one build attempt of this process: the loaded library, or why there is none
_built: dict = {}


def native() -> compiled.NativeKernel:
    """The kernel's build (one, for the ``amx`` tier)."""
    return NATIVE


def build_state() -> dict:
    """This process's build attempt (`qkv.native.build.built_once`'s cache)."""
    return _built


def unavailable_reason(x: torch.Tensor, y: torch.Tensor, norm: nn.Module) -> str | None:
    """Why `add_norm` runs the eager ops for these arguments, or None when it runs the kernel
    (possibly after building it on first use). Never builds.

    >>> unavailable_reason(torch.ones(2, 4), torch.ones(2, 4), torch.nn.LayerNorm(4))
    'y must be bfloat16 (it is float32)'
    """
    if switches.is_off("add_norm_bf16"):
        return switches.off_reason("add_norm_bf16")
    if type(norm) is not nn.LayerNorm or norm.weight is None or norm.bias is None or onednn_linear.hooked(norm):
        return "the norm is not a plain nn.LayerNorm with weight and bias (or a hook watches it)"
    if x.dtype != torch.float32:
        return f"x must be float32 (it is {str(x.dtype).removeprefix('torch.')})"
    if y.dtype != torch.bfloat16:
        return f"y must be bfloat16 (it is {str(y.dtype).removeprefix('torch.')})"
    if norm.weight.dtype != torch.float32 or norm.bias.dtype != torch.float32:
        return "the norm's weight and bias must be float32"
    if x.shape != y.shape or x.ndim == 0 or tuple(norm.normalized_shape) != (x.shape[-1],):
        return "x and y must have one shape (..., D) and the norm normalize D"
    tensors = (x, y, norm.weight, norm.bias)
    if any(t.device.type != "cpu" for t in tensors):
        return "it runs on CPU only"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "a gradient is needed (training keeps the eager ops and their backward)"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing (Inductor fuses these itself)"
    return compiled.static_reason(torch.bfloat16, x.device) or compiled.build_failure(_built)


def add_norm(x: torch.Tensor, y: torch.Tensor, norm: nn.Module, low_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``out = norm(x + y)`` and ``out.to(low_dtype)``: x (..., D), y (..., D) -> two (..., D).

    Fused by the compiled kernel when `unavailable_reason` is None and ``low_dtype`` is
    bfloat16; the residual stream ``out`` keeps x's dtype (float32 + bfloat16 promotes).
    """
    fused = _fused(x, y, norm) if low_dtype == torch.bfloat16 else None
    if fused is not None:
        return fused
    out = norm(x + y)  # (..., D)
    return out, out.to(low_dtype)


def _fused(x: torch.Tensor, y: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's (out, low), or None when it is unavailable (`unavailable_reason`) or its
    build failed on first use."""
    if unavailable_reason(x, y, norm) is not None:
        return None
    assert isinstance(norm, nn.LayerNorm)  # unavailable_reason accepts a plain nn.LayerNorm only
    library = compiled.built_once(_built, _build)
    if isinstance(library, str):
        return None
    weight, bias = norm.weight.detach(), norm.bias.detach()
    if compiled.direct_call(x, y, weight, bias):
        return _run(library, x, y, weight, bias, float(norm.eps))
    return torch.ops.qkv.add_norm_bf16(x, y, weight, bias, float(norm.eps))


def _build() -> ctypes.CDLL | str:
    return compiled.build(NATIVE, _check)


def _check(library: ctypes.CDLL) -> str | None:
    return _self_check(functools.partial(_run, library))


@functools.cache
def _entry(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's entry point with its C signature (add_norm_bf16.cpp)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return compiled.function(library, "qkv_add_norm_bf16", ctypes.c_int, p, p, p, p, i64, i64, ctypes.c_double, p, p, i64)


def _argument_problem(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> str | None:
    """What is wrong with the operator's arguments, or None."""
    if x.dtype != torch.float32 or y.dtype != torch.bfloat16:
        return f"x must be float32 and y bfloat16 (they are {x.dtype} and {y.dtype})"
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        return "weight and bias must be float32"
    if x.shape != y.shape or x.dim() == 0:
        return f"x and y must have one shape (..., D), not {tuple(x.shape)} and {tuple(y.shape)}"
    if tuple(weight.shape) != (x.shape[-1],) or tuple(bias.shape) != (x.shape[-1],):
        return f"weight and bias must be ({x.shape[-1]},)"
    if any(t.device.type != "cpu" for t in (x, y, weight, bias)):
        return "every tensor must be on the CPU"
    return None


def _run(
    library: ctypes.CDLL, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on checked arguments: out (..., D) float32 and low (..., D) bfloat16."""
    problem = _argument_problem(x, y, weight, bias)
    if problem is not None:
        raise ValueError(f"qkv::add_norm_bf16: {problem}")
    x, y, weight, bias = (t.contiguous() for t in (x, y, weight, bias))
    out = torch.empty(x.shape, dtype=torch.float32)  # (..., D)
    low = torch.empty(x.shape, dtype=torch.bfloat16)  # (..., D)
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    status = _entry(library)(
        x.data_ptr(), y.data_ptr(), weight.data_ptr(), bias.data_ptr(), rows, D, float(eps), out.data_ptr(),
        low.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"the {KERNEL_NAME} could not allocate its row buffers")
    return out, low


# the schema is written out: torch 2.5 infers none from `list[...]` or `X | None` annotations
@torch.library.custom_op("qkv::add_norm_bf16", mutates_args=(), schema="(Tensor x, Tensor y, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor)")
def _add_norm_op(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out = layer_norm(x + y, weight, bias, eps)`` float32 and ``low = out`` rounded to
    bfloat16, x (..., D) float32, y (..., D) bfloat16. Builds the kernel on first use; raises
    RuntimeError when it cannot run here."""
    reason = compiled.static_reason(torch.bfloat16, x.device)
    library = compiled.loaded_or_raise(reason or compiled.built_once(_built, _build), KERNEL_NAME)
    return _run(library, x, y, weight, bias, eps)


@_add_norm_op.register_fake
def _(x, y, weight, bias, eps):  # type: ignore[no-untyped-def]
    problem = _argument_problem(x, y, weight, bias)
    if problem is not None:
        raise ValueError(f"qkv::add_norm_bf16: {problem}")
    return x.new_empty(x.shape, dtype=torch.float32), x.new_empty(x.shape, dtype=torch.bfloat16)


def _self_check(run) -> str | None:  # type: ignore[no-untyped-def]
    """Run the kernel (``run``: `_run` on the loaded library) once on an awkward problem
    against float64 math: None, or what went wrong. Rows of 45 values (two vectors and a
    masked tail of 13), a large common offset (the variance is taken about the mean), a row
    of one repeated value (variance 0)."""
    gen = torch.Generator().manual_seed(0)
    R, D = 37, 45
    x = 50.0 + torch.randn(R, D, generator=gen)  # (R, D)
    x[3] = 2.5  # with y below: one value repeated, variance 0
    y = torch.randn(R, D, generator=gen).bfloat16()  # (R, D)
    y[3] = 1.0
    weight, bias = torch.randn(D, generator=gen), torch.randn(D, generator=gen)  # (D,)
    eps = 1e-12
    out, low = run(x, y, weight, bias, eps)
    s = x.double() + y.double()  # (R, D)
    want = torch.nn.functional.layer_norm(s, (D,), weight.double(), bias.double(), eps)  # (R, D)
    eager = torch.nn.functional.layer_norm(x + y, (D,), weight, bias, eps)  # (R, D) float32
    error = (out.double() - want).abs().max().item()
    if not error <= 2 * (eager.double() - want).abs().max().item() + 1e-5:  # also catches a NaN left
        return f"its self-check failed (LayerNorm error {error:.3g} against float64)"
    if not torch.equal(low, out.bfloat16()):
        return "its self-check failed (the bfloat16 copy is not the float32 result rounded)"
    return None
