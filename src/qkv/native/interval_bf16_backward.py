"""A fused bfloat16 backward for the CPU block engine, compiled once on this machine.

The engine's other backwards for bf16 (`qkv.backends.blocks.matmul_backward`'s products per call, or
PyTorch's flash backward on float32 copies) take about five times the fused forward
(`qkv.native.interval_bf16`). This kernel (``interval_bf16_backward.cpp``) takes the mask
as the same one key interval lo..hi per query row (``BlockPlan.intervals``) and runs
FlashAttention-2's backward (algorithm 2) from the forward's float32 output and lse: per
64-key block and each 64-query block whose rows' intervals touch it, the five products
(S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T) on the AMX units
(``at::native::cpublas::brgemm``, bf16 x bf16 -> float32), P and dS in float32 on each row's
own keys only, float32 accumulators rounded to bfloat16 once. One task per (batch row, head):
each gradient element is written by one thread in a fixed order, so two runs are bitwise equal.

The gradient of the returned lse enters the row term: D_i = rowsum(dO_i * O_i) - dlse_i
(`qkv.backends.lse_grad` explains why that is exact). Built like the forward
(`qkv.native.build.build`: cached by the source's hash, one line on stderr while it
compiles) and checked at load against float64 math; `unavailable_reason` says why it cannot
run without building, and the engine then takes its other backward.

Shape legend: N batch rows, H heads (key/value heads expanded by the engine, whose autograd
sums dk, dv over each group), L queries, S keys, E / Ev head dims of q, k / v.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from qkv.native import build as compiled
from qkv.native import switches

__all__ = ["KERNEL_NAME", "backward", "describe", "unavailable_reason"]

# qkv.backends.disabled("interval_bf16_backward") switches it off (benchmarks/bf16_engine.py
# times the engine's other backwards so); QKV_NO_COMPILED_KERNELS=1 too, without a build.

KERNEL_NAME = "fused bf16 interval backward kernel"
# the kernel's source and build (`qkv.native.build`)
NATIVE = compiled.NativeKernel("interval_bf16_backward", Path(__file__).with_name("interval_bf16_backward.cpp"), KERNEL_NAME)
# the outcome of the one build attempt of this process: the module, or why there is none
_built: dict[str, ModuleType | str] = {}


def unavailable_reason(dtype: torch.dtype, device: torch.device, has_intervals: bool = True) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device, or None if it will
    (possibly after building it on first use). ``has_intervals``: whether the engine's plan
    knows one key interval per query (`BlockPlan.intervals`). Never builds.

    >>> unavailable_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    reason = switches.off_reason("interval_bf16_backward")
    if reason is None:
        reason = compiled.static_reason(dtype, device, needs_onednn=True)
    if reason is None and not has_intervals:
        reason = "the mask does not give one key interval per query (Mask.row_intervals)"
    return reason or compiled.build_failure(_built)


def describe(dtype: torch.dtype, device: torch.device, has_intervals: bool) -> str:
    """The engine's backward for such inputs in words (`qkv.explain`), without building.

    >>> describe(torch.float32, torch.device("cpu"), True).startswith("the engine's backward per call")
    True
    """
    reason = unavailable_reason(dtype, device, has_intervals)
    if reason is None:
        return f"the {KERNEL_NAME} (C++, AMX micro-kernels){compiled.first_use_note(_built)}"
    return (
        "the engine's backward per call: bf16 products or PyTorch's flash backward on float32 copies "
        f"(the {KERNEL_NAME} does not run: {reason})"
    )


def _build() -> ModuleType | str:
    """Compile (or load the cached build of) the kernel and check it: the module, or why not."""
    return compiled.build(NATIVE, _check)


def _check(module: ModuleType) -> str | None:
    return compiled.onednn_packing_reason(module) or _self_check(module)


def _self_check(module: ModuleType) -> str | None:
    """Run the kernel once on a small problem (L != S, a row with no key, an lse gradient)
    against float64 autograd: None, or what went wrong. A wrong packed layout on some CPU
    would give wrong numbers, never an error; this turns it into a reason to fall back."""
    gen = torch.Generator().manual_seed(0)
    N, H, L, S, E, Ev = 1, 2, 70, 150, 64, 32
    q, k = (torch.randn(N, H, T, E, generator=gen).to(torch.bfloat16) for T in (L, S))
    v = torch.randn(N, H, S, Ev, generator=gen).to(torch.bfloat16)
    d_out = torch.randn(N, H, L, Ev, generator=gen).to(torch.bfloat16)
    d_lse = torch.randn(N, H, L, generator=gen)
    rows = torch.arange(L)
    lo, hi = (rows - 50).clamp(min=0).view(1, L), (rows + 60).view(1, L)  # (1, L) each
    hi[0, 3] = -1  # one row that sees nothing
    keys = torch.arange(S).view(1, S)
    visible = (keys >= lo.view(L, 1)) & (keys <= hi.view(L, 1))  # (L, S)
    with torch.enable_grad():  # the engine calls this inside autograd's backward, where grad mode is off
        q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
        s = (q64 @ k64.transpose(-1, -2) * 0.125).masked_fill(~visible, float("-inf"))  # (N, H, L, S)
        lse64 = torch.logsumexp(s, dim=-1)  # (N, H, L)
        out64 = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v64  # (N, H, L, Ev)
        finite = torch.isfinite(lse64)
        loss = (out64 * d_out.double()).sum() + (lse64[finite] * d_lse.double()[finite]).sum()
        want = torch.autograd.grad(loss, (q64, k64, v64))
    got = module.backward(
        d_out, q, k, v, out64.detach().float(), lse64.detach().float(), d_lse, lo, hi, 0.125
    )  # dq, dk, dv bf16
    errors = [(g.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30) for g, w in zip(got, want, strict=True)]
    if not (max(errors) < 2e-2 and bool((got[0][:, :, 3] == 0).all())):
        return f"its self-check failed (relative errors of dq, dk, dv {', '.join(f'{e:.3g}' for e in errors)})"
    return None


def _module() -> ModuleType | str:
    return compiled.built_once(_built, _build)


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """dq (N, H, L, E), dk (N, H, S, E), dv (N, H, S, Ev) bfloat16 of attention over q
    (N, H, L, E), k (N, H, S, E), v (N, H, S, Ev) bfloat16 where query i of batch row n sees
    keys lo[n, i]..hi[n, i] (lo, hi (N | 1, L) int64), from the output's gradient grad_out
    (N, H, L, Ev), the forward's float32 output out (N, H, L, Ev) and lse (N, H, L), and the
    lse's gradient grad_lse (N, H, L) if any. None when the kernel is unavailable
    (`unavailable_reason`): the caller falls back."""
    if unavailable_reason(q.dtype, q.device) is not None:
        return None
    module = _module()
    if isinstance(module, str):
        return None
    E, Ev = q.shape[3], v.shape[3]
    q_, k_, v_ = (compiled.padded_heads(x) for x in (q, k, v))  # (N, H, *, E | Ev rounded up to 32)
    g_ = compiled.padded_heads(grad_out.to(torch.bfloat16))  # (N, H, L, Ev rounded up)
    d_lse = torch.empty(0) if grad_lse is None else grad_lse.to(torch.float32)
    with torch.no_grad():
        dq, dk, dv = module.backward(
            g_, q_, k_, v_, out.to(torch.float32), lse.to(torch.float32), d_lse, lo.to(torch.long), hi.to(torch.long),
            float(scale),
        )  # (N, H, *, padded)
    return dq[..., :E], dk[..., :E], dv[..., :Ev]
