"""Exact bfloat16 attention for short sequences on the CPU, compiled once on this machine.

A sentence encoder calls attention on many short rows: MiniLM at batch 32 has 384 (batch
row, head) problems of 20-110 tokens with head dim 32, a few million scores in all. PyTorch's
CPU flash kernel spends that call mostly on per-problem set-up (15-50 GFLOP/s at these
sizes, about 2 % of the bf16 matrix-multiply rate). This kernel (``short_bf16.cpp``) takes
one (batch row, key/value head) per task, packs its keys and values once for the AMX tiles,
and computes each query row's scores over all keys, an exact float32 softmax
(no online rescaling: the row fits in a few vectors) and the product with the values,
rounding the output to bfloat16 once. Key padding is a per-batch-row list of visible keys;
a row that sees no key returns zeros, as everywhere in qkv.

It runs for `qkv.attention` calls that the dispatcher sends to SDPA with ``backend="auto"``
(`qkv.attention.dispatch`): bfloat16 on CPU, at most `MAX_KEYS` keys, no mask or a key-padding one
(a bool mask that varies over batch rows and keys only), no score terms, dropout or
gradient, no weights or lse asked for. `unavailable_reason` says why it cannot run without
building anything; `forward` builds on first use (seconds, one note on the ``qkv`` logger)
and returns None when the build or the self-check against float64 failed; the caller then
runs SDPA. The kernel is the PyTorch operator ``torch.ops.qkv.short_bf16`` (with a fake
implementation for tracing; it has no gradient: callers that need one take SDPA).

Shape legend: N batch rows, H query heads, G key/value heads, L queries, S keys, E / Ev head
dims of q, k / v.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from qkv.native import build as compiled
from qkv.native import switches

__all__ = ["KERNEL_NAME", "MAX_KEYS", "argument_problem", "empty_output", "forward", "run_kernel", "self_check", "unavailable_reason", "unit_last_stride"]

# qkv.backends.disabled("short_bf16") switches it off (benchmarks time SDPA so);
# QKV_NO_COMPILED_KERNELS=1 too.

KERNEL_NAME = "short-sequence bf16 kernel"
# The kernel keeps 16 rows' scores over all keys; with many keys PyTorch's flash kernel pays
# back its set-up. Measured (B = 32, H = 12, E = 32, key padding, 1 thread, CPU time, load ~4;
# SDPA / this kernel, ms): L = S = 20: 1.31 / 0.89; 62: 6.96 / 2.83; 110: 12.9 / 7.0;
# 256: 35.2 / 34.3; 512: 108 / 99. Above 512 it was not measured.
MAX_KEYS = 512
# the kernel's source and build flags (`qkv.native.build`): it programs the AMX tiles itself,
# and includes at::vec's header-only exp (no torch library to link)
NATIVE = compiled.NativeKernel(
    "short_bf16", Path(__file__).with_name("short_bf16.cpp"), KERNEL_NAME, cflags=(*compiled.CFLAGS, *compiled.AMX_FLAGS),
    torch_headers=True,
)  # fmt: skip

# the outcome of the one build attempt of this process: the loaded library, or why there is none
_built: dict = {}


def native() -> compiled.NativeKernel:
    """The kernel's build (one, for the ``amx`` tier)."""
    return NATIVE


def build_state() -> dict:
    """This process's build attempt (`qkv.native.build.built_once`'s cache)."""
    return _built


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device, or None if it will
    (possibly after building it on first use). Never builds.

    >>> unavailable_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    reason = switches.off_reason("short_bf16") or compiled.static_reason(dtype, device)
    return reason or compiled.build_failure(_built)




def _build() -> ctypes.CDLL | str:
    return compiled.build(NATIVE, _check)


def _check(library: ctypes.CDLL) -> str | None:
    if not compiled.function(library, "qkv_short_bf16_tiles_permitted", ctypes.c_int)():
        return "Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return self_check(functools.partial(_run, library))


def self_check(run) -> str | None:  # type: ignore[no-untyped-def]
    """Run a short-sequence kernel (``run``: `_run` on the loaded library, or
    `qkv.native.short_wide`'s) once on an awkward problem
    against float64 math: None, or what went wrong (a wrong layout or instruction would give
    wrong numbers, never an error)."""
    gen = torch.Generator().manual_seed(0)
    N, H, G, L, S, E, Ev = 3, 4, 2, 7, 37, 33, 20
    q = torch.randn(N, L, H, E, generator=gen).to(torch.bfloat16).transpose(1, 2)  # (N, H, L, E), strided
    k = torch.randn(N, G, S, E, generator=gen).to(torch.bfloat16)
    v = torch.randn(N, G, S, Ev, generator=gen).to(torch.bfloat16)
    valid = torch.rand(N, S, generator=gen) < 0.7  # (N, S)
    valid[1] = False  # a batch row whose queries see nothing
    out = run(q, k, v, valid, 0.2)
    kd, vd = (x.double().repeat_interleave(H // G, dim=1) for x in (k, v))  # (N, H, S, *)
    s = (q.double() @ kd.transpose(-1, -2) * 0.2).masked_fill(~valid[:, None, None, :], float("-inf"))  # (N, H, L, S)
    want = torch.nan_to_num(torch.softmax(s, dim=-1)) @ vd  # (N, H, L, Ev)
    error = (out.double() - want).abs().max().item()
    if not error < 3e-2:  # also catches a NaN left in out
        return f"its self-check failed (output error {error:.3g})"
    return None


def _module() -> ctypes.CDLL | str:
    return compiled.built_once(_built, _build)


@functools.cache
def _entry(library: ctypes.CDLL, name: str):  # type: ignore[no-untyped-def]
    """A short-sequence kernel's entry point ``name`` with its C signature, the same in this
    kernel (short_bf16.cpp) and `qkv.native.short_wide`'s."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return compiled.function(
        library, name, ctypes.c_int,
        p, p, p, p, p, p,  # q, k, v and their strides
        p, i64,  # key_valid (or null), its rows
        i64, i64, i64, i64, i64, i64, i64,  # N, H, G, L, E, S, Ev
        ctypes.c_double, p, p, i64,  # scale, out and its strides, threads
    )  # fmt: skip


def argument_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None) -> str | None:
    """What is wrong with the arguments of a short-sequence operator (this one or
    `qkv.native.short_wide`'s), or None (the kernel reads raw memory: any mismatch must be
    refused before it runs). Plain comparisons: it runs on every call."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v must be 4-D"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return "q, k and v must be bfloat16"
    N, H, _, E = q.shape
    _, G, S, _ = k.shape
    Ev = v.shape[3]
    if (q.stride(3) != 1 and E > 1) or (k.stride(3) != 1 and E > 1) or (v.stride(3) != 1 and Ev > 1):
        return "q, k and v need a contiguous last dim"
    if G <= 0 or H % G:
        return f"the query heads ({H}) must be a multiple of the key/value heads ({G})"
    if k.shape != (N, G, S, E) or v.shape[:3] != (N, G, S):
        return f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if E < 1 or Ev < 1:
        return "E and Ev must be positive"
    masked = key_valid is not None and key_valid.numel() > 0
    if masked and (key_valid.dtype != torch.bool or key_valid.dim() != 2 or key_valid.shape[1] != S or key_valid.shape[0] not in (1, N)):  # type: ignore[union-attr]
        return f"key_valid must be bool (N | 1, S) = ({N} | 1, {S}), not {key_valid.dtype} {tuple(key_valid.shape)}"  # type: ignore[union-attr]
    if q.device.type != "cpu" or k.device.type != "cpu" or v.device.type != "cpu":
        return "every tensor must be on the CPU"
    return None


def unit_last_stride(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors with a contiguous last dim, as the kernels read rows (a copy only of one
    that has none, e.g. a transposed view)."""
    return tuple(x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous() for x in tensors)


def empty_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output (N, H, L, Ev) as a view of a (N, L, H, Ev) tensor: a row's heads side by side."""
    N, H, L, _ = q.shape
    return q.new_empty(N, L, H, v.shape[-1], dtype=torch.bfloat16).transpose(1, 2)  # (N, H, L, Ev)


def run_kernel(
    library: ctypes.CDLL, stem: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    key_valid: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """A short-sequence kernel (``stem``: "short_bf16" or "short_wide", its operator
    qkv::<stem> and its entry point qkv_<stem>_forward) on checked arguments: out
    (N, H, L, Ev) bfloat16."""
    problem = argument_problem(q, k, v, key_valid)
    if problem is not None:
        raise ValueError(f"qkv::{stem}: {problem}")
    N, H, L, E = q.shape
    G, S, Ev = k.shape[1], k.shape[2], v.shape[3]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # a last dim of one value, any stride
    valid = None if key_valid is None or key_valid.numel() == 0 else key_valid.contiguous()
    out = empty_output(q, v)
    status = _entry(library, f"qkv_{stem}_forward")(
        q.data_ptr(), compiled.strides(q), k.data_ptr(), compiled.strides(k), v.data_ptr(), compiled.strides(v),
        None if valid is None else valid.data_ptr(), 0 if valid is None else valid.shape[0],
        N, H, G, L, E, S, Ev, float(scale), out.data_ptr(), compiled.strides(out), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"qkv::{stem} could not allocate its working buffers")
    return out


def _run(
    library: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The kernel on checked arguments: out (N, H, L, Ev) bfloat16."""
    return run_kernel(library, "short_bf16", q, k, v, key_valid, scale)


# the schema is written out: torch 2.5 infers none from `list[...]` or `X | None` annotations
@torch.library.custom_op("qkv::short_bf16", mutates_args=(), schema="(Tensor q, Tensor k, Tensor v, Tensor? key_valid, float scale) -> Tensor")
def _short_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Exact bf16 attention output (N, H, L, Ev), a view of a (N, L, H, Ev) tensor, of q
    (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) with key_valid (N | 1, S) bool or None.
    Builds the kernel on first use; raises RuntimeError when it cannot run here."""
    reason = compiled.static_reason(q.dtype, q.device)
    library = compiled.loaded_or_raise(reason or _module(), KERNEL_NAME)
    return _run(library, q, k, v, key_valid, scale)


@_short_op.register_fake
def _(q, k, v, key_valid, scale):  # type: ignore[no-untyped-def]
    problem = argument_problem(q, k, v, key_valid)
    if problem is not None:
        raise ValueError(f"qkv::short_bf16: {problem}")
    return empty_output(q, v)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """Output (N, H, L, Ev) bfloat16 of q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev)
    bfloat16 (any strides), where batch row n sees the keys with ``key_valid[n]`` True
    (key_valid (N | 1, S) bool, None: all keys). The output is a (N, H, L, Ev) view of a
    (N, L, H, Ev) tensor, so the heads of a row sit side by side as a multi-head layer
    concatenates them. None when the kernel is unavailable (`unavailable_reason`)."""
    if unavailable_reason(q.dtype, q.device) is not None:
        return None
    library = _module()
    if isinstance(library, str):
        return None
    q, k, v = unit_last_stride(q, k, v)
    if compiled.direct_call(q, k, v, *(() if key_valid is None else (key_valid,))):
        return _run(library, q, k, v, key_valid, float(scale))
    return torch.ops.qkv.short_bf16(q, k, v, key_valid, float(scale))
