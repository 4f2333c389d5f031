"""bfloat16 linear layers for CPU inference through oneDNN's fused linear primitive.

``F.linear(x, W, b)`` in bfloat16 on the CPU runs ``addmm``: it first copies the bias,
broadcast to (rows, N), into the output, then runs a product that adds into it (beta = 1).
At the encoder's sizes that copy costs 10-25 % of the product (one thread, 960 rows: K, N =
384, 1152: 910 vs 738 us without a bias). oneDNN's linear primitive, which PyTorch exposes as
``torch.ops.mkldnn._linear_pointwise`` (the op Inductor uses when it freezes a model), adds
the bias in the product's epilogue, and can apply an activation there too: the exact (erf)
GELU of BERT's feed-forward, computed on the float32 accumulator before the one rounding to
bfloat16 (eager rounds the product first, then rounds the GELU again).

The weight is passed as it is (no prepacked copy is kept): every call reads the module's
live weight, so in-place updates, ``.data`` assignments and ``load_state_dict`` are seen.

`linear` and `linear_gelu` take it when `unavailable_reason` is None: bfloat16 input, weight
and bias on the CPU, no gradient needed (the op's backward is not used: training keeps
``F.linear``), oneDNN available and switched on, not under ``torch.compile`` (Inductor fuses
on its own), ``QKV_NO_COMPILED_KERNELS`` unset, and the op passed its check against float64
math once in this process (`_check`). Otherwise they run ``F.linear`` (and ``F.gelu``), same
signature, same result to bfloat16 rounding.

Shape legend: R rows (any leading dims), K input features, N output features.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Callable
from typing import TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import nn

from qkv._private import torch as private_torch
from qkv.native import switches
from qkv.native.machine import compute_dtype, cpu_features

__all__ = [
    "forget_wide_copies",
    "hooked",
    "linear",
    "linear_gelu",
    "run",
    "run_gelu",
    "run_wide",
    "run_wide_is_plain",
    "unavailable_reason",
    "wide_copy",
]

# qkv.backends.disabled("onednn_linear") switches it off (benchmarks time F.linear so);
# QKV_NO_COMPILED_KERNELS=1 too.

# oneDNN creates (JIT-compiles) a primitive for every new row count, ~3 ms for a plain
# linear and ~10 ms with the GELU at the encoder's sizes (1 thread), 50 % more when the count
# is not a multiple of 32: as much as the product itself when every batch has its own length.
# Rows are padded to a multiple of this, so that batches of nearby lengths share primitives
# (whole bf16 encode, 1,024 sentences, 1 thread, interleaved, load 0.8: CPU time 8.23 s
# unpadded, 7.52 s at 256, 7.19 s at 128; packed 7.42 -> 6.82 s at 256); the padded rows are
# zeros and their outputs are dropped (rows are independent: the kept rows are unchanged).
ROW_BUCKET = 128

# the outcome of the one check of this process: None (passed) or why the op cannot be used
_checked: dict[str, str | None] = {}
_CHECK_LOCK = threading.Lock()
# what a module's weight and its input are without a subclass that may define its own linear
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def unavailable_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why `linear` / `linear_gelu` run ``F.linear`` for these tensors, or None when they run
    oneDNN's fused primitive. Runs the one-time check on first use.

    >>> unavailable_reason(torch.ones(2, 3), torch.ones(4, 3)) is not None  # float32: F.linear on any machine
    True
    """
    reason = _static_reason(x, weight, bias)
    if reason is not None:
        return reason
    if "outcome" not in _checked:
        with _CHECK_LOCK:
            if "outcome" not in _checked:
                # reached only without autocast or under bf16 autocast (`_static_reason`), which
                # leaves the check's bf16 and float64 tensors as they are
                _checked["outcome"] = _check()
    return _checked["outcome"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x (..., K), weight (N, K), bias (N,) -> (..., N), with the
    bias added in the product's epilogue when `unavailable_reason` is None."""
    if unavailable_reason(x, weight, bias) is not None:
        return _widened_linear(x, weight, bias)
    return _fused(x, weight, bias, "none")  # (..., N)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(F.linear(x, weight, bias))`` with the exact erf GELU: x (..., K), weight (N, K),
    bias (N,) -> (..., N). Fused: the GELU is applied to the float32 accumulator, rounded once."""
    if unavailable_reason(x, weight, bias) is not None:
        wide = _widened_linear(x, weight, bias, keep_wide=True)  # (..., N)
        return F.gelu(wide, approximate="none").to(_result_dtype(x, weight, bias))
    return _fused(x, weight, bias, "gelu")  # (..., N)


def _result_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    return torch.result_type(x, weight) if bias is None else torch.promote_types(torch.result_type(x, weight), bias.dtype)


def _widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, keep_wide: bool = False
) -> torch.Tensor:
    """``F.linear``, computed in float32 when its tensors share a low-precision dtype whose
    products this CPU only emulates (`qkv.native.machine.compute_dtype`): there PyTorch's own
    bf16 product runs tens of times slower than float32. The weight and bias come from
    `wide_copy` (converted once, not on every call). The result is rounded back to that
    dtype once (``keep_wide``: returned in float32, for an activation that follows)."""
    dtype = x.dtype
    same = weight.dtype == dtype and (bias is None or bias.dtype == dtype)
    wide = compute_dtype(dtype, x.device)
    if not same or wide == dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    out = F.linear(x.to(wide), wide_copy(wide, weight), None if bias is None else wide_copy(wide, bias))  # (..., N)
    return out if keep_wide else out.to(dtype)


# float32 copies of low-precision weights (`wide_copy`): (first source's id, count) ->
# (a weak reference to that source, the sources' stamps, the copy)
_WIDE: dict[tuple[int, int], tuple[weakref.ref[torch.Tensor], tuple[object, ...], torch.Tensor]] = {}
_WIDE_LOCK = threading.Lock()


def _stamp(t: torch.Tensor) -> tuple[object, ...]:
    """What changes when a tensor's values may have: an in-place update (optimizer step,
    ``copy_``, ``load_state_dict``) bumps ``_version``; ``p.data = other`` moves ``data_ptr``."""
    return t.data_ptr(), t._version, t.dtype, tuple(t.shape), t.stride(), t.device


def _forgetter(key: tuple[int, int]) -> Callable[[object], None]:
    """The weakref callback that drops a copy when its first source tensor is collected."""

    def forget(_: object) -> None:
        _WIDE.pop(key, None)

    return forget


def wide_copy(dtype: torch.dtype, *sources: torch.Tensor) -> torch.Tensor:
    """``torch.cat(sources).to(dtype)`` (one source: ``source.to(dtype)``), kept from call to
    call while no source changes: for the weights of a low-precision layer on a CPU that only
    emulates its products, which then computes in float32 (`compute_dtype`).

    Converting a layer's weights on every call costs as much as a small batch's product (one
    sentence through the encoder's feed-forward: a weight of 590k values for a product of 10
    rows). The copy costs memory: twice the bfloat16 weights (4 bytes a value beside their 2),
    released with the parameters. It is rebuilt when a source's version counter or storage
    changes: an optimizer step, ``copy_``, ``load_state_dict``, ``p.data = ...``. An in-place
    write through ``p.data`` (``p.data.mul_(m)``) bypasses the version counter and is not seen:
    call `forget_wide_copies` after such updates. While a gradient is needed nothing is kept:
    the conversion must be part of the autograd graph.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in sources)
    if needs_grad or torch.compiler.is_compiling():
        return (sources[0] if len(sources) == 1 else torch.cat(sources)).to(dtype)
    key = (id(sources[0]), len(sources))
    stamps = (*(_stamp(t) for t in sources), dtype)
    entry = _WIDE.get(key)
    if entry is not None and entry[0]() is sources[0] and entry[1] == stamps:
        return entry[2]
    # a plain tensor even under inference_mode: a later call that records a graph (x requiring
    # grad, frozen weights) may save it for backward, which an inference tensor refuses
    with torch.inference_mode(False), torch.no_grad():
        copy = (sources[0] if len(sources) == 1 else torch.cat(sources)).to(dtype)
    with _WIDE_LOCK:
        _WIDE[key] = (weakref.ref(sources[0], _forgetter(key)), stamps, copy)
    return copy


def forget_wide_copies() -> None:
    """Drop every float32 copy `wide_copy` keeps (they are rebuilt on the next call)."""
    with _WIDE_LOCK:
        _WIDE.clear()


def _fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """oneDNN's linear with ``activation`` ("none" or "gelu") in its epilogue, on x's rows
    padded to a multiple of `ROW_BUCKET` (zero rows; the output's first rows returned)."""
    rows = math.prod(x.shape[:-1])
    pad = -rows % ROW_BUCKET if rows > 0 else 0
    flat = x.reshape(rows, x.shape[-1])  # (R, K)
    if pad:
        padded = torch.empty(rows + pad, x.shape[-1], dtype=x.dtype, device=x.device)  # (R + pad, K)
        padded[:rows].copy_(flat)
        padded[rows:].zero_()
        flat = padded
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()  # oneDNN reads the bias as contiguous: a strided one gave wrong sums
    # GELU's algorithm "none" is the erf GELU ("tanh" would be the approximation); see _check
    out = _op()(flat, weight, bias, activation, [], "none" if activation == "gelu" else "")  # (R + pad, N)
    return out[:rows].view(*x.shape[:-1], weight.shape[0])  # (..., N)


def _op():  # type: ignore[no-untyped-def]
    """PyTorch's oneDNN linear op; AttributeError or RuntimeError where this build has none."""
    return private_torch.onednn_linear_pointwise()


def run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a linear layer: `linear` on its weight and bias when it is a plain
    ``nn.Linear`` that no hook watches, else the module's own call (a subclass, e.g. a LoRA
    wrapper, or a hook must see the call)."""
    if not _plain_linear(layer):
        return layer(x)
    return linear(x, layer.weight, layer.bias)


def run_gelu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(layer(x))`` (exact erf GELU), fused by `linear_gelu` when `run` would fuse."""
    if not _plain_linear(layer):
        return F.gelu(layer(x), approximate="none")
    return linear_gelu(x, layer.weight, layer.bias)


def run_wide(layer: nn.Module, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``layer(x)`` (with ``gelu``: ``F.gelu(layer(x))``, exact erf GELU) for x in float32 and
    a low-precision layer whose products this CPU only emulates: computed in float32 with
    the layer's weights from `wide_copy`, returned in float32. A layer whose call must run
    (a subclass, a hook) is called in its own dtype on x rounded to it."""
    if _plain_linear(layer):
        bias = None if layer.bias is None else wide_copy(x.dtype, layer.bias)
        out = F.linear(x, wide_copy(x.dtype, layer.weight), bias)  # (..., N)
    else:
        weight = cast(torch.Tensor, layer.weight)
        out = layer(x.to(weight.dtype)).to(x.dtype)  # (..., N)
    return F.gelu(out, approximate="none") if gelu else out


def run_wide_is_plain(layer: nn.Module) -> bool:
    """Whether `run_wide` computes ``layer`` itself (a plain ``nn.Linear`` no hook watches)
    rather than calling it: then several such layers may be fused into one product."""
    return _plain_linear(layer)


def _plain_linear(layer: nn.Module) -> TypeGuard[nn.Linear]:
    """Whether calling ``layer`` is exactly ``F.linear(x, layer.weight, layer.bias)``: the
    class is nn.Linear itself and no hook watches it."""
    return type(layer) is nn.Linear and not hooked(layer)


def hooked(module: nn.Module) -> bool:
    """Whether a hook of the module, or a global module hook, would see a call of it (the
    checks nn.Module.__call__ makes before it skips them): then code that would run the
    module's computation without calling it must call it."""
    return private_torch.hooks_would_run(module)


def _static_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The per-call conditions (no op is run)."""
    if switches.is_off("onednn_linear"):
        return switches.off_reason("onednn_linear")
    if os.environ.get("QKV_NO_COMPILED_KERNELS", "") not in ("", "0"):
        return "QKV_NO_COMPILED_KERNELS is set"
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(type(t) not in _PLAIN_TENSORS for t in tensors):
        return "a tensor subclass is involved (it may define its own linear)"
    dtypes = {t.dtype for t in tensors}
    if dtypes != {torch.bfloat16}:
        return f"it runs bfloat16 only (inputs are {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))})"
    if any(t.device.type != "cpu" for t in tensors):
        return "it runs on CPU only"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "a gradient is needed (training keeps F.linear and its backward)"
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") != torch.bfloat16:
        # F.linear would compute in the autocast dtype (e.g. float16) and return that dtype
        return f"CPU autocast to {str(torch.get_autocast_dtype('cpu')).removeprefix('torch.')} is on"
    if x.ndim < 2 or weight.ndim != 2 or x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        return "the shapes are not (..., K), (N, K), (N,) (F.linear says what is wrong)"
    if x.shape[-1] == 0:
        return "there are no input features (K = 0: the output is the bias)"
    if torch.compiler.is_compiling():
        return "torch.compile is tracing (Inductor fuses linear layers itself)"
    if not cpu_features().native(torch.bfloat16) and x.device.type == "cpu":
        # oneDNN has no bf16 inner product there ("could not create a primitive descriptor")
        return f"bfloat16 products are not native on this CPU (tier {cpu_features().describe()}): F.linear in float32"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch is built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    if not torch.backends.mkldnn.enabled:
        return "PyTorch's oneDNN is switched off (torch.backends.mkldnn.enabled is False)"
    return None


def _check() -> str | None:
    """Run the op once against float64 math; None when it passes, else why it cannot be used.

    Plain: an awkward problem (3-D input, K = 40, N = 20, bias) within 2x the error of
    ``F.linear`` in bfloat16 plus a floor (on the machines measured it is bit-identical).
    GELU: the same rule against ``F.gelu(F.linear(...))``, and on inputs the product leaves
    exact (identity weight, zero bias, x in [-3.5, -2.5]) every output within 2^-6 relative
    of the erf GELU: the tanh approximation is off by 3-24 % there (x = -3: -0.00364 vs
    -0.00405); eager's float32 erf and bfloat16 rounding by at most 0.35 % (measured).
    """
    try:
        op = _op()
    except (AttributeError, RuntimeError) as missing:
        return f"this PyTorch has no torch.ops.mkldnn._linear_pointwise ({type(missing).__name__})"
    generator = torch.Generator().manual_seed(0)  # not torch's global generator
    x = torch.randn(3, 7, 40, generator=generator).bfloat16()  # (3, 7, K)
    weight = (torch.randn(20, 40, generator=generator) / math.sqrt(40)).bfloat16()  # (N, K)
    bias = torch.randn(20, generator=generator).bfloat16()  # (N,)
    exact = x.double() @ weight.double().T + bias.double()  # (3, 7, N)
    eye = torch.eye(64, dtype=torch.bfloat16)  # (N, K): the product is exact
    probe = torch.linspace(-3.5, -2.5, 8 * 64, dtype=torch.float64).reshape(8, 64).bfloat16()  # (8, K)
    probe_gelu = F.gelu(probe.double(), approximate="none")  # (8, N) erf GELU
    try:
        with torch.no_grad():
            plain = op(x, weight, bias, "none", [], "")
            fused = op(x, weight, bias, "gelu", [], "none")
            probed = op(probe, eye, torch.zeros(64, dtype=torch.bfloat16), "gelu", [], "none")
    except Exception as failure:  # an op that raises here would raise in the model
        return f"oneDNN's linear raised at its check ({type(failure).__name__}: {str(failure).strip()[:160]})"
    eager_plain = F.linear(x, weight, bias)
    eager_gelu = F.gelu(eager_plain, approximate="none")
    floor = 1e-3
    checks = (
        ("linear", plain, exact, eager_plain),
        ("linear + GELU", fused, F.gelu(exact, approximate="none"), eager_gelu),
    )
    for name, got, want, eager in checks:
        if got.shape != want.shape or got.dtype != torch.bfloat16:
            return f"oneDNN's {name} returned {tuple(got.shape)} {got.dtype} at its check, not {tuple(want.shape)} bfloat16"
        error = (got.double() - want).abs().max().item()
        if not error <= 2 * (eager.double() - want).abs().max().item() + floor:  # NaN fails too
            return f"oneDNN's {name} is off by {error:.3g} against float64 at its check"
    relative = ((probed.double() - probe_gelu) / probe_gelu).abs().max().item()
    if not relative <= 2**-6:
        return f"oneDNN's GELU is not the exact erf GELU here (off by {relative:.2g} relative at its check)"
    return None
