"""The short-sequence bf16 kernel for CPUs without AMX, compiled per tier.

On AVX2 + FMA machines (AMD EPYC, most laptops) and AVX-512 ones without the bf16
instructions, PyTorch's bf16 products are emulated, and qkv computes a bf16 request in float32
(`qkv.native.machine.compute_dtype`); on AVX-512 BF16 without AMX (AMD Zen 4 and 5) they are
native, but PyTorch's bf16 SDPA is slower than its float32 one at these sizes. For the calls
the AMX kernel `qkv.native.short_bf16` takes on ``amx`` machines (a sentence encoder's many short rows: bf16 on CPU, at most `MAX_KEYS` keys, no mask
or key padding, no score terms, dropout, gradient, weights or lse), this kernel
(``short_wide.cpp``) reads the bf16 q, k and v directly, widens them in registers, computes
in float32 (products, exact softmax, sums) and rounds the output to bf16 once, where the
portable route copies q, k and v to float32, runs PyTorch's CPU flash kernel on the copies
and rounds its output: two more passes over memory. Keys a batch row may not see are left out
of its packed keys, so key padding saves their work too.

Tiers: the source is compiled per tier with that tier's flags only
(`qkv.native.build.TIER_CFLAGS`): AVX2 + FMA (8 float lanes) and AVX-512 (16 lanes). The build
that runs is the machine's (`qkv.native.machine.cpu_features`, which ``QKV_CPU_TIER`` can
lower), or the one ``tier=`` asks for: a build for a lower tier runs on a higher machine, so
both are tested on an AMX one.

Measured (``benchmarks/lower_tiers.py``: B = 32, H = 12, L = S = 128, E = 32, 2 threads, an
AMX Xeon forced to the avx2 tier, quiet): bf16 at 1.17-1.28x float32's speed without a mask,
1.38-1.53x with key padding, where widening to float32 copies for SDPA gave 0.93x and 0.95x.

`unavailable_reason` says why it cannot run without building; `forward` builds on first use
(seconds, one note on the ``qkv`` logger) and returns None when the build or its self-check
against float64 failed; the caller then computes in float32 through SDPA. The kernel is the
operator ``torch.ops.qkv.short_wide`` (with a fake implementation for tracing; no gradient).
``qkv.backends.disabled("short_wide")`` switches it off; ``QKV_NO_COMPILED_KERNELS=1`` too.

Shape legend: N batch rows, H query heads, G key/value heads, L queries, S keys, E / Ev head
dims of q, k / v.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from qkv.native import build as compiled
from qkv.native import short_bf16

__all__ = ["DTYPES", "KERNEL_NAME", "MAX_KEYS", "TIERS", "first_use_note", "forward", "unavailable_reason"]

KERNEL_NAME = "short-sequence bf16 kernel with float32 products"
# the calls it takes are the AMX kernel's (the dispatcher asks the same questions of both)
MAX_KEYS = short_bf16.MAX_KEYS
TIERS: tuple[str, ...] = ("avx2", "avx512")
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16,)

# its builds per tier, one attempt each per process
_TIERED = compiled.TieredKernel(
    "short_wide", Path(__file__).with_name("short_wide.cpp"), KERNEL_NAME, TIERS, DTYPES, "short_wide",
    lambda library: short_bf16.self_check(functools.partial(_run, library)),
)  # fmt: skip
first_use_note = _TIERED.first_use_note


def unavailable_reason(dtype: torch.dtype, device: torch.device, tier: str | None = None) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device at ``tier`` (None: the
    tier qkv uses now), or None if it will (possibly after building it on first use). Never builds.

    >>> unavailable_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    return _TIERED.unavailable_reason(dtype, device, tier)


def _run(
    library: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The kernel on checked arguments: out (N, H, L, Ev) bfloat16, a view of (N, L, H, Ev)."""
    return short_bf16.run_kernel(library, "short_wide", q, k, v, key_valid, scale)


# the schema is written out: torch 2.5 infers none from `X | None` annotations
@torch.library.custom_op(
    "qkv::short_wide", mutates_args=(), schema="(Tensor q, Tensor k, Tensor v, Tensor? key_valid, float scale, str tier) -> Tensor"
)  # fmt: skip
def _short_wide_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, scale: float, tier: str
) -> torch.Tensor:
    """Exact bf16 attention output (N, H, L, Ev), a view of a (N, L, H, Ev) tensor, of q
    (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) with key_valid (N | 1, S) bool or None,
    computed in float32 by the build of ``tier`` ("" for the machine's). Builds the kernel on
    first use; raises RuntimeError when it cannot run here."""
    wanted = tier or None
    reason = compiled.tier_reason(TIERS, q.dtype, q.device, DTYPES, wanted)
    built = _TIERED.tier(wanted)
    library = compiled.loaded_or_raise(reason or _TIERED.module(built or ""), KERNEL_NAME)
    return _run(library, q, k, v, key_valid, scale)


@_short_wide_op.register_fake
def _(q, k, v, key_valid, scale, tier):  # type: ignore[no-untyped-def]
    problem = short_bf16.argument_problem(q, k, v, key_valid)
    if problem is not None:
        raise ValueError(f"qkv::short_wide: {problem}")
    return short_bf16.empty_output(q, v)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, scale: float, tier: str | None = None
) -> torch.Tensor | None:
    """Output (N, H, L, Ev) bfloat16 of q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev)
    bfloat16 (any strides with a contiguous last dim), where batch row n sees the keys with
    ``key_valid[n]`` True (key_valid (N | 1, S) bool, None: all keys); a row that sees no key
    gets zeros. The output is a (N, H, L, Ev) view of a (N, L, H, Ev) tensor, as
    `qkv.native.short_bf16.forward`'s. ``tier``: the build to run (a tier of ``TIERS`` at or
    below the machine's; None: the tier qkv uses now). None when the kernel is unavailable
    (`unavailable_reason`)."""
    _TIERED.check_tier(tier)
    if unavailable_reason(q.dtype, q.device, tier) is not None:
        return None
    built = _TIERED.tier(tier)
    assert built is not None  # unavailable_reason checked it
    library = _TIERED.module(built)
    if isinstance(library, str):
        return None
    q, k, v = short_bf16.unit_last_stride(q, k, v)
    if compiled.direct_call(q, k, v, *(() if key_valid is None else (key_valid,))):
        return _run(library, q, k, v, key_valid, float(scale))
    return torch.ops.qkv.short_wide(q, k, v, key_valid, float(scale), tier or "")
