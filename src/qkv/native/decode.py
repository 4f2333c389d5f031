"""The decode step in C++ at the memory read rate, in float32 and bfloat16, on every CPU tier.

A decode step (L <= 16 queries against a cache of S keys) reads each key and value once and
does a few flops per byte: its speed is the rate it reads the cache. `qkv.backends.decode`
runs it in PyTorch ops (PyTorch's CPU flash kernel per chunk of keys, merged by lse); this
kernel (``decode.cpp``) does the same in one call: one task per (batch row, KV head, split of
the keys) reads each K/V block once for the R = H / G query heads of its group, bfloat16 is
widened to float32 in registers (never copied), each split keeps its max / sum / partial
output and the splits merge by lse in a fixed order, so two runs at one thread count give equal
bits. It applies the masks the decode backend takes (per-query key intervals from causal and
sliding windows, key padding), sinks, a softcap (score -> softcap * tanh(score / softcap); tanh
is a vectorised float32 one, within 3 ulp of float64's) and ALiBi (- slope_h * |p_i - t|), in
qkv's order of score terms (softcap, bias, mask); no other bias and no gradient (those keep the
PyTorch path). It reads K/V from a cache
(N, G, S, E) or through a block table from a paged pool (num_blocks, P, G, E), in the same
blocks of keys either way, so paged and contiguous give equal bits.

Tiers. The source is written for each of ``TIERS`` and compiled per tier with that tier's
flags only (`qkv.native.build.TIER_CFLAGS`): AVX2 + FMA (8 float lanes, AMD EPYC), AVX-512
(16 lanes) and, on ``amx`` machines, AVX-512 with the bf16 dot product ``vdpbf16ps`` for the
bfloat16 scores (read from the cache's bytes, no widening). The build that runs is the machine's
(`qkv.native.machine.cpu_features`, which ``QKV_CPU_TIER`` can lower), or the one ``tier=``
asks for: a build for a lower tier runs on a higher machine, so the AVX2 build is tested on an
AVX-512 one. Builds are kept per tier, each with the tier in its cache key.

Measured (benchmarks/decode.py --portable, B=1 Hq=32 G=8 E=128, S = 32k, 2 threads on a shared
2-core AMX machine at load 4-8, so ratios within one run only): bf16 75 % of the read bandwidth
and 3.1x SDPA where the PyTorch ops reached 43 % and 2.1x; float32 95 % / 3.5x against 73 % /
2.4x; the AVX2 build (QKV_CPU_TIER=avx2) bf16 73 % / 3.3x against the ops' 10 % / 0.37x (they
widen waves of keys to float32 there). At S = 8k bf16 gave 44 % / 1.4x (ops 37 % / 0.7x).
With softcap 30 (same shape, load 2-3): float32 3.1x and bf16 2.7x the uncapped SDPA step, the
ops 0.7x / 1.4x (before the kernel took softcaps, the step went to the math path: 1.5 s against
SDPA's 68 ms). Paged (`qkv.PagedKVCache`, 16-key blocks): a fragmented pool (a run per block)
1.6x / 1.2x SDPA on the contiguous keys, the ops 0.56x / 0.51x; the pool's layout (num_blocks,
P, G, E), a head's rows G*E apart, reads at about half the contiguous cache's rate, shuffled or not.

`unavailable_reason` says why it cannot run without building; `forward` builds on first use
(seconds, one note on the ``qkv`` logger) and returns None when the build or its self-check
against float64 failed; the decode backend then runs its PyTorch ops. The kernel is the
operator ``torch.ops.qkv.decode`` (with a fake implementation for tracing).
``qkv.backends.disabled("native_decode")`` switches it off; ``QKV_NO_COMPILED_KERNELS=1`` too.

Shape legend: N batch rows, H query heads, G key/value heads, L queries, S keys, E / Ev head
dims of q, k / v.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from qkv.native import build as compiled
from qkv.native.machine import cpu_features

__all__ = ["DTYPES", "KERNEL_NAME", "TIERS", "first_use_note", "forward", "tanh", "unavailable_reason"]

KERNEL_NAME = "native decode kernel"
# the tiers it is written for, lowest first: the amx build adds vdpbf16ps (AVX-512 BF16) for
# the bf16 scores; an avx512 machine without those instructions runs the avx512 build
TIERS: tuple[str, ...] = ("avx2", "avx512", "amx")
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
_SOURCE = Path(__file__).with_name("decode.cpp")


def _tier(tier: str | None) -> str | None:
    """The tier whose build runs for ``tier`` (None: the tier qkv uses now; its amx build needs
    AVX-512 BF16, which every AMX CPU so far has: without it, the avx512 build)."""
    built = compiled.build_tier(TIERS, tier)
    if built == "amx" and tier is None and not cpu_features().avx512_bf16:
        return "avx512"
    return built


# its builds per tier, one attempt each per process
_TIERED = compiled.TieredKernel(
    "decode", _SOURCE, KERNEL_NAME, TIERS, DTYPES, "native_decode", lambda library: _check(library), pick=_tier
)
first_use_note = _TIERED.first_use_note


def unavailable_reason(dtype: torch.dtype, device: torch.device, tier: str | None = None) -> str | None:
    """Why the kernel will not run for inputs of this dtype and device at ``tier`` (None: the
    tier qkv uses now), or None if it will (possibly after building it on first use). Never builds.

    >>> unavailable_reason(torch.float16, torch.device("cpu"))
    'it runs float32 and bfloat16 only (inputs are float16)'
    """
    return _TIERED.unavailable_reason(dtype, device, tier)


def _module(tier: str) -> ctypes.CDLL | str:
    return _TIERED.module(tier)


def _check(library: ctypes.CDLL) -> str | None:
    """Run the kernel once on an awkward problem against float64 math: None, or what went
    wrong (a wrong layout or instruction would give wrong numbers, never an error)."""
    gen = torch.Generator().manual_seed(0)
    N, H, G, L, S, E, Ev = 2, 6, 2, 3, 150, 37, 20
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        q = torch.randn(N, L, H, E, generator=gen).to(dtype).transpose(1, 2)  # (N, H, L, E), strided
        k = torch.randn(N, G, S + 5, E, generator=gen).to(dtype)[:, :, :S]  # (N, G, S, E): a prefix
        v = torch.randn(N, G, S, Ev, generator=gen).to(dtype)
        lo = torch.tensor([[0, 40, 149]])  # (1, L)
        hi = torch.tensor([[99, 149, 148]])  # (1, L): the last query sees nothing
        out, lse = _run(library, q, k, v, 0.3, 0, S, 3, lo, hi, None, None)
        kd, vd = (x.double().repeat_interleave(H // G, dim=1) for x in (k, v))  # (N, H, S, *)
        j = torch.arange(S)
        hidden = (j < lo[0, :, None]) | (j > hi[0, :, None])  # (L, S)
        s = (q.double() @ kd.transpose(-1, -2) * 0.3).masked_fill(hidden, float("-inf"))  # (N, H, L, S)
        want = torch.nan_to_num(torch.softmax(s, dim=-1)) @ vd  # (N, H, L, Ev)
        error = (out.double() - want).abs().max().item()
        if not error < tolerance:  # also catches a NaN left in out
            return f"its self-check failed ({str(dtype).removeprefix('torch.')} output error {error:.3g})"
        if not bool(torch.isneginf(lse[:, :, 2]).all()):
            return "its self-check failed (a row with no visible key has a finite lse)"
        # the same keys in a shuffled pool of 16-key blocks, scores capped at 1.5
        P, blocks = 16, -(-S // 16)
        order = torch.randperm(N * blocks, generator=gen)
        k_pool = torch.zeros(N * blocks * P, G, E, dtype=dtype)  # (num_blocks * P, G, E)
        v_pool = torch.zeros(N * blocks * P, G, Ev, dtype=dtype)
        table = order.reshape(N, blocks)  # (N, blocks)
        slots = (table[:, :, None] * P + torch.arange(P)).reshape(N, -1)[:, :S]  # (N, S): each key's pool row
        k_pool[slots] = k.transpose(1, 2)  # (N, S, G, E) into their slots
        v_pool[slots] = v.transpose(1, 2)
        k_pool, v_pool = k_pool.reshape(-1, P, G, E), v_pool.reshape(-1, P, G, Ev)  # (num_blocks, P, G, E | Ev)
        out, _ = _run(library, q, k_pool, v_pool, 0.3, 0, S, 3, lo, hi, None, None, 1.5, table)
        capped = torch.tanh(q.double() @ kd.transpose(-1, -2) * 0.3 / 1.5) * 1.5  # (N, H, L, S)
        want = torch.nan_to_num(torch.softmax(capped.masked_fill(hidden, float("-inf")), dim=-1)) @ vd  # (N, H, L, Ev)
        error = (out.double() - want).abs().max().item()
        if not error < tolerance:
            return f"its self-check failed ({str(dtype).removeprefix('torch.')} paged softcap output error {error:.3g})"
    return None


@functools.cache
def _entry(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's entry point with its C signature (decode.cpp)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return compiled.function(
        library, "qkv_decode_forward", ctypes.c_int,
        p, p, p, p, p, p, i64,  # q, k, v and their strides, bf16 or float32
        i64, i64, i64, i64, i64, i64, i64,  # N, H, G, L, E, S, Ev
        i64, i64, i64, ctypes.c_double,  # start, stop, splits, scale
        p, p, i64, p, i64, p, i64,  # lo, hi and their rows, valid and its rows, sinks and their rows
        p, p, p, i64,  # scratch, out, lse, threads
        ctypes.c_double, p, i64, i64,  # softcap (0: none), block table, its row stride, block size
        p, p, i64,  # ALiBi slopes, query positions and their rows
    )  # fmt: skip


@functools.cache
def _tanh_entry(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's tanh (the softcap's), for tests."""
    p = ctypes.c_void_p
    return compiled.function(library, "qkv_decode_tanh", None, p, p, ctypes.c_int64)


def _keys(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor | None) -> tuple[int, int]:
    """(G, S): key/value heads and key positions, of a cache k (N, G, S, E) or, through a block
    table (N, blocks), of a pool k (num_blocks, P, G, E) (S = blocks * P, the table's reach)."""
    if table is None:
        return k.shape[1], k.shape[2]
    return k.shape[2], (table.shape[1] if table.dim() == 2 else 0) * k.shape[1]


def _argument_problem(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, stop: int, splits: int,
    lo: torch.Tensor | None, hi: torch.Tensor | None, valid: torch.Tensor | None, sinks: torch.Tensor | None,
    softcap: float = 0.0, table: torch.Tensor | None = None, slopes: torch.Tensor | None = None,
    qpos: torch.Tensor | None = None,
) -> str | None:
    """What is wrong with the operator's arguments, or None (the kernel reads raw memory: any
    mismatch must be refused before it runs)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v must be 4-D"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v must share one dtype, float32 or bfloat16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    N, H, L, E = q.shape
    G, S = _keys(q, k, table)
    if G <= 0 or H % G:
        return f"the query heads ({H}) must be a multiple of the key/value heads ({G})"
    if table is not None:
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != N:
            return f"the block table must be int64 (N, blocks) = ({N}, blocks), not {table.dtype} {tuple(table.shape)}"
        if k.shape[2:] != (G, E) or v.shape[:3] != k.shape[:3] or k.shape[1] < 1:
            return f"pools do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (num_blocks, P, G, E | Ev)"
    elif k.shape != (N, G, S, E) or v.shape[:3] != (N, G, S):
        return f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (softcap == 0.0 or 0.0 < softcap < math.inf):
        return f"softcap must be positive and finite (0: none), got {softcap}"
    if (slopes is None) != (qpos is None):
        return "ALiBi's slopes and query positions come together"
    if slopes is not None and (not slopes.is_floating_point() or tuple(slopes.shape) != (H,)):
        return f"ALiBi's slopes must be float ({H},), not {slopes.dtype} {tuple(slopes.shape)}"
    if qpos is not None and (qpos.dtype != torch.int64 or qpos.dim() != 2 or qpos.shape[1] != L or qpos.shape[0] not in (1, N)):
        return f"query positions must be int64 (N | 1, L) = ({N} | 1, {L}), not {qpos.dtype} {tuple(qpos.shape)}"
    if E < 1 or v.shape[3] < 1:
        return "E and Ev must be positive"
    if (k.stride(3) != 1 and E > 1) or (v.stride(3) != 1 and v.shape[3] > 1):
        return "k and v need a contiguous last dim"
    if not 0 <= start <= stop <= S or splits < 1:
        return f"keys {start}..{stop} of {S} in {splits} splits is not a range"
    for name, bound in (("lo", lo), ("hi", hi)):
        if bound is not None and (bound.dtype != torch.int64 or bound.dim() != 2 or bound.shape[1] != L or bound.shape[0] not in (1, N)):
            return f"{name} must be int64 (N | 1, L) = ({N} | 1, {L}), not {bound.dtype} {tuple(bound.shape)}"
    if (lo is None) != (hi is None):
        return "lo and hi come together"
    if valid is not None and (valid.dtype != torch.bool or valid.dim() != 2 or valid.shape[1] != S or valid.shape[0] not in (1, N)):
        return f"valid must be bool (N | 1, S) = ({N} | 1, {S}), not {valid.dtype} {tuple(valid.shape)}"
    if sinks is not None and (sinks.dim() != 2 or sinks.shape[1] != H or sinks.shape[0] not in (1, N)):
        return f"sinks must be (N | 1, H) = ({N} | 1, {H}), not {tuple(sinks.shape)}"
    tensors = (q, k, v, *(t for t in (lo, hi, valid, sinks, table, slopes, qpos) if t is not None))
    if any(t.device.type != "cpu" for t in tensors):
        return "every tensor must be on the CPU"
    return None


def _table_problem(
    table: torch.Tensor, blocks: int, P: int, start: int, stop: int, lo: torch.Tensor | None, hi: torch.Tensor | None
) -> str | None:
    """Whether every block the kernel reads is in the pool (reads the table: real tensors only):
    row n reads positions from max(start, min lo[n]) to min(stop, max hi[n] + 1), in the blocks
    that hold them (entries past them, e.g. the zeros after a short sequence's blocks, are never read)."""
    if table.numel() == 0:
        return None
    first = torch.full((table.shape[0],), start, dtype=torch.int64)  # (N,)
    last = torch.full((table.shape[0],), stop, dtype=torch.int64)  # (N,)
    if lo is not None and hi is not None:
        first = torch.maximum(first, lo.amin(dim=1).expand(table.shape[0]))
        last = torch.minimum(last, hi.amax(dim=1).expand(table.shape[0]) + 1)
    column = torch.arange(table.shape[1])  # (blocks,): holds positions column * P .. column * P + P - 1
    read = (column[None] * P < last[:, None]) & ((column[None] + 1) * P > first[:, None])  # (N, blocks)
    outside = read & ((table < 0) | (table >= blocks))
    if bool(outside.any()):
        n, c = (int(i) for i in outside.nonzero()[0])
        return f"block table entry [{n}, {c}] = {int(table[n, c])} is not a block of the pool (0 .. {blocks - 1})"
    return None


def _empty_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out (N, H, L, Ev) and lse (N, H, L), float32 (v: a cache's or a pool's, Ev last)."""
    N, H, L, _ = q.shape
    return q.new_empty(N, H, L, v.shape[3], dtype=torch.float32), q.new_empty(N, H, L, dtype=torch.float32)


def _run(
    library: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int, stop: int,
    splits: int, lo: torch.Tensor | None, hi: torch.Tensor | None, valid: torch.Tensor | None, sinks: torch.Tensor | None,
    softcap: float = 0.0, table: torch.Tensor | None = None, slopes: torch.Tensor | None = None,
    qpos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on checked arguments: out (N, H, L, Ev) and lse (N, H, L), float32."""
    problem = _argument_problem(q, k, v, start, stop, splits, lo, hi, valid, sinks, softcap, table, slopes, qpos)
    if problem is None and table is not None:
        problem = _table_problem(table, k.shape[0], k.shape[1], start, stop, lo, hi)
    if problem is not None:
        raise ValueError(f"qkv::decode: {problem}")
    N, H, L, E = q.shape
    (G, S), Ev = _keys(q, k, table), v.shape[3]
    # the kernel reads unit strides along the head dims (q too: a row is read as E values in a
    # row); other strides take a copy, which a decode step's q (L <= 16 rows) makes cheap
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    lo, hi, valid, table = (None if t is None else t.contiguous() for t in (lo, hi, valid, table))
    sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    slopes = None if slopes is None else slopes.detach().to(torch.float32).contiguous()
    qpos = None if qpos is None else qpos.contiguous()
    out, lse = _empty_outputs(q, v)
    scratch = q.new_empty(N * G * splits * (H // G) * L * (Ev + 2), dtype=torch.float32)  # every split's m, l, acc
    status = _entry(library)(
        q.data_ptr(), (ctypes.c_int64 * 4)(*q.stride()), k.data_ptr(), (ctypes.c_int64 * 4)(*k.stride()),
        v.data_ptr(), (ctypes.c_int64 * 4)(*v.stride()), int(q.dtype == torch.bfloat16),
        N, H, G, L, E, S, Ev, start, stop, splits, float(scale),
        None if lo is None else lo.data_ptr(), None if hi is None else hi.data_ptr(), 0 if lo is None else lo.shape[0],
        None if valid is None else valid.data_ptr(), 0 if valid is None else valid.shape[0],
        None if sinks is None else sinks.data_ptr(), 0 if sinks is None else sinks.shape[0],
        scratch.data_ptr(), out.data_ptr(), lse.data_ptr(), torch.get_num_threads(),
        float(softcap), None if table is None else table.data_ptr(), 0 if table is None else table.shape[1],
        k.shape[1] if table is not None else 1,
        None if slopes is None else slopes.data_ptr(), None if qpos is None else qpos.data_ptr(),
        0 if qpos is None else qpos.shape[0],
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"the {KERNEL_NAME} could not allocate its working buffers")
    return out, lse


# the schema is written out: torch 2.5 infers none from `X | None` annotations
@torch.library.custom_op(
    "qkv::decode", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, float scale, int start, int stop, int splits, Tensor? lo, Tensor? hi, "
    "Tensor? valid, Tensor? sinks, str tier, float softcap=0.0, Tensor? table=None, Tensor? slopes=None, "
    "Tensor? qpos=None) -> (Tensor, Tensor)",
)  # fmt: skip
def _decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int, stop: int, splits: int,
    lo: torch.Tensor | None, hi: torch.Tensor | None, valid: torch.Tensor | None, sinks: torch.Tensor | None, tier: str,
    softcap: float = 0.0, table: torch.Tensor | None = None, slopes: torch.Tensor | None = None,
    qpos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention (out (N, H, L, Ev), lse (N, H, L), float32) of q (N, H, L, E), k
    (N, G, S, E), v (N, G, S, Ev) over keys start..stop-1 in ``splits`` splits, with query l of
    row n seeing keys lo[n|0, l] <= t <= hi[n|0, l] where valid[n|0, t]; softcap > 0 caps the
    scores, ALiBi ``slopes`` (H,) with ``qpos`` (N | 1, L) add - slopes[h] * |qpos - t|; with a block ``table`` (N, blocks), k and v are pools (num_blocks, P, G, E | Ev); the
    build of ``tier`` ("" for the machine's). Builds the kernel on first use; raises
    RuntimeError when it cannot run here."""
    wanted = tier or None
    reason = compiled.tier_reason(TIERS, q.dtype, q.device, DTYPES, wanted)
    built = _tier(wanted)
    library = compiled.loaded_or_raise(reason or _module(built or ""), KERNEL_NAME)
    return _run(library, q, k, v, scale, start, stop, splits, lo, hi, valid, sinks, softcap, table, slopes, qpos)


@_decode_op.register_fake
def _(q, k, v, scale, start, stop, splits, lo, hi, valid, sinks, tier, softcap=0.0, table=None, slopes=None, qpos=None):  # type: ignore[no-untyped-def]
    problem = _argument_problem(q, k, v, start, stop, splits, lo, hi, valid, sinks, softcap, table, slopes, qpos)
    if problem is not None:
        raise ValueError(f"qkv::decode: {problem}")
    return _empty_outputs(q, v)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int, stop: int, splits: int,
    lo: torch.Tensor | None = None, hi: torch.Tensor | None = None, valid: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, tier: str | None = None, softcap: float | None = None,
    table: torch.Tensor | None = None, slopes: torch.Tensor | None = None, qpos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(out (N, H, L, Ev), lse (N, H, L)) float32 of q (N, H, L, E), k (N, G, S, E), v
    (N, G, S, Ev) (float32 or bfloat16, any strides with a contiguous last dim: a cache's
    filled prefix), keys start <= t < stop split into ``splits`` pieces, query l of batch row n
    seeing t when lo[n|0, l] <= t <= hi[n|0, l] (int64 (N | 1, L); None: all) and valid[n|0, t]
    (bool (N | 1, S); None: all); sinks (N | 1, H) join each row's denominator (lse includes
    them); a row with no visible key gives zeros and lse -inf. ``softcap``: each score s becomes
    softcap * tanh(s / softcap); ALiBi ``slopes`` (H,) (float) with ``qpos`` (N | 1, L) int64,
    each query's position among the keys, then add - slopes[h] * |qpos[n|0, l] - t|; then the
    mask (qkv's order of score terms). ``table``: a block
    table (N, blocks) (int64, or int32 like FlashAttention's): k and v are then pools
    (num_blocks, P, G, E | Ev) and key t of row n lies at [table[n, t // P], t % P], as in
    `qkv.compat.flash_attn_with_kvcache`; S = blocks * P. The keys are read in the same blocks
    either way, so a paged sequence gives the bits of the same keys in a contiguous cache.
    ``tier``: the build to run (a tier at or below the machine's; None: the tier qkv uses now).
    None when the kernel is unavailable (`unavailable_reason`)."""
    _TIERED.check_tier(tier)
    if unavailable_reason(q.dtype, q.device, tier) is not None:
        return None
    built = _tier(tier)
    assert built is not None
    library = _module(built)
    if isinstance(library, str):
        return None
    cap = 0.0 if softcap is None else float(softcap)
    if table is not None and table.dtype == torch.int32:
        table = table.long()  # (N, blocks): FlashAttention's and vLLM's dtype
    tensors = (q, k, v, *(t for t in (lo, hi, valid, sinks, table, slopes, qpos) if t is not None))
    if compiled.direct_call(*tensors):
        return _run(library, q, k, v, float(scale), start, stop, splits, lo, hi, valid, sinks, cap, table, slopes, qpos)
    return torch.ops.qkv.decode(
        q, k, v, float(scale), start, stop, splits, lo, hi, valid, sinks, tier or "", cap, table, slopes, qpos
    )


def tanh(x: torch.Tensor, tier: str | None = None) -> torch.Tensor | None:
    """The kernel's float32 tanh (the softcap's) of x, elementwise (any shape), at the build of
    ``tier``; None when the kernel is unavailable. For tests against torch.tanh."""
    if unavailable_reason(torch.float32, x.device, tier) is not None:
        return None
    library = _module(_tier(tier) or "")
    if isinstance(library, str):
        return None
    flat = x.detach().to(torch.float32).contiguous().reshape(-1)  # (numel,)
    out = torch.empty_like(flat)
    _tanh_entry(library)(flat.data_ptr(), out.data_ptr(), flat.numel())
    return out.reshape(x.shape)
