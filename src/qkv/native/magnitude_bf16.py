"""The largest |x| of large bfloat16 tensors in one exact pass: the input check's reduction.

Every attention call checks q, k and v before any work (`qkv.attention.problem._check_magnitudes`):
their largest magnitudes bound the scores (an overflow is refused), and an infinite or NaN
entry switches the NaN rule on. For bfloat16, ``torch.aminmax`` converts every value to
float32 and runs at about a third of the memory bandwidth: on the block engine's goal
problem (three 16 MiB tensors, 2 threads) it took 2.8 ms of a ~30 ms call. The compiled
scan (``magnitude_bf16.cpp``) reads each value's 15 magnitude bits as an unsigned integer,
which orders them as the magnitudes (0x7F80 is infinity, anything above a NaN), and keeps
the largest: 1.1 ms for the three, the same answer to the bit.

`largest_magnitudes` takes the tensors it can (bfloat16 on the CPU, at least `MIN_VALUES`
values, a contiguous last dim, any strides elsewhere, the compiled
kernels allowed here: `qkv.native.build.static_reason`) and leaves None for the others,
which the caller reduces with ``torch.aminmax``. Small tensors never build it: the first
large bfloat16 input does (a few seconds, once per machine, one note on the ``qkv`` logger).
The scan is the PyTorch operator ``torch.ops.qkv.magnitude_bf16`` (a list of tensors in, one
int32 magnitude field per tensor out; a fake implementation gives its shape for tracing).
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

__all__ = ["KERNEL_NAME", "MIN_VALUES", "largest_magnitudes", "strided_rows", "unavailable_reason"]

# qkv.backends.disabled("magnitude_bf16") switches it off; QKV_NO_COMPILED_KERNELS=1 too.

KERNEL_NAME = "bfloat16 magnitude scan"
# the kernel's source and build (`qkv.native.build`)
NATIVE = compiled.NativeKernel("magnitude_bf16", Path(__file__).with_name("magnitude_bf16.cpp"), KERNEL_NAME)
# below this many values torch.aminmax costs microseconds, and no input should build a kernel
MIN_VALUES = 1 << 20
_INFINITY_BITS = 0x7F80  # bfloat16 +inf with the sign bit cleared; more is a NaN

# the outcome of the one build attempt of this process: the loaded library, or why there is none
_built: dict = {}


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the scan does not take x, or None when it does (possibly after building it on
    first use). Never builds.

    >>> unavailable_reason(torch.ones(3, dtype=torch.bfloat16))
    'it takes tensors of at least 1048576 values (this one has 3)'
    """
    return _rows_or_reason(x)[1]


def _rows_or_reason(x: torch.Tensor) -> tuple[tuple[list[int], list[int], int] | None, str | None]:
    """x's `strided_rows` when the scan takes it, else why not (`unavailable_reason`)."""
    if switches.is_off("magnitude_bf16"):
        return None, switches.off_reason("magnitude_bf16")
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None, f"it reads plain tensors only (this is a {type(x).__name__})"
    if x.numel() < MIN_VALUES:
        return None, f"it takes tensors of at least {MIN_VALUES} values (this one has {x.numel()})"
    reason = compiled.static_reason(x.dtype, x.device)
    if reason is not None:
        return None, reason
    rows = strided_rows(x)
    if rows is None:
        return None, "its last dim is not contiguous"
    if not _readable(x):
        return None, "its values are not in memory it can read (no data pointer, or a storage smaller than the view)"
    failure = compiled.build_failure(_built)
    return (None, failure) if failure is not None else (rows, None)


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


def largest_magnitudes(tensors: Sequence[torch.Tensor]) -> list[float | None]:
    """Per tensor its largest |x_i| (math.inf when an entry is infinite or NaN), or None for a
    tensor the scan does not take (`unavailable_reason`), or for all of them when its build
    failed."""
    plans = [_rows_or_reason(x) for x in tensors]
    found: list[float | None] = [None] * len(tensors)
    taken = [(i, rows) for i, (rows, _) in enumerate(plans) if rows is not None]
    if not taken:
        return found
    library = compiled.built_once(_built, _build)
    if isinstance(library, str):
        return found
    chosen = [tensors[i] for i, _ in taken]
    scan = functools.partial(_run, library) if compiled.direct_call(*chosen) else torch.ops.qkv.magnitude_bf16
    bits = scan(chosen).tolist()
    for (i, _), b in zip(taken, bits, strict=True):
        found[i] = magnitude_of(b)
    return found


@functools.cache
def _entry(library: ctypes.CDLL):  # type: ignore[no-untyped-def]
    """The kernel's entry point with its C signature (magnitude_bf16.cpp)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return compiled.function(library, "qkv_magnitude_bf16", ctypes.c_int, i64, p, p, p, p, p, i64)


def _run(library: ctypes.CDLL, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The scan of bfloat16 CPU tensors whose last dim is contiguous and whose values lie in
    readable memory (checked here: the kernel reads raw memory): (len(tensors),) int32."""
    layouts = []
    for i, x in enumerate(tensors):
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"qkv::magnitude_bf16: tensor {i} is not bfloat16 on the CPU ({x.dtype}, {x.device})")
        rows = strided_rows(x)
        if rows is None or not _readable(x):
            raise ValueError(f"qkv::magnitude_bf16: tensor {i} has no contiguous last dim or no readable values")
        layouts.append(rows)
    count = len(tensors)
    data = (ctypes.c_void_p * max(count, 1))(*(x.data_ptr() for x in tensors))
    dims = (ctypes.c_int64 * max(count, 1))(*(len(sizes) for sizes, _, _ in layouts))
    flat = [n for sizes, steps, _ in layouts for n in (*sizes, *steps)]  # per tensor: its sizes, then its strides
    layout = (ctypes.c_int64 * max(len(flat), 1))(*flat)
    inner = (ctypes.c_int64 * max(count, 1))(*(n for _, _, n in layouts))
    bits = torch.zeros(count, dtype=torch.int32)
    if count and _entry(library)(count, data, dims, layout, inner, bits.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError(f"the {KERNEL_NAME} could not allocate its buffers")
    return bits


# the schema is written out: torch 2.5 infers none from `list[...]` or `X | None` annotations
@torch.library.custom_op("qkv::magnitude_bf16", mutates_args=(), schema="(Tensor[] tensors) -> Tensor")
def _magnitude_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per bfloat16 tensor the largest (bits & 0x7FFF) of its values, (len(tensors),) int32:
    its largest |x| (`magnitude_of`), 0x7F80 for inf, above for NaN. Builds the scan on
    first use; raises RuntimeError when it cannot run here."""
    reason = compiled.static_reason(torch.bfloat16, torch.device("cpu"))
    library = compiled.loaded_or_raise(reason or compiled.built_once(_built, _build), KERNEL_NAME)
    return _run(library, tensors)


@_magnitude_op.register_fake
def _(tensors):  # type: ignore[no-untyped-def]
    return torch.empty(len(tensors), dtype=torch.int32)


def magnitude_of(bits: int) -> float:
    """The value of a bfloat16 magnitude field (inf for infinity and every NaN).

    >>> magnitude_of(0x3F80), magnitude_of(0x7F80), magnitude_of(0x7FC0)
    (1.0, inf, inf)
    """
    if bits >= _INFINITY_BITS:
        return float("inf")
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]  # bfloat16 is float32's upper half


def _build() -> ctypes.CDLL | str:
    return compiled.build(NATIVE, _check)


def _check(library: ctypes.CDLL) -> str | None:
    return _self_check(functools.partial(_run, library))


def _self_check(run) -> str | None:  # type: ignore[no-untyped-def]
    """Scan awkward tensors once (``run``: `_run` on the loaded library) against torch's own
    reduction: None, or what went wrong. The largest magnitude is negative each time: in a
    masked tail, in strided layouts, in the fourth piece of one long row (rows past 65,536
    values are split between threads), in the third share of many short rows (each share
    finds its first row by division, then steps); then an inf and a NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 45, generator=gen).bfloat16()  # rows of 45: one vector and a tail of 13
    x[3, 6, 44] = -300.0
    long = torch.randn(200_003, generator=gen).bfloat16()
    long[150_001] = -300.0
    many = torch.randn(64, 50, 45, generator=gen).bfloat16()  # as (50, 64) rows of 45: 1,456 rows per share
    many[20, 45, 7] = -300.0  # row 45 * 64 + 20 = 2,900 of the transposed view
    cases = [x, x.transpose(0, 1), x[:, 1:, 3:], long, many.transpose(0, 1)]
    for case in cases:
        (bits,) = run([case]).tolist()
        want = float(case.float().abs().max())
        if magnitude_of(bits) != want:
            return f"its self-check failed (largest magnitude {magnitude_of(bits)!r}, want {want!r})"
    for special in (float("-inf"), float("nan")):
        y = x.clone()
        y[1, 2, 3] = special
        (bits,) = run([y]).tolist()
        if magnitude_of(bits) != float("inf"):
            return f"its self-check failed ({special} was not seen)"
    return None
