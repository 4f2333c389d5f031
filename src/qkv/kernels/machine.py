"""What this machine's CPU offers each dtype: matrix units for bfloat16 / float16, and the
matrix-multiply rates it actually reaches.

Low-precision products are fast on a CPU only with the matching instructions: AMX
(``amx_bf16``, ``amx_fp16``) or AVX-512 (``avx512_bf16``, ``avx512_fp16``). Without them
PyTorch converts to float32 and back around every product (emulation), which is slower
than float32 itself. The flags are read from /proc/cpuinfo (Linux); elsewhere they are
unknown and nothing is claimed.

The rates are measured, never assumed: one square product per dtype, timed on first request
and cached for the process (a few hundred milliseconds; `qkv.explain` only measures when
asked with ``measure=True``). Benchmarks time their own, in the same run as the paths they
compare.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

__all__ = ["LOW_PRECISION_FLAGS", "cpu_flags", "emulation_note", "matmul_gflops"]

# The /proc/cpuinfo flags of the instructions that multiply each low-precision dtype natively.
LOW_PRECISION_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("amx_bf16", "avx512_bf16"),
    torch.float16: ("amx_fp16", "avx512_fp16"),
}
# Side of the square product that measures a rate: large enough to reach the BLAS's steady
# state on a few cores, small enough to take well under a second in float32.
_MATMUL_SIDE = 1024
_MATMUL_REPEATS = 5


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU feature flags of /proc/cpuinfo, or None where that file does not exist."""
    path = Path("/proc/cpuinfo")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def emulation_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning when ``dtype`` runs on this CPU without native instructions, else None.

    >>> emulation_note(torch.float32, torch.device("cpu")) is None
    True
    """
    wanted = LOW_PRECISION_FLAGS.get(dtype)
    flags = cpu_flags()
    if device.type != "cpu" or wanted is None or flags is None or flags & set(wanted):
        return None
    name = str(dtype).removeprefix("torch.")
    return (
        f"{name} on a CPU without {' or '.join(wanted)} (/proc/cpuinfo): PyTorch emulates its "
        f"products through float32, which is slower than float32 itself here"
    )


@functools.cache
def matmul_gflops(dtype: torch.dtype, threads: int) -> float:
    """This machine's rate for a square ``dtype`` matrix multiply on ``threads`` threads
    (GFLOP/s, 2 n^3 FLOPs per product, fastest of a few), measured once per process."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(_MATMUL_SIDE, _MATMUL_SIDE, generator=gen).to(dtype)
        b = torch.randn(_MATMUL_SIDE, _MATMUL_SIDE, generator=gen).to(dtype)
        a @ b  # first call: the BLAS picks its kernel and starts its threads
        best = float("inf")
        for _ in range(_MATMUL_REPEATS):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * _MATMUL_SIDE**3 / best / 1e9
