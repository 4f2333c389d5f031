"""A fused bfloat16 forward for the CPU block engine, compiled once on this machine.

PyTorch's CPU flash kernel, called per tile by `qkv.backends.blocks.engine`, reaches about 16 % of
the bf16 matrix-multiply rate on the engine's calls, and a tile of 192 rows computes the
corners of a band that no row sees. This kernel (``interval_bf16.cpp``) takes the mask as one
key interval lo..hi per query row (`Mask.row_intervals`, kept by the plan as
``BlockPlan.intervals``) and, per block of 64 queries, computes only the keys that its rows'
intervals touch, in a transposed layout (keys as rows, the block's queries as columns):
S^T = K Q^T with a float32 result, the score terms it applies (a softcap, a bias by diagonal:
`qkv.native.interval_terms`), a softmax in float32 with 16 queries per vector that
keeps each row's own keys (one exact step for a span of up to 1,024 keys, online in chunks
of 512 beyond), P in bfloat16, and O^T = V^T P^T (FlashAttention-2, algorithm 1). The
products run on the AMX units through oneDNN's micro-kernel (``at::native::cpublas::brgemm``)
on the ``amx`` tier, and on the kernel's own AVX-512 BF16 micro-kernel (``products_bf16.h``)
on the ``avx512`` tier with AVX-512 BF16, where oneDNN has none: two builds of one source
(`BUILDS`). Python cannot reach either: PyTorch has no bf16 x bf16 -> float32 product on CPU
(``mm(out_dtype=)`` is not implemented there), so the source is compiled by
`qkv.native.build` the first time it is needed (seconds, one note on the ``qkv`` logger)
and cached in a folder named by the hash of the source, compiler, flags and torch build.

The kernel is the PyTorch operator ``torch.ops.qkv.interval_bf16_forward`` with a fake
implementation (output shapes for tracing) and an autograd formula: its backward is the
operator ``qkv::interval_bf16_backward`` (`qkv.native.interval_bf16_backward`), so
gradients flow through the pair. `unavailable_reason` says why it cannot run (not bf16, no
AVX-512 BF16, no compiler, the build or its self-check failed) without building anything; `forward`
builds on first use. The engine falls back to its per-tile path whenever the kernel is
unavailable, and calls the backward operator itself (its own autograd.Function picks the
backward that can run).

Shape legend: N batch rows, H heads (key/value heads expanded), L queries, S keys, E / Ev
head dims of q, k / v.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from qkv.native import build as compiled
from qkv.native import interval_bf16_backward, interval_terms, switches

__all__ = ["KERNEL_NAME", "forward", "unavailable_reason"]

# qkv.backends.disabled("interval_bf16") switches it off (benchmarks/bf16_engine.py times the
# per-tile path so); the environment variable QKV_NO_COMPILED_KERNELS=1 too, without a build.

KERNEL_NAME = "fused bf16 interval kernel"
# the kernel's two builds by tier (AMX micro-kernels, or its own AVX-512 BF16 one where the
# CPU has no AMX) and this process's attempt at each (`qkv.native.build.IntervalKernel`)
_KERNEL = compiled.IntervalKernel(
    "interval_bf16", Path(__file__).with_name("interval_bf16.cpp"), KERNEL_NAME,
    lambda library: _self_check(functools.partial(_run, library)),
)  # fmt: skip
BUILDS = _KERNEL.builds


def _static_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel cannot run for these inputs, from facts that need no build."""
    return switches.off_reason("interval_bf16") or compiled.interval_reason(dtype, device)


def unavailable_reason(dtype: torch.dtype, device: torch.device, has_intervals: bool = True) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device, or None if it will
    (possibly after building it on first use). ``has_intervals``: whether the engine's plan
    knows one key interval per query (`BlockPlan.intervals`). Never builds.

    >>> unavailable_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    reason = _static_reason(dtype, device)
    if reason is None and not has_intervals:
        reason = "the mask does not give one key interval per query (Mask.row_intervals)"
    return reason or compiled.build_failure(_KERNEL.build_state())


def first_use_note() -> str:
    """What `qkv.explain` adds to the kernel's name before its first build in this process."""
    return compiled.first_use_note(_KERNEL.build_state())


def _self_check(run) -> str | None:  # type: ignore[no-untyped-def]
    """Run the kernel (``run``: `_run` on the loaded library) once on a small problem against
    float64 math: None, or what went wrong. A wrong packed layout on some CPU would give
    wrong numbers, never an error; this turns it into a reason to fall back."""
    gen = torch.Generator().manual_seed(0)
    # a window with a row that sees nothing and a tail block (one softmax step per block), with
    # a negative scale (the max pass then takes the lowest score) and the output in bf16; the
    # same with score terms (`interval_terms.self_check_terms`); then a causal square of 1,500
    # keys (diagonals, and spans past 1,024 keys: online steps)
    rows = torch.arange(70)
    window = ((rows - 50).clamp(min=0).view(1, 70), (rows + 60).view(1, 70))  # (1, L) each
    window[1][0, 3] = -1
    terms = interval_terms.self_check_terms(2, 70, 150, gen)
    rows = torch.arange(1500)
    causal = (torch.zeros(1, 1500, dtype=torch.long), rows.view(1, 1500))
    cases = (
        (window, 150, 40, -0.125, True, interval_terms.NO_TERMS), (window, 150, 40, -0.125, False, terms),
        (causal, 1500, 64, 0.125, False, interval_terms.NO_TERMS),
    )  # fmt: skip
    for (lo, hi), S, Ev, scale, rounded, case_terms in cases:
        reason = _check_one(run, gen, lo, hi, S, Ev, scale, rounded, case_terms)
        if reason is not None:
            return reason
    return None


# query rows per block of the self-check's float64 reference
_CHECK_ROWS = 128


def _check_one(
    run, gen: torch.Generator, lo: torch.Tensor, hi: torch.Tensor, S: int, Ev: int, scale: float, rounded: bool,  # type: ignore[no-untyped-def]
    terms: interval_terms.IntervalTerms,
) -> str | None:  # fmt: skip
    N, H, L, E = 1, 2, lo.shape[1], 64
    q, k = (torch.randn(N, H, T, E, generator=gen).to(torch.bfloat16) for T in (L, S))
    v = torch.randn(N, H, S, Ev, generator=gen).to(torch.bfloat16)
    out, lse = run(q, k, v, lo, hi, scale, rounded, terms)
    if out.dtype != (torch.bfloat16 if rounded else torch.float32):
        return f"its self-check failed (the output came in {out.dtype})"
    keys = torch.arange(S).view(1, S)
    k64, v64 = k.double(), v.double()
    want, want_lse = torch.empty(N, H, L, Ev, dtype=torch.float64), torch.empty(N, H, L, dtype=torch.float64)
    # float64 math by blocks of rows: the whole score matrix of the causal case was 36 MiB per
    # copy, and this check runs inside a user's first call
    for r0 in range(0, L, _CHECK_ROWS):
        rows = torch.arange(r0, min(L, r0 + _CHECK_ROWS))
        visible = (keys >= lo[0, rows].view(-1, 1)) & (keys <= hi[0, rows].view(-1, 1))  # (rows, S)
        raw = q[0, :, rows].double() @ k64[0].transpose(-1, -2)  # (H, rows, S)
        s = terms.applied(raw, scale, torch.arange(H), rows).masked_fill(~visible, float("-inf"))
        want_lse[0, :, rows] = torch.logsumexp(s, dim=-1)
        want[0, :, rows] = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v64[0]
    out_err = (out.double() - want).abs().max().item()
    finite = torch.isfinite(want_lse)
    lse_err = (lse.double()[finite] - want_lse[finite]).abs().max().item()
    if not (out_err < 3e-2 and lse_err < 1e-3 and bool((lse[~finite] == float("-inf")).all())):
        with_terms = " with score terms" if terms.active else ""
        return f"its self-check failed{with_terms} (output error {out_err:.3g}, lse error {lse_err:.3g})"
    return None


@functools.cache
def _entry(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's entry point with its C signature (interval_bf16.cpp)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return compiled.function(
        library, "qkv_interval_bf16_forward", ctypes.c_int,
        p, p, p, p, p, p,  # q, k, v and their strides
        p, p, i64,  # lo, hi, their rows
        i64, i64, i64, i64, i64, i64,  # N, H, L, E, S, Ev
        ctypes.c_double, *interval_terms.ARGUMENT_TYPES,  # scale, the score terms (`IntervalTerms.arguments`)
        ctypes.c_int, p, p, i64,  # bf16 output, out, lse, threads
    )  # fmt: skip


def _argument_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> str | None:
    """What is wrong with the operator's arguments, or None (the kernel reads raw memory: any
    mismatch must be refused before it runs)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v must be 4-D (N, H, T, D)"
    if any(x.dtype != torch.bfloat16 for x in (q, k, v)):
        return "q, k and v must be bfloat16"
    if any(x.stride(3) != 1 for x in (q, k, v)):
        return "q, k and v need a contiguous last dim"
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    if tuple(k.shape) != (N, H, S, E) or tuple(v.shape[:3]) != (N, H, S):
        return f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if E <= 0 or E % 32 or Ev <= 0:
        return f"E must be a positive multiple of 32 and Ev positive (they are {E} and {Ev})"
    if S >= 1 << 30:
        return "at most 2^30 keys"
    if lo.dtype != torch.long or hi.dtype != torch.long or lo.dim() != 2 or lo.shape != hi.shape:
        return "lo and hi must be int64 tensors of one shape (N | 1, L)"
    if lo.shape[1] != L or lo.shape[0] not in (1, N):
        return f"lo and hi must be (N | 1, L) = ({N} | 1, {L}), not {tuple(lo.shape)}"
    if any(x.device.type != "cpu" for x in (q, k, v, lo, hi)):
        return "every tensor must be on the CPU"
    return None


def _run(
    library: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
    scale: float, rounded: bool, terms: interval_terms.IntervalTerms = interval_terms.NO_TERMS,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The kernel on checked arguments: out (N, H, L, Ev) float32 (bfloat16 when rounded) and
    lse (N, H, L) float32, with the score ``terms`` applied."""
    problem = _argument_problem(q, k, v, lo, hi)
    if problem is None:
        problem = terms.problem(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if problem is not None:
        raise ValueError(f"qkv::interval_bf16_forward: {problem}")
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[3]
    lo, hi = lo.contiguous(), hi.contiguous()
    out = torch.empty(N, H, L, Ev, dtype=torch.bfloat16 if rounded else torch.float32)
    lse = torch.empty(N, H, L, dtype=torch.float32)
    status = _entry(library)(
        q.data_ptr(), compiled.strides(q), k.data_ptr(), compiled.strides(k), v.data_ptr(), compiled.strides(v),
        lo.data_ptr(), hi.data_ptr(), lo.shape[0], N, H, L, E, S, Ev, float(scale), *terms.arguments(), int(bool(rounded)),
        out.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"the {KERNEL_NAME} could not allocate its scratch buffers")
    return out, lse


# the schema is written out: torch 2.5 infers none from `list[...]` or `X | None` annotations
@torch.library.custom_op("qkv::interval_bf16_forward", mutates_args=(), schema="(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, float scale, bool rounded, float softcap=0.0, Tensor? diag_table=None, Tensor? positions=None, int diag_offset=0) -> (Tensor, Tensor)")
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float, rounded: bool,
    softcap: float = 0.0, diag_table: torch.Tensor | None = None, positions: torch.Tensor | None = None, diag_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """out (N, H, L, Ev) float32 (bfloat16 when ``rounded``) and lse (N, H, L) float32 of
    interval attention (E a multiple of 32, contiguous last dims; `forward` pads q and k), with
    the score terms of `qkv.native.interval_terms` (a softcap when positive, a bias by diagonal
    when ``diag_table`` is given).
    Builds the kernel on first use; raises RuntimeError when it cannot run here."""
    reason = compiled.interval_reason(q.dtype, q.device)
    library = compiled.loaded_or_raise(reason or _KERNEL.module(), KERNEL_NAME)
    terms = interval_terms.IntervalTerms(softcap, diag_table, positions, diag_offset)
    return _run(library, q, k, v, lo, hi, scale, rounded, terms)


@_forward_op.register_fake
def _(q, k, v, lo, hi, scale, rounded, softcap=0.0, diag_table=None, positions=None, diag_offset=0):  # type: ignore[no-untyped-def]
    problem = _argument_problem(q, k, v, lo, hi)
    if problem is not None:
        raise ValueError(f"qkv::interval_bf16_forward: {problem}")
    N, H, L, _ = q.shape
    out = q.new_empty(N, H, L, v.shape[3], dtype=torch.bfloat16 if rounded else torch.float32)
    return out, q.new_empty(N, H, L, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, lo, hi, scale, rounded, *given = inputs  # the score terms: absent where the caller left the defaults
    defaults: tuple[object, ...] = (0.0, None, None, 0)
    softcap, table, positions, offset = tuple(given) + defaults[len(given) :]
    out, lse = output
    ctx.save_for_backward(q, k, v, lo, hi, out, lse, table, positions)
    ctx.scale, ctx.rounded, ctx.softcap, ctx.offset = scale, rounded, softcap, offset


def _backward(ctx, grad_out, grad_lse):  # type: ignore[no-untyped-def]
    """dq, dk, dv from the backward operator (FlashAttention-2's backward from the saved
    float32 output and lse; the lse's gradient enters its row term)."""
    if ctx.rounded:
        raise RuntimeError("qkv::interval_bf16_forward with rounded=True keeps no float32 output to differentiate; call it with rounded=False")
    q, k, v, lo, hi, out, lse, table, positions = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    terms = interval_terms.IntervalTerms(ctx.softcap, table, positions, ctx.offset)
    dq, dk, dv = interval_bf16_backward.gradients(grad_out, q, k, v, out, lse, lo, hi, ctx.scale, grad_lse, terms)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float,
    rounded: bool = False,
    terms: interval_terms.IntervalTerms = interval_terms.NO_TERMS,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Output (N, H, L, Ev) and lse (N, H, L), float32, of q (N, H, L, E), k (N, H, S, E),
    v (N, H, S, Ev) bfloat16, where query i of batch row n sees keys lo[n, i]..hi[n, i]
    (lo, hi (N | 1, L) int64; an empty interval gives output 0 and lse -inf). With ``rounded``
    the output is bfloat16 (each value the float32 one rounded to nearest even), for callers
    that run no backward: half the bytes to write and no copy to round. ``terms``: a softcap
    and a bias by diagonal (`qkv.native.interval_terms`), applied after the scale. None when
    the kernel is unavailable (`unavailable_reason`): the caller falls back."""
    if unavailable_reason(q.dtype, q.device) is not None:
        return None
    library = _KERNEL.module()
    if isinstance(library, str):
        return None
    q, k = compiled.padded_heads(q), compiled.padded_heads(k)  # (N, H, *, E rounded up to 32)
    v = v if v.stride(-1) == 1 else v.contiguous()
    lo, hi = lo.to(torch.long), hi.to(torch.long)
    with torch.no_grad():
        if compiled.direct_call(q, k, v, lo, hi, *(t for t in (terms.table, terms.positions) if t is not None)):
            return _run(library, q, k, v, lo, hi, float(scale), bool(rounded), terms)
        out, lse = torch.ops.qkv.interval_bf16_forward(
            q, k, v, lo, hi, float(scale), bool(rounded), terms.softcap, terms.table, terms.positions, terms.offset
        )
    return out, lse
