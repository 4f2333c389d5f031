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
building anything; `forward` builds on first use (about a minute, one line on stderr) and
returns None when the build or the self-check against float64 failed; the caller then runs
SDPA.

Shape legend: N batch rows, H query heads, G key/value heads, L queries, S keys, E / Ev head
dims of q, k / v.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from qkv.native import build as compiled
from qkv.native import switches

__all__ = ["KERNEL_NAME", "MAX_KEYS", "describe", "forward", "unavailable_reason"]

# qkv.backends.disabled("short_bf16") switches it off (benchmarks time SDPA so);
# QKV_NO_COMPILED_KERNELS=1 too.

KERNEL_NAME = "short-sequence bf16 kernel"
# The kernel keeps 16 rows' scores over all keys; with many keys PyTorch's flash kernel pays
# back its set-up. Measured (B = 32, H = 12, E = 32, key padding, 1 thread, CPU time, load ~4;
# SDPA / this kernel, ms): L = S = 20: 1.31 / 0.89; 62: 6.96 / 2.83; 110: 12.9 / 7.0;
# 256: 35.2 / 34.3; 512: 108 / 99. Above 512 it was not measured.
MAX_KEYS = 512
# the kernel programs the AMX tiles itself (compiled.CFLAGS covers AVX-512 only)
_AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]
# the kernel's source and build flags (`qkv.native.build`)
NATIVE = compiled.NativeKernel(
    "short_bf16", Path(__file__).with_name("short_bf16.cpp"), KERNEL_NAME, cflags=(*compiled.CFLAGS, *_AMX_FLAGS)
)

# the outcome of the one build attempt of this process: the module, or why there is none
_built: dict[str, ModuleType | str] = {}


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device, or None if it will
    (possibly after building it on first use). Never builds.

    >>> unavailable_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    reason = switches.off_reason("short_bf16") or compiled.static_reason(dtype, device)
    return reason or compiled.build_failure(_built)


def describe(dtype: torch.dtype, device: torch.device) -> str:
    """The kernel in words for `qkv.explain`, or why SDPA runs instead; no build.

    >>> describe(torch.float32, torch.device("cpu")).startswith("PyTorch's SDPA")
    True
    """
    reason = unavailable_reason(dtype, device)
    if reason is None:
        return f"the {KERNEL_NAME} (C++, AMX tiles){compiled.first_use_note(_built)}"
    return f"PyTorch's SDPA (the {KERNEL_NAME} does not run: {reason})"


def _build() -> ModuleType | str:
    return compiled.build(NATIVE, _check)


def _check(module: ModuleType) -> str | None:
    if not module.tiles_permitted():
        return "Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return _self_check(module)


def _self_check(module: ModuleType) -> str | None:
    """Run the kernel once on an awkward problem against float64 math: None, or what went
    wrong (a wrong layout or instruction would give wrong numbers, never an error)."""
    gen = torch.Generator().manual_seed(0)
    N, H, G, L, S, E, Ev = 3, 4, 2, 7, 37, 33, 20
    q = torch.randn(N, L, H, E, generator=gen).to(torch.bfloat16).transpose(1, 2)  # (N, H, L, E), strided
    k = torch.randn(N, G, S, E, generator=gen).to(torch.bfloat16)
    v = torch.randn(N, G, S, Ev, generator=gen).to(torch.bfloat16)
    valid = torch.rand(N, S, generator=gen) < 0.7  # (N, S)
    valid[1] = False  # a batch row whose queries see nothing
    out = torch.full((N, H, L, Ev), float("nan"), dtype=torch.bfloat16)
    module.forward(q, k, v, valid, 0.2, out)
    kd, vd = (x.double().repeat_interleave(H // G, dim=1) for x in (k, v))  # (N, H, S, *)
    s = (q.double() @ kd.transpose(-1, -2) * 0.2).masked_fill(~valid[:, None, None, :], float("-inf"))  # (N, H, L, S)
    want = torch.nan_to_num(torch.softmax(s, dim=-1)) @ vd  # (N, H, L, Ev)
    error = (out.double() - want).abs().max().item()
    if not error < 3e-2:  # also catches a NaN left in out
        return f"its self-check failed (output error {error:.3g})"
    return None


def _module() -> ModuleType | str:
    return compiled.built_once(_built, _build)


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
    module = _module()
    if isinstance(module, str):
        return None
    N, H, L, _ = q.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(N, L, H, v.shape[-1], dtype=torch.bfloat16, device=q.device).transpose(1, 2)  # (N, H, L, Ev)
    valid = torch.empty(0, dtype=torch.bool) if key_valid is None else key_valid
    module.forward(q, k, v, valid, float(scale), out)
    return out
