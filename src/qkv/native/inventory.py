"""Every compiled kernel of qkv, what this machine says of it, and building them ahead of time.

`kernel_statuses` answers without building anything: whether each kernel may run here (the
CPU tier, the dtype, ``QKV_NO_COMPILED_KERNELS``, the tools) and whether its build is already
in the cache. `build_all` builds and self-checks every kernel that may run here, side by
side (one compiler per core), and says how long each took (`qkv doctor --build`). Every
kernel is a PyTorch operator ``torch.ops.qkv.<stem>`` (the interval pair:
``interval_bf16_forward`` and ``interval_bf16_backward``), registered when its module is
imported, whether or not it can run here (`OPERATORS`; the kernels built per tier, ``decode``,
``magnitude`` and ``short_wide``, have one operator for all their builds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import torch

from qkv.native import (
    add_norm_bf16,
    decode,
    interval_bf16,
    interval_bf16_backward,
    magnitude,
    short_bf16,
    short_wide,
)
from qkv.native import build as compiled

__all__ = ["OPERATORS", "KernelStatus", "build_all", "kernel_statuses"]

# the kernel modules: short_bf16 and add_norm_bf16 with native() (the build the machine runs:
# source and flags), build_state() (this process's attempt) and _build; the interval pair with
# the same in its `compiled.IntervalKernel` (`_kernel`)
_MODULES: tuple[ModuleType, ...] = (interval_bf16, interval_bf16_backward, short_bf16, add_norm_bf16)
# the kernels built per tier (`compiled.TieredKernel`: name, machine build, build now, reason)
_TIERED: tuple[compiled.TieredKernel, ...] = (decode._TIERED, magnitude._TIERED, short_wide._TIERED)
# the fused interval kernels: built for amx (oneDNN's micro-kernels: they need
# torch.backends.mkldnn switched on) and for avx512 with AVX-512 BF16 (`compiled.IntervalKernel`)
_INTERVAL = (interval_bf16, interval_bf16_backward)
# each kernel's operator, by its stem: torch.ops.qkv.<name>
OPERATORS: dict[str, str] = {
    "interval_bf16": "interval_bf16_forward",
    "interval_bf16_backward": "interval_bf16_backward",
    "short_bf16": "short_bf16",
    "add_norm_bf16": "add_norm_bf16",
}


@dataclass(frozen=True)
class KernelStatus:
    """One compiled kernel as this machine sees it."""

    name: str
    stem: str
    reason: str | None  # why it cannot run here, None when it can
    built: bool  # its build is in the cache
    folder: str  # its folder in the build cache
    seconds: float | None = None  # how long `build_all` took to build or load it


def _kernel(module: ModuleType) -> tuple[compiled.NativeKernel, dict, Callable[[], compiled.Outcome]]:
    """A bf16 kernel module's build for this machine, this process's attempt at it, and how to build it."""
    if module in _INTERVAL:
        kernel: compiled.IntervalKernel = module._KERNEL
        return kernel.native(), kernel.build_state(), kernel.build
    return module.native(), module.build_state(), module._build


def _status(module: ModuleType, seconds: float | None = None) -> KernelStatus:
    native, attempt, _ = _kernel(module)
    cpu = torch.device("cpu")
    reason = compiled.interval_reason(torch.bfloat16, cpu) if module in _INTERVAL else compiled.static_reason(torch.bfloat16, cpu)
    outcome = attempt.get("module")
    if reason is None and isinstance(outcome, str):
        reason = outcome  # its build or self-check failed in this process
    name = native.name if native.tier is None else f"{native.name} ({native.tier} build)"
    return KernelStatus(
        name=name, stem=native.stem, reason=reason, built=native.is_built(), folder=str(native.folder()), seconds=seconds
    )


def _tiered_status(tiered: compiled.TieredKernel, seconds: float | None = None) -> KernelStatus:
    """A kernel built per tier (`qkv.native.decode`, `qkv.native.magnitude`,
    `qkv.native.short_wide`): the build this machine runs, and why it does not run here for
    inputs of its first dtype (or None)."""
    kernel = tiered.machine_build()
    return KernelStatus(
        name=f"{tiered.name} ({kernel.tier} build)", stem=kernel.stem,
        reason=tiered.unavailable_reason(tiered.dtypes[0], torch.device("cpu")), built=kernel.is_built(),
        folder=str(kernel.folder()), seconds=seconds,
    )  # fmt: skip


def kernel_statuses() -> list[KernelStatus]:
    """Each compiled kernel: may it run here, and is its build cached. Builds nothing.

    >>> sorted(s.stem for s in kernel_statuses())[:3]  # doctest: +ELLIPSIS
    ['add_norm_bf16', 'decode_...', 'interval_bf16...']
    """
    return [*(_status(module) for module in _MODULES), *(_tiered_status(tiered) for tiered in _TIERED)]


def build_all() -> list[KernelStatus]:
    """Build (or load) and self-check every kernel that may run here, side by side on the
    machine's cores; the others are listed with their reason. A failed build is a reason,
    never an exception."""

    def attempt(module: ModuleType) -> KernelStatus:
        if _status(module).reason is not None:
            return _status(module)
        started = time.perf_counter()
        _, attempt, make = _kernel(module)
        compiled.built_once(attempt, make)
        return _status(module, time.perf_counter() - started)

    def attempt_tiered(tiered: compiled.TieredKernel) -> KernelStatus:
        if _tiered_status(tiered).reason is not None:
            return _tiered_status(tiered)
        started = time.perf_counter()
        tiered.build_now()
        return _tiered_status(tiered, time.perf_counter() - started)

    with ThreadPoolExecutor(max_workers=max(1, min(len(_MODULES) + len(_TIERED), os.cpu_count() or 1))) as pool:
        builds = [pool.submit(attempt_tiered, tiered) for tiered in _TIERED]
        return [*pool.map(attempt, _MODULES), *(done.result() for done in builds)]
