"""What this machine's CPU offers each dtype: matrix units for bfloat16 / float16.

Low-precision products are fast on a CPU only with the matching instructions: AMX
(``amx_bf16``, ``amx_fp16``) or AVX-512 (``avx512_bf16``, ``avx512_fp16``). Without them
PyTorch converts to float32 and back around every product (emulation), which is slower
than float32 itself. The flags are read from /proc/cpuinfo (Linux); elsewhere they are
unknown and nothing is claimed.

The rates these instructions reach are measured, never assumed, by `qkv.bench.matmul_gflops`
(`qkv.explain` measures them only when asked with ``measure=True``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["LOW_PRECISION_FLAGS", "cpu_flags", "emulation_note"]

# The /proc/cpuinfo flags of the instructions that multiply each low-precision dtype natively.
LOW_PRECISION_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("amx_bf16", "avx512_bf16"),
    torch.float16: ("amx_fp16", "avx512_fp16"),
}


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
