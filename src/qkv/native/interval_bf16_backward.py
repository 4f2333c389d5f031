"""A fused bfloat16 backward for the CPU block engine, compiled once on this machine.

The engine's other backwards for bf16 (`qkv.backends.blocks.matmul_backward`'s products per call, or
PyTorch's flash backward on float32 copies) take about five times the fused forward
(`qkv.native.interval_bf16`). This kernel (``interval_bf16_backward.cpp``) takes the mask
as the same one key interval lo..hi per query row (``BlockPlan.intervals``) and runs
FlashAttention-2's backward (algorithm 2) from the forward's float32 output and lse: per
64-key block and each 64-query block whose rows' intervals touch it, the five products
(S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T), bf16 x bf16 ->
float32, on the AMX units (``at::native::cpublas::brgemm``) or, on the ``avx512`` tier with
AVX-512 BF16, the kernel's own micro-kernel (``products_bf16.h``), P and dS in float32 on each row's
own keys only (with the forward's score terms: `qkv.native.interval_terms`), float32
accumulators rounded to bfloat16 once. One task per (batch row, head):
each gradient element is written by one thread in a fixed order, so two runs are bitwise equal.

The gradient of the returned lse enters the row term: D_i = rowsum(dO_i * O_i) - dlse_i
(`qkv.backends.lse_grad` explains why that is exact). Built like the forward
(`qkv.native.build.build`: cached by the source's hash, one note while it compiles, seconds)
and checked at load against float64 math; `unavailable_reason` says why it cannot run
without building, and the engine then takes its other backward.

The kernel is the PyTorch operator ``torch.ops.qkv.interval_bf16_backward`` (a fake
implementation gives the gradients' shapes for tracing); it is the backward formula of
``qkv::interval_bf16_forward`` (`qkv.native.interval_bf16`), and the engine calls it through
`backward`.

Shape legend: N batch rows, H heads (key/value heads expanded by the engine, whose autograd
sums dk, dv over each group), L queries, S keys, E / Ev head dims of q, k / v.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from qkv.native import build as compiled
from qkv.native import interval_terms, switches

__all__ = ["KERNEL_NAME", "backward", "gradients", "unavailable_reason"]

# qkv.backends.disabled("interval_bf16_backward") switches it off (benchmarks/bf16_engine.py
# times the engine's other backwards so); QKV_NO_COMPILED_KERNELS=1 too, without a build.

KERNEL_NAME = "fused bf16 interval backward kernel"
# the kernel's two builds by tier (AMX micro-kernels, or its own AVX-512 BF16 one where the
# CPU has no AMX) and this process's attempt at each (`qkv.native.build.IntervalKernel`)
_KERNEL = compiled.IntervalKernel(
    "interval_bf16_backward", Path(__file__).with_name("interval_bf16_backward.cpp"), KERNEL_NAME,
    lambda library: _self_check(functools.partial(_run, library)),
)  # fmt: skip
BUILDS = _KERNEL.builds


def unavailable_reason(dtype: torch.dtype, device: torch.device, has_intervals: bool = True) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device, or None if it will
    (possibly after building it on first use). ``has_intervals``: whether the engine's plan
    knows one key interval per query (`BlockPlan.intervals`). Never builds.

    >>> unavailable_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    reason = switches.off_reason("interval_bf16_backward")
    if reason is None:
        reason = compiled.interval_reason(dtype, device)
    if reason is None and not has_intervals:
        reason = "the mask does not give one key interval per query (Mask.row_intervals)"
    return reason or compiled.build_failure(_KERNEL.build_state())


def first_use_note() -> str:
    """What `qkv.explain` adds to the kernel's name before its first build in this process."""
    return compiled.first_use_note(_KERNEL.build_state())


def _self_check(run) -> str | None:  # type: ignore[no-untyped-def]
    """Run the kernel (``run``: `_run` on the loaded library) on a small problem (L != S, a
    row with no key, an lse gradient), without and with score terms, against float64 math: None,
    or what went wrong. A wrong packed layout on some CPU would give wrong numbers, never an
    error; this turns it into a reason to fall back."""
    for with_terms in (False, True):
        reason = _check_one(run, with_terms)
        if reason is not None:
            return reason
    return None


def _check_one(run, with_terms: bool) -> str | None:  # type: ignore[no-untyped-def]
    """The self-check's problem, ``with_terms``: `interval_terms.self_check_terms`."""
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
    terms = interval_terms.NO_TERMS
    if with_terms:
        terms = interval_terms.self_check_terms(H, L, S, gen)
    # the float64 gradients written out (no autograd: a first build may run inside an
    # operator, below autograd's dispatch): P the probabilities, dS = P (dP - rowsum(dO O) + dlse)
    q64, k64, v64, g64 = (x.double() for x in (q, k, v, d_out))
    raw = q64 @ k64.transpose(-1, -2)  # (N, H, L, S)
    s = terms.applied(raw[0], 0.125, torch.arange(H), rows).unsqueeze(0)  # (N, H, L, S)
    # the softcap's slope 1 - tanh^2 multiplies dS; the bias's does not enter
    slope = 1.0 - torch.tanh(raw * 0.125 / terms.softcap) ** 2 if terms.softcap > 0.0 else torch.ones_like(s)
    s = s.masked_fill(~visible, float("-inf"))
    lse64 = torch.logsumexp(s, dim=-1)  # (N, H, L)
    p = torch.nan_to_num(torch.softmax(s, dim=-1))  # (N, H, L, S), rows that see nothing: 0
    out64 = p @ v64  # (N, H, L, Ev)
    d_lse64 = torch.where(torch.isfinite(lse64), d_lse.double(), 0.0)  # (N, H, L)
    row = (g64 * out64).sum(-1, keepdim=True) - d_lse64.unsqueeze(-1)  # (N, H, L, 1)
    d_s = p * (g64 @ v64.transpose(-1, -2) - row) * slope * 0.125  # (N, H, L, S)
    want = (d_s @ k64, d_s.transpose(-1, -2) @ q64, p.transpose(-1, -2) @ g64)  # dq, dk, dv
    got = run(d_out, q, k, v, out64.detach().float(), lse64.detach().float(), d_lse, lo, hi, 0.125, terms)  # dq, dk, dv bf16
    errors = [(g.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30) for g, w in zip(got, want, strict=True)]
    if not (max(errors) < 2e-2 and bool((got[0][:, :, 3] == 0).all())):
        described = " with score terms" if with_terms else ""
        return f"its self-check failed{described} (relative errors of dq, dk, dv {', '.join(f'{e:.3g}' for e in errors)})"
    return None


@functools.cache
def _entry(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's entry point with its C signature (interval_bf16_backward.cpp)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return compiled.function(
        library, "qkv_interval_bf16_backward", ctypes.c_int,
        p, p, p, p, p, p, p, p,  # grad_out, q, k, v and their strides
        p, p, p, p,  # out and its strides, lse, grad_lse (or null)
        p, p, i64,  # lo, hi, their rows
        i64, i64, i64, i64, i64, i64, i64,  # N, H, L, E, S, Ev, Eo
        ctypes.c_double, *interval_terms.ARGUMENT_TYPES,  # scale, the score terms (`IntervalTerms.arguments`)
        p, p, p, i64,  # dq, dk, dv, threads
    )  # fmt: skip


def _argument_problem(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_lse: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor,
) -> str | None:  # fmt: skip
    """What is wrong with the operator's arguments, or None (the kernel reads raw memory: any
    mismatch must be refused before it runs)."""
    if any(x.dim() != 4 for x in (grad_out, q, k, v, out)):
        return "grad_out, q, k, v and out must be 4-D (N, H, T, D)"
    if any(x.dtype != torch.bfloat16 for x in (grad_out, q, k, v)):
        return "grad_out, q, k and v must be bfloat16"
    if any(x.stride(3) != 1 for x in (grad_out, q, k, v, out)):
        return "grad_out, q, k, v and out need a contiguous last dim"
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    if tuple(k.shape) != (N, H, S, E) or tuple(v.shape[:3]) != (N, H, S) or tuple(grad_out.shape) != (N, H, L, Ev):
        return f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, grad_out {tuple(grad_out.shape)}"
    if out.dtype != torch.float32 or tuple(out.shape[:3]) != (N, H, L) or out.shape[3] > Ev:
        return "out must be float32 (N, H, L, at most Ev)"
    if lse.dtype != torch.float32 or tuple(lse.shape) != (N, H, L):
        return "lse must be float32 (N, H, L)"
    if grad_lse is not None and (grad_lse.dtype != torch.float32 or tuple(grad_lse.shape) != (N, H, L)):
        return "grad_lse must be None or float32 (N, H, L)"
    if E <= 0 or Ev <= 0 or E % 32 or Ev % 32:
        return f"E and Ev must be positive multiples of 32 (they are {E} and {Ev})"
    if lo.dtype != torch.long or hi.dtype != torch.long or lo.dim() != 2 or lo.shape != hi.shape:
        return "lo and hi must be int64 tensors of one shape (N | 1, L)"
    if lo.shape[1] != L or lo.shape[0] not in (1, N):
        return f"lo and hi must be (N | 1, L) = ({N} | 1, {L}), not {tuple(lo.shape)}"
    if any(x.device.type != "cpu" for x in (grad_out, q, k, v, out, lse, lo, hi)):
        return "every tensor must be on the CPU"
    return None


def _run(
    library: ctypes.CDLL, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, grad_lse: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor, scale: float,
    terms: interval_terms.IntervalTerms = interval_terms.NO_TERMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel on checked arguments: dq, dk, dv (N, H, *, E | Ev) bfloat16, for a forward
    with the score ``terms``."""
    problem = _argument_problem(grad_out, q, k, v, out, lse, grad_lse, lo, hi)
    if problem is not None:
        raise ValueError(f"qkv::interval_bf16_backward: {problem}")
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    problem = terms.problem(N, H, L, S)
    if problem is not None:
        raise ValueError(f"qkv::interval_bf16_backward: {problem}")
    lse, lo, hi = lse.contiguous(), lo.contiguous(), hi.contiguous()
    d_lse = None if grad_lse is None or grad_lse.numel() == 0 else grad_lse.contiguous()
    dq = torch.empty(N, H, L, E, dtype=torch.bfloat16)
    dk = torch.empty(N, H, S, E, dtype=torch.bfloat16)
    dv = torch.empty(N, H, S, Ev, dtype=torch.bfloat16)
    status = _entry(library)(
        grad_out.data_ptr(), compiled.strides(grad_out), q.data_ptr(), compiled.strides(q),
        k.data_ptr(), compiled.strides(k), v.data_ptr(), compiled.strides(v),
        out.data_ptr(), compiled.strides(out), lse.data_ptr(), None if d_lse is None else d_lse.data_ptr(),
        lo.data_ptr(), hi.data_ptr(), lo.shape[0], N, H, L, E, S, Ev, out.shape[3], float(scale), *terms.arguments(),
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"the {KERNEL_NAME} could not allocate its scratch buffers")
    return dq, dk, dv


# the schema is written out: torch 2.5 infers none from `list[...]` or `X | None` annotations
@torch.library.custom_op("qkv::interval_bf16_backward", mutates_args=(), schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse, Tensor lo, Tensor hi, float scale, float softcap=0.0, Tensor? diag_table=None, Tensor? positions=None, int diag_offset=0) -> (Tensor, Tensor, Tensor)")
def _backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    grad_lse: torch.Tensor | None, lo: torch.Tensor, hi: torch.Tensor, scale: float, softcap: float = 0.0,
    diag_table: torch.Tensor | None = None, positions: torch.Tensor | None = None, diag_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dq (N, H, L, E), dk (N, H, S, E), dv (N, H, S, Ev) bfloat16 of interval attention (E, Ev
    multiples of 32, contiguous last dims; `backward` pads them). Builds the kernel on first
    use; raises RuntimeError when it cannot run here (`unavailable_reason`)."""
    reason = compiled.interval_reason(q.dtype, q.device)
    library = compiled.loaded_or_raise(reason or _KERNEL.module(), KERNEL_NAME)
    terms = interval_terms.IntervalTerms(softcap, diag_table, positions, diag_offset)
    return _run(library, grad_out, q, k, v, out, lse, grad_lse, lo, hi, scale, terms)


@_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, grad_lse, lo, hi, scale, softcap=0.0, diag_table=None, positions=None, diag_offset=0):  # type: ignore[no-untyped-def]
    problem = _argument_problem(grad_out, q, k, v, out, lse, grad_lse, lo, hi)
    if problem is not None:
        raise ValueError(f"qkv::interval_bf16_backward: {problem}")
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(v, memory_format=torch.contiguous_format)


def gradients(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    lo: torch.Tensor, hi: torch.Tensor, scale: float, grad_lse: torch.Tensor | None = None,
    terms: interval_terms.IntervalTerms = interval_terms.NO_TERMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The operator on inputs of any head dims: q, k, v and grad_out padded to multiples of 32
    (zero columns change no gradient of the others), the gradients cut back to E and Ev."""
    E, Ev = q.shape[3], v.shape[3]
    q_, k_, v_ = (compiled.padded_heads(x) for x in (q, k, v))  # (N, H, *, E | Ev rounded up to 32)
    g_ = compiled.padded_heads(grad_out.to(torch.bfloat16))  # (N, H, L, Ev rounded up)
    d_lse = None if grad_lse is None else grad_lse.to(torch.float32)
    args = (g_, q_, k_, v_, out.to(torch.float32), lse.to(torch.float32), d_lse, lo.to(torch.long), hi.to(torch.long))
    tensors = (*args, terms.table, terms.positions)
    library = _KERNEL.module() if compiled.direct_call(*(a for a in tensors if a is not None)) else None
    with torch.no_grad():
        if isinstance(library, ctypes.CDLL):
            dq, dk, dv = _run(library, *args, float(scale), terms)  # (N, H, *, padded)
        else:  # traced, or its build failed (the operator then says why)
            dq, dk, dv = torch.ops.qkv.interval_bf16_backward(
                *args, float(scale), terms.softcap, terms.table, terms.positions, terms.offset
            )  # (N, H, *, padded)
    return dq[..., :E], dk[..., :E], dv[..., :Ev]


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
    terms: interval_terms.IntervalTerms = interval_terms.NO_TERMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """dq (N, H, L, E), dk (N, H, S, E), dv (N, H, S, Ev) bfloat16 of attention over q
    (N, H, L, E), k (N, H, S, E), v (N, H, S, Ev) bfloat16 where query i of batch row n sees
    keys lo[n, i]..hi[n, i] (lo, hi (N | 1, L) int64), from the output's gradient grad_out
    (N, H, L, Ev), the forward's float32 output out (N, H, L, Ev) and lse (N, H, L), and the
    lse's gradient grad_lse (N, H, L) if any; ``terms``: the forward's score terms (a
    softcap, a bias by diagonal: `qkv.native.interval_terms`). None when the kernel is unavailable (`unavailable_reason`):
    the caller falls back."""
    if unavailable_reason(q.dtype, q.device) is not None:
        return None
    if isinstance(_KERNEL.module(), str):
        return None
    return gradients(grad_out, q, k, v, out, lse, lo, hi, scale, grad_lse, terms)
