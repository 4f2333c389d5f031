"""A fused bfloat16 forward for the CPU block engine, compiled once on this machine.

PyTorch's CPU flash kernel, called per tile by `qkv.backends.blocks.engine`, reaches about 16 % of
the bf16 matrix-multiply rate on the engine's calls, and a tile of 192 rows computes the
corners of a band that no row sees. This kernel (``interval_bf16.cpp``) takes the mask as one
key interval lo..hi per query row (`Mask.row_intervals`, kept by the plan as
``BlockPlan.intervals``) and, per block of 64 queries, computes only the keys that its rows'
intervals touch, in a transposed layout (keys as rows, the block's queries as columns):
S^T = K Q^T on the AMX units with a float32 result (``at::native::cpublas::brgemm``), a
softmax in float32 with 16 queries per vector that keeps each row's own keys (one exact
step for a span of up to 1,024 keys, online in chunks of 512 beyond), P in bfloat16, and
O^T = V^T P^T on the AMX units (FlashAttention-2, algorithm 1). Python cannot
reach that micro-kernel: PyTorch has no bf16 x bf16 -> float32 product on CPU
(``mm(out_dtype=)`` is not implemented there), so the source is compiled with
``torch.utils.cpp_extension`` the first time it is needed (about a minute, one message on
stderr) and cached under PyTorch's extension directory in a folder named by the source's
hash, so any change of the source rebuilds it.

`unavailable_reason` says why it cannot run (not bf16, no AMX, no compiler, the build or
its self-check failed) without building anything; `forward` builds on first use. The
engine falls back to its per-tile path whenever the kernel is unavailable; the backward
always takes the engine's own path from the saved output and lse.

Shape legend: N batch rows, H heads (key/value heads expanded), L queries, S keys, E / Ev
head dims of q, k / v.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from qkv.native import build as compiled
from qkv.native import switches

__all__ = ["KERNEL_NAME", "describe", "forward", "unavailable_reason"]

# qkv.backends.disabled("interval_bf16") switches it off (benchmarks/bf16_engine.py times the
# per-tile path so); the environment variable QKV_NO_COMPILED_KERNELS=1 too, without a build.

KERNEL_NAME = "fused bf16 interval kernel"
# the kernel's source and build (`qkv.native.build`)
NATIVE = compiled.NativeKernel("interval_bf16", Path(__file__).with_name("interval_bf16.cpp"), KERNEL_NAME)
# Causal squares run it too. PyTorch's flash kernel computes a causal square in one call that
# skips the blocks above the diagonal; the first version of this kernel (scores per query row,
# one product per 64 keys) lost to it there (varlen causal of 64 documents 87 vs 74 ms, of 16
# documents 198 vs 124, quiet, 2 threads, n = 16,384), and such plans kept the per-tile path.
# The transposed kernel wins on them (n = 16,384, H = 8, E = 64, one thread, interleaved,
# load 6; kernel / per-tile ms): varlen causal of 64 documents 138 / 247, of 16 documents
# 303 / 408, one causal square 2,060 / 2,044 (a tie); sliding_window(256, 256) 169 / 438.

# the outcome of the one build attempt of this process: the module, or why there is none
_built: dict[str, ModuleType | str] = {}


def _static_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the kernel cannot run for these inputs, from facts that need no build."""
    return switches.off_reason("interval_bf16") or compiled.static_reason(dtype, device, needs_onednn=True)


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
    return reason or compiled.build_failure(_built)


def describe(dtype: torch.dtype, device: torch.device, has_intervals: bool) -> str:
    """The engine's forward kernel for such inputs in words (`qkv.explain`), without building.

    >>> describe(torch.float32, torch.device("cpu"), True).startswith("PyTorch's CPU flash kernel")
    True
    """
    reason = unavailable_reason(dtype, device, has_intervals)
    if reason is None:
        return f"the {KERNEL_NAME} (C++, AMX micro-kernels){compiled.first_use_note(_built)}"
    return f"PyTorch's CPU flash kernel per tile (the {KERNEL_NAME} does not run: {reason})"


def _build() -> ModuleType | str:
    """Compile (or load the cached build of) the kernel and check it: the module, or why not."""
    return compiled.build(NATIVE, _check)


def _check(module: ModuleType) -> str | None:
    return compiled.onednn_packing_reason(module) or _self_check(module)


def _self_check(module: ModuleType) -> str | None:
    """Run the kernel once on a small problem against float64 math: None, or what went wrong.
    A wrong packed layout on some CPU would give wrong numbers, never an error; this turns it
    into a reason to fall back."""
    gen = torch.Generator().manual_seed(0)
    # a window with a row that sees nothing and a tail block (one softmax step per block), with
    # a negative scale (the max pass then takes the lowest score) and the output in bf16; then
    # a causal square of 1,500 keys (diagonals, and spans past 1,024 keys: online steps)
    rows = torch.arange(70)
    window = ((rows - 50).clamp(min=0).view(1, 70), (rows + 60).view(1, 70))  # (1, L) each
    window[1][0, 3] = -1
    rows = torch.arange(1500)
    causal = (torch.zeros(1, 1500, dtype=torch.long), rows.view(1, 1500))
    for (lo, hi), S, Ev, scale, rounded in ((window, 150, 40, -0.125, True), (causal, 1500, 64, 0.125, False)):
        reason = _check_one(module, gen, lo, hi, S, Ev, scale, rounded)
        if reason is not None:
            return reason
    return None


def _check_one(
    module: ModuleType, gen: torch.Generator, lo: torch.Tensor, hi: torch.Tensor, S: int, Ev: int, scale: float, rounded: bool
) -> str | None:
    N, H, L, E = 1, 2, lo.shape[1], 64
    q, k = (torch.randn(N, H, T, E, generator=gen).to(torch.bfloat16) for T in (L, S))
    v = torch.randn(N, H, S, Ev, generator=gen).to(torch.bfloat16)
    out, lse = module.forward(q, k, v, lo, hi, scale, rounded)
    if out.dtype != (torch.bfloat16 if rounded else torch.float32):
        return f"its self-check failed (the output came in {out.dtype})"
    keys = torch.arange(S).view(1, S)
    visible = (keys >= lo.view(L, 1)) & (keys <= hi.view(L, 1))  # (L, S)
    s = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))  # (N, H, L, S)
    want_lse = torch.logsumexp(s, dim=-1)  # (N, H, L)
    want = torch.nan_to_num(torch.softmax(s, dim=-1)) @ v.double()  # (N, H, L, Ev)
    out_err = (out.double() - want).abs().max().item()
    finite = torch.isfinite(want_lse)
    lse_err = (lse.double()[finite] - want_lse[finite]).abs().max().item()
    if not (out_err < 3e-2 and lse_err < 1e-3 and bool((lse[~finite] == float("-inf")).all())):
        return f"its self-check failed (output error {out_err:.3g}, lse error {lse_err:.3g})"
    return None


def _module() -> ModuleType | str:
    return compiled.built_once(_built, _build)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float,
    rounded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Output (N, H, L, Ev) and lse (N, H, L), float32, of q (N, H, L, E), k (N, H, S, E),
    v (N, H, S, Ev) bfloat16, where query i of batch row n sees keys lo[n, i]..hi[n, i]
    (lo, hi (N | 1, L) int64; an empty interval gives output 0 and lse -inf). With ``rounded``
    the output is bfloat16 (each value the float32 one rounded to nearest even), for callers
    that run no backward: half the bytes to write and no copy to round. None when the kernel
    is unavailable (`unavailable_reason`): the caller falls back."""
    if unavailable_reason(q.dtype, q.device) is not None:
        return None
    module = _module()
    if isinstance(module, str):
        return None
    q, k = compiled.padded_heads(q), compiled.padded_heads(k)  # (N, H, *, E rounded up to 32)
    v = v if v.stride(-1) == 1 else v.contiguous()
    with torch.no_grad():
        out, lse = module.forward(q, k, v, lo.to(torch.long), hi.to(torch.long), float(scale), bool(rounded))
    return out, lse
