"""The one switch that turns kernels and backends off: `disabled`, re-exported as `qkv.backends.disabled`.

It lives at the native level because the compiled kernels below `qkv.backends` read it too.
The set of names switched off is a `contextvars.ContextVar`: each thread (and asyncio task)
sees its own, and nested ``with`` blocks restore the outer set on exit, whatever happens
inside. Switching a name off changes what `qkv.attention.dispatch.choose_path` plans (and so
what `qkv.explain` prints); each kernel's ``unavailable_reason`` then says
``it is switched off (qkv.backends.disabled("name"))``.

A process-wide count of the ``with`` blocks open in any thread sits beside the ContextVar,
and the set is read only while that count is above 0. Dynamo before PyTorch 2.14 cannot
trace ``ContextVar.get`` (a graph break, so ``fullgraph=True`` fails): with no block open, a
compiled call reads only the count, and Dynamo guards on it, so opening a block anywhere
makes the next compiled call trace again and read its own thread's set.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from threading import Lock

__all__ = ["NAMES", "disabled", "is_off", "off_reason", "switched_off"]

# Every name that can be switched off, with what switching it off does. The list is fixed here,
# not collected from the modules that read it, so that a misspelt name fails whatever has been
# imported so far.
NAMES: dict[str, str] = {
    "interval_bf16": "the block engine's fused bf16 forward kernel; the engine runs PyTorch's CPU flash kernel per tile",
    "interval_bf16_backward": "the block engine's fused bf16 backward kernel; the engine's backward runs per call",
    "short_bf16": "the short-sequence bf16 kernel of the fused path; PyTorch's SDPA runs",
    "short_wide": "the short-sequence bf16 kernel with float32 products (CPUs without AMX); SDPA runs (on float32 copies where bf16 is emulated)",
    "sdpa_wide": "the fused path's backward on float32 copies for bf16 inputs with small heads; SDPA's bf16 backward runs",
    "add_norm_bf16": "the residual add + LayerNorm kernel of qkv.models; the eager ops run",
    "magnitude": "the compiled largest-magnitude scan of the input checks (float32, bf16, fp16); torch.aminmax runs",
    "onednn_linear": "oneDNN's fused linear of qkv.models; torch.nn.functional.linear runs",
    "native_decode": "the decode backend's compiled kernel; the decode backend's PyTorch ops run",
    "decode": "the decode backend for backend='auto' (backend='decode' raises)",
    "blocks": "the CPU block engine for backend='auto' (backend='blocks' raises)",
    "flex": "FlexAttention for backend='auto' (backend='flex' raises)",
    "math_chunks": "the math path by query chunks under torch.compile; the whole L x S formula runs",
    "ring_cpu_flash": "PyTorch's CPU flash kernel for ring attention's blocks; the blockwise tiles run",
    "batch_workers": "qkv.models' batches side by side on one thread each; batches run one after another",
}

_OFF: ContextVar[frozenset[str]] = ContextVar("qkv_switched_off", default=frozenset())
_open_blocks = 0  # `disabled` blocks open in any thread
_open_blocks_lock = Lock()


def _count_open_blocks(change: int) -> None:
    global _open_blocks
    with _open_blocks_lock:
        _open_blocks += change


@contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Switch the named kernels and backends off inside the ``with`` block (this thread or
    task only; nesting adds to the outer set). An unknown name raises ValueError before
    anything changes.

    >>> with disabled("short_bf16"):
    ...     is_off("short_bf16")
    True
    >>> is_off("short_bf16")
    False
    """
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        raise ValueError(
            f"qkv.backends.disabled: unknown name(s) {', '.join(repr(n) for n in unknown)}; "
            f"known: {', '.join(NAMES)}"
        )
    token = _OFF.set(_OFF.get() | frozenset(names))
    _count_open_blocks(+1)
    try:
        yield
    finally:
        _count_open_blocks(-1)
        _OFF.reset(token)


def is_off(name: str) -> bool:
    """Whether ``name`` is switched off here (`disabled`)."""
    assert name in NAMES, name  # a reader's own misspelling would otherwise never be off
    return name in switched_off()


def switched_off() -> frozenset[str]:
    """The names switched off here."""
    return _OFF.get() if _open_blocks else frozenset()


def off_reason(name: str) -> str | None:
    """The reason text of a switched-off ``name``, None when it is on."""
    return f'it is switched off (qkv.backends.disabled("{name}"))' if is_off(name) else None
