"""Peak memory, two ways: the process's resident set (what the operating system holds for
it, PyTorch's own footprint included) and the allocations Python's tracemalloc sees.

- Resident set: Linux keeps a high-water mark (VmHWM in /proc/self/status) that writing "5"
  to /proc/self/clear_refs resets to the current resident size, so the growth of one piece
  of work is VmHWM after it minus VmRSS before it (`peak_growth`). A fresh process's VmHWM
  is its own peak (`peak_rss_bytes`): exec resets it, while ``ru_maxrss`` would also count
  the parent's peak, which Linux carries across fork and exec; it is the fallback elsewhere.
- Traced allocations (`traced_peak_bytes`): NumPy's arrays included, the interpreter and
  libraries that allocate outside Python's allocator (PyTorch's tensors) not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PeakGrowth", "peak_growth", "peak_rss_bytes", "status_bytes", "traced_peak_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK = "5"  # clear_refs: set the peak resident size (VmHWM) to the current one


def status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM", ...) in bytes; None where that
    file or field does not exist (not Linux)."""
    try:
        text = _STATUS.read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the file counts in KiB
    return None


def peak_rss_bytes() -> int:
    """The peak resident set of this process so far, in bytes (VmHWM; ru_maxrss elsewhere)."""
    peak = status_bytes("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


@dataclass
class PeakGrowth:
    """The growth of the resident set at its peak during a `peak_growth` block, in bytes."""

    bytes: int = 0


@contextmanager
def peak_growth(trim: bool = False) -> Iterator[PeakGrowth]:
    """Measure how far the resident set grows at its peak inside the ``with`` block (Linux).

    ``trim``: first hand the heap's free memory back to the system (glibc's malloc_trim), so
    that the block cannot reuse memory freed earlier without it being counted. Raises
    OSError where the peak cannot be reset (no /proc/self/clear_refs).

        with peak_growth() as growth:
            work()
        print(growth.bytes)
    """
    if not (_STATUS.exists() and _CLEAR_REFS.exists()):
        raise OSError(f"no {_STATUS} or {_CLEAR_REFS}: the peak resident set cannot be measured here")
    if trim:
        libc = ctypes.util.find_library("c")
        if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
            ctypes.CDLL(libc).malloc_trim(0)
    _CLEAR_REFS.write_text(_RESET_PEAK)
    before = status_bytes("VmRSS") or 0
    growth = PeakGrowth()
    yield growth
    growth.bytes = peak_rss_bytes() - before


def traced_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes Python's allocators hold while ``fn`` runs (what existed before not counted)."""
    tracing = tracemalloc.is_tracing()  # a caller's own tracing is left running
    if tracing:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
    else:
        before = 0
        tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if not tracing:
            tracemalloc.stop()
