"""The largest |x| of large float32, bfloat16 and float16 tensors in one exact pass, on every CPU tier.

Every attention call checks q, k and v before any work (`qkv.attention.problem._check_magnitudes`):
their largest magnitudes bound the scores (an overflow is refused), and an infinite or NaN
entry switches the NaN rule on. ``torch.aminmax`` runs well below the memory read rate for
these: for bfloat16 it converts every value to float32 (about a third of the bandwidth: 2.8 ms
of a ~30 ms block-engine call with three 16 MiB tensors, 2 threads), and for float32 it keeps a
min and a max (~7.5 GB/s: 3.2 ms of a 127 ms causal SDPA call, n = 4,096, 8 heads of 64). The
compiled scan (``magnitude.cpp``) reads each value's magnitude bits (the value with its sign
cleared) as an unsigned integer, which orders them as the magnitudes (the exponent field all
ones is infinity, anything above a NaN), and keeps the largest, splitting the values of all
the tensors of one call over the threads: the same answer to the bit. Measured
(`benchmarks/magnitude_scan.py`, q, k, v of (1, 8, 4096, 64) read from main memory, 2 threads
of a shared AMX machine, one run): float32 1.36x torch.aminmax (16 GB/s), bfloat16 1.52x,
float16 1.61x; the AVX2 build 1.22x, 1.38x, 1.46x; `widen_bf16` 1.34x torch's copies followed
by the scan.

Tiers. Like the decode kernel (`qkv.native.decode`) it is compiled per tier with that tier's
flags only (`qkv.native.build.TIER_CFLAGS`): AVX2 (AMD EPYC) and AVX-512 (which AMX machines
run). The build that runs is the machine's (``QKV_CPU_TIER`` can lower it) or the one ``tier=``
asks for, so the AVX2 build is tested on an AVX-512 machine.

`largest_magnitudes` takes the tensors it can (float32, bfloat16 or float16 on the CPU, at
least `MIN_VALUES` values, a contiguous last dim, any strides elsewhere, plain tensors in
readable memory, the compiled kernels allowed here) and leaves None for the others, which the
caller reduces with ``torch.aminmax``. Small tensors never build it: the first large input
does (a few seconds, once per machine and tier, one note on the ``qkv`` logger). The scan is
the PyTorch operator ``torch.ops.qkv.magnitude`` (a list of tensors in, one int32 magnitude
field per tensor out; a fake implementation gives its shape for tracing).

`widen_bf16` is the same pass over bfloat16 tensors that also writes their float32 copies,
for a CPU that computes bfloat16 in float32 (`qkv.attention.functional._widened`): the input
is read once for the check and the copy together.

``qkv.backends.disabled("magnitude")`` switches it off; ``QKV_NO_COMPILED_KERNELS=1`` too.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from qkv._private import torch as private_torch
from qkv.native import build as compiled
from qkv.native import switches

__all__ = [
    "DTYPES", "KERNEL_NAME", "MIN_VALUES", "TIERS", "first_use_note", "kernel_reason", "largest_magnitudes",
    "magnitude_of", "strided_rows", "unavailable_reason", "widen_bf16",
]  # fmt: skip

KERNEL_NAME = "magnitude scan"
# the tiers it is written for, lowest first (an amx machine runs the avx512 build)
TIERS: tuple[str, ...] = ("avx2", "avx512")
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_SOURCE = Path(__file__).with_name("magnitude.cpp")
# below this many values torch.aminmax costs microseconds, and no input should build a kernel
MIN_VALUES = 1 << 20
# float32 copies of at least this many bytes in all (`widen_bf16`) are written with streaming
# stores, which skip reading each cache line before writing it: copies this large leave the
# caches before they are read back. Forced AVX2 tier, 2 threads, bf16 / float32 time: sliding
# window n = 16,384 (100 MB of copies) 0.96-0.97x -> 1.00x, causal n = 4,096 0.98x -> 1.00x.
STREAM_BYTES = 16 << 20
# per dtype: the magnitude field of +inf (more is a NaN) and how to read a field as a float
_FIELDS: dict[torch.dtype, tuple[int, str, str, int]] = {
    torch.float32: (0x7F800000, "<I", "<f", 0),
    torch.bfloat16: (0x7F80, "<I", "<f", 16),  # bfloat16 is float32's upper half
    torch.float16: (0x7C00, "<H", "<e", 0),
}

# its builds per tier, one attempt each per process
_TIERED = compiled.TieredKernel("magnitude", _SOURCE, KERNEL_NAME, TIERS, DTYPES, "magnitude", lambda library: _check(library))
first_use_note = _TIERED.first_use_note


def kernel_reason(dtype: torch.dtype = torch.float32, device: torch.device | None = None, tier: str | None = None) -> str | None:
    """Why the scan will not run for tensors of this dtype and device at ``tier`` (None: the
    tier qkv uses now), from facts that need no build, or a failed build's reason; None if it will.

    >>> kernel_reason(torch.float64)
    'it runs float32 and bfloat16 and float16 only (inputs are float64)'
    """
    return _TIERED.unavailable_reason(dtype, torch.device("cpu") if device is None else device, tier)


def unavailable_reason(x: torch.Tensor, tier: str | None = None) -> str | None:
    """Why the scan does not take x (at ``tier``), or None when it does (possibly after building
    it on first use). Never builds.

    >>> unavailable_reason(torch.ones(3, dtype=torch.bfloat16))
    'it takes tensors of at least 1048576 values (this one has 3)'
    """
    return _rows_or_reason(x, tier)[1]


def _rows_or_reason(x: torch.Tensor, tier: str | None) -> tuple[tuple[list[int], list[int], int] | None, str | None]:
    """x's `strided_rows` when the scan takes it, else why not (`unavailable_reason`)."""
    if switches.is_off("magnitude"):
        return None, switches.off_reason("magnitude")
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None, f"it reads plain tensors only (this is a {type(x).__name__})"
    if x.numel() < MIN_VALUES:
        return None, f"it takes tensors of at least {MIN_VALUES} values (this one has {x.numel()})"
    reason = kernel_reason(x.dtype, x.device, tier)
    if reason is not None:
        return None, reason
    rows = strided_rows(x)
    if rows is None:
        return None, "its last dim is not contiguous"
    if not _readable(x):
        return None, "its values are not in memory it can read (no data pointer, or a storage smaller than the view)"
    return rows, None


def _readable(x: torch.Tensor) -> bool:
    """Whether every value of x lies in its storage's memory, at a real address. Some plain
    tensors have none (a functionalize wrapper's data pointer is 0; a storage resized to 0
    bytes, as FSDP frees parameters, still backs its views): the scan would read through them."""
    try:
        data, storage = x.data_ptr(), x.untyped_storage()
        begin, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    if data == 0 or begin == 0 or private_torch.is_wrapped_tensor(x):
        return False
    last = sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True))  # the farthest value, in values
    return begin <= data and data + (last + 1) * x.element_size() <= begin + size


def strided_rows(x: torch.Tensor) -> tuple[list[int], list[int], int] | None:
    """x's values as rows of ``inner`` contiguous values: (sizes, strides, inner), the row at
    index (i_0, i_1, ...) of ``sizes`` starting sum_d i_d * strides[d] values after x's first
    one; dims that step over the ones inside them are merged. None when x's innermost dim
    (of more than one value) is not contiguous.

    >>> strided_rows(torch.ones(2, 3, 4))
    ([], [], 24)
    >>> strided_rows(torch.ones(2, 3, 4).transpose(0, 1))
    ([3, 2], [4, 12], 4)
    """
    dims = [(n, s) for n, s in zip(x.shape, x.stride(), strict=True) if n != 1]  # size-1 dims: any stride
    merged: list[tuple[int, int]] = []
    for n, s in reversed(dims):  # innermost first: a dim that steps over the one inside it joins it
        if merged and s == merged[-1][1] * merged[-1][0]:
            merged[-1] = (merged[-1][0] * n, merged[-1][1])
        else:
            merged.append((n, s))
    merged.reverse()
    if not merged:
        return [], [], 1  # one value
    inner, step = merged.pop()
    if step != 1:
        return None
    return [n for n, _ in merged], [s for _, s in merged], inner


def largest_magnitudes(tensors: Sequence[torch.Tensor], tier: str | None = None) -> list[float | None]:
    """Per tensor its largest |x_i| (math.inf when an entry is infinite or NaN), or None for a
    tensor the scan does not take (`unavailable_reason`), or for all of them when its build
    failed. ``tier``: the build to run (a tier of ``TIERS`` at or below the machine's; None:
    the tier qkv uses now)."""
    _TIERED.check_tier(tier)
    plans = [_rows_or_reason(x, tier) for x in tensors]
    found: list[float | None] = [None] * len(tensors)
    taken = [i for i, (rows, _) in enumerate(plans) if rows is not None]
    if not taken:
        return found
    library = _module(_TIERED.tier(tier) or "")
    if isinstance(library, str):
        return found
    chosen = [tensors[i] for i in taken]
    if compiled.direct_call(*chosen):
        bits = _run(library, chosen).tolist()
    else:
        bits = torch.ops.qkv.magnitude(chosen, tier or "").tolist()
    for i, b in zip(taken, bits, strict=True):
        found[i] = magnitude_of(b, tensors[i].dtype)
    return found


def widen_bf16(tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor], tier: str | None = None) -> list[float] | None:
    """Write each bfloat16 tensor's values into its float32 ``out`` (contiguous, same shape:
    exact copies) and return each one's largest |x_i| (inf when infinite or NaN), in one read;
    None, writing nothing, when the scan does not take every tensor (`unavailable_reason`) or
    cannot run directly on their memory (tracing, a mode, a wrapper)."""
    _TIERED.check_tier(tier)
    if len(tensors) != len(out):
        raise ValueError(f"widen_bf16: {len(tensors)} tensors but {len(out)} outputs")
    for x, o in zip(tensors, out, strict=True):
        if x.dtype != torch.bfloat16 or o.dtype != torch.float32 or o.shape != x.shape or not o.is_contiguous():
            raise ValueError(f"widen_bf16: wants bfloat16 tensors and contiguous float32 outputs of their shapes, got {x.dtype} {tuple(x.shape)} -> {o.dtype} {tuple(o.shape)}")
    plans = [_rows_or_reason(x, tier) for x in tensors]
    if not tensors or any(rows is None for rows, _ in plans) or not compiled.direct_call(*tensors, *out):
        return None
    library = _module(_TIERED.tier(tier) or "")
    if isinstance(library, str):
        return None
    bits = _run(library, tensors, out).tolist()
    return [magnitude_of(b, torch.bfloat16) for b in bits]


def _module(tier: str) -> ctypes.CDLL | str:
    return _TIERED.module(tier)


@functools.cache
def _entries(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's two entry points with their C signatures (magnitude.cpp)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    scan = compiled.function(library, "qkv_magnitude", ctypes.c_int, i64, p, p, p, p, p, p, i64)
    widen = compiled.function(library, "qkv_widen_bf16", ctypes.c_int, i64, p, p, p, p, p, p, i64, i64)
    return scan, widen


def _run(library: ctypes.CDLL, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The scan of CPU tensors of ``DTYPES`` whose last dim is contiguous and whose values lie
    in readable memory (checked here: the kernel reads raw memory): (len(tensors),) int32.
    ``out``: bfloat16 tensors only, each widened into its contiguous float32 output as well."""
    layouts = []
    for i, x in enumerate(tensors):
        if x.dtype not in DTYPES or x.device.type != "cpu":
            raise ValueError(f"qkv::magnitude: tensor {i} is not float32, bfloat16 or float16 on the CPU ({x.dtype}, {x.device})")
        rows = strided_rows(x)
        if rows is None or not _readable(x):
            raise ValueError(f"qkv::magnitude: tensor {i} has no contiguous last dim or no readable values")
        layouts.append(rows)
    count = len(tensors)
    data = (ctypes.c_void_p * max(count, 1))(*(x.data_ptr() for x in tensors))
    dims = (ctypes.c_int64 * max(count, 1))(*(len(sizes) for sizes, _, _ in layouts))
    flat = [n for sizes, steps, _ in layouts for n in (*sizes, *steps)]  # per tensor: its sizes, then its strides
    layout = (ctypes.c_int64 * max(len(flat), 1))(*flat)
    inner = (ctypes.c_int64 * max(count, 1))(*(n for _, _, n in layouts))
    bits = torch.zeros(count, dtype=torch.int32)
    scan, widen = _entries(library)
    threads = torch.get_num_threads()
    if out is None:
        widths = (ctypes.c_int64 * max(count, 1))(*(x.element_size() for x in tensors))
        status = scan(count, data, widths, dims, layout, inner, bits.data_ptr(), threads) if count else 0
    else:
        for i, (x, o) in enumerate(zip(tensors, out, strict=True)):
            if x.dtype != torch.bfloat16 or o.dtype != torch.float32 or o.shape != x.shape or not o.is_contiguous() or not _readable(o):
                raise ValueError(f"qkv::magnitude: tensor {i} is not bfloat16 or its output not a contiguous float32 of its shape")
        targets = (ctypes.c_void_p * max(count, 1))(*(o.data_ptr() for o in out))
        stream = sum(o.numel() for o in out) * 4 >= STREAM_BYTES
        status = widen(count, data, dims, layout, inner, targets, bits.data_ptr(), threads, int(stream)) if count else 0
    if status != 0:
        raise MemoryError(f"the {KERNEL_NAME} could not allocate its buffers")
    return bits


# the schema is written out: torch 2.5 infers none from `list[...]` annotations
@torch.library.custom_op("qkv::magnitude", mutates_args=(), schema="(Tensor[] tensors, str tier) -> Tensor")
def _magnitude_op(tensors: list[torch.Tensor], tier: str) -> torch.Tensor:
    """Per tensor (float32, bfloat16 or float16) the largest magnitude field of its values (its
    bits with the sign cleared), (len(tensors),) int32: its largest |x| (`magnitude_of`); the
    field of inf, or above for NaN. The build of ``tier`` ("" for the machine's). Builds the
    scan on first use; raises RuntimeError when it cannot run here."""
    wanted = tier or None
    dtype = tensors[0].dtype if tensors else torch.float32
    reason = compiled.tier_reason(TIERS, dtype, torch.device("cpu"), DTYPES, wanted)
    library = compiled.loaded_or_raise(reason or _module(_TIERED.tier(wanted) or ""), KERNEL_NAME)
    return _run(library, tensors)


@_magnitude_op.register_fake
def _(tensors, tier):  # type: ignore[no-untyped-def]
    return torch.empty(len(tensors), dtype=torch.int32)


def magnitude_of(bits: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """The value of a magnitude field of ``dtype`` (inf for infinity and every NaN).

    >>> magnitude_of(0x3F80), magnitude_of(0x7F80), magnitude_of(0x7FC0), magnitude_of(0x3C00, torch.float16)
    (1.0, inf, inf, 1.0)
    """
    infinity, packed, unpacked, shift = _FIELDS[dtype]
    if bits >= infinity:
        return float("inf")
    return float(struct.unpack(unpacked, struct.pack(packed, bits << shift))[0])


def _check(library: ctypes.CDLL) -> str | None:
    return _self_check(functools.partial(_run, library))


def _self_check(run) -> str | None:  # type: ignore[no-untyped-def]
    """Scan awkward tensors once (``run``: `_run` on the loaded library) against torch's own
    reduction, in every dtype and with the widening copy: None, or what went wrong. The
    largest magnitude is negative each time: in a tail past the last whole vector, in strided
    layouts, in the fourth piece of one long row (rows past 65,536 values are split between
    threads), in the third share of many short rows (each share finds its first row by
    division, then steps); then an inf and a NaN."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(5, 7, 45, generator=gen)  # rows of 45: whole vectors and a tail
    base[3, 6, 44] = -300.0
    long = torch.randn(200_003, generator=gen)
    long[150_001] = -300.0
    many = torch.randn(64, 50, 45, generator=gen)  # as (50, 64) rows of 45: 1,456 rows per share
    many[20, 45, 7] = -300.0  # row 45 * 64 + 20 = 2,900 of the transposed view
    for dtype in DTYPES:
        x = base.to(dtype)
        cases = [x, x.transpose(0, 1), x[:, 1:, 3:], long.to(dtype), many.to(dtype).transpose(0, 1)]
        bits = run(cases).tolist()  # every case in one call: the shares of several tensors
        for case, b in zip(cases, bits, strict=True):
            want = float(case.float().abs().max())
            if magnitude_of(b, dtype) != want:
                name = str(dtype).removeprefix("torch.")
                return f"its self-check failed ({name} largest magnitude {magnitude_of(b, dtype)!r}, want {want!r})"
        for special in (float("-inf"), float("nan")):
            y = x.clone()
            y[1, 2, 3] = special
            (b,) = run([y]).tolist()
            if magnitude_of(b, dtype) != float("inf"):
                return f"its self-check failed ({special} was not seen in {dtype})"
    cases = [base.bfloat16().transpose(0, 1), long.bfloat16()]
    out = [torch.full(c.shape, float("nan")) for c in cases]
    bits = run(cases, out).tolist()
    if [magnitude_of(b) for b in bits] != [300.0, 300.0] or not all(torch.equal(o, c.float()) for o, c in zip(out, cases, strict=True)):
        return "its self-check failed (the widened copies or their magnitudes differ from torch's)"
    return None
