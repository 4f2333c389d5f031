"""This machine's CPU tier, from PyTorch's own queries, and what it means for each dtype.

qkv sorts x86-64 CPUs into the tiers its code paths differ by, lowest first:

- ``default``: no AVX2 (or not x86-64): PyTorch's portable kernels only;
- ``avx2``: AVX2 + FMA (AMD EPYC / Ryzen, Intel laptops and older Xeons);
- ``avx512``: AVX-512 (F, BW, VL, DQ), with or without the bf16 instructions;
- ``amx``: AVX-512 with AMX tiles (Intel Xeon Sapphire Rapids and newer): the tier qkv's
  AMX kernels are written for (the fused interval pair also has a build for ``avx512`` with
  the bf16 instructions; the decode kernel, the magnitude scan and short_wide run from ``avx2``).

The features come from ``torch.backends.cpu.get_cpu_capability()`` and the ``torch.cpu``
queries (``_is_avx512_bf16_supported``, ``_is_amx_tile_supported`` ...), never from
``/proc/cpuinfo``: they are what PyTorch itself will use, on any operating system, and
reading them costs no file access inside a call.

Low-precision products are fast only with native instructions: bfloat16 needs AVX-512 BF16
or AMX; float16 needs AVX-512 FP16 or AMX-FP16 (every CPU with AMX so far has AVX-512 FP16,
so the ``amx`` tier counts as native for both). Without them PyTorch converts every product
to float32 and back inside the kernel, which is many times slower than float32 itself
(an AVX2 EPYC: a bf16 matmul at 0.3-0.4 GFLOP/s against 19-30 in float32). There qkv keeps
the storage dtype and computes the products in float32 (`compute_dtype`).

``QKV_CPU_TIER`` (one of the tier names) makes qkv behave as on a machine of that tier: a
lower tier than the machine's turns off what the higher ones bring, so the paths of lower
machines are tested on a higher one (`.ci/run` does this). A tier above the machine's is not
granted (the machine's own is used). ``QKV_KEEP_EMULATED_DTYPES=1`` keeps emulated dtypes in
their own dtype (`compute_dtype`), so that the code paths of a machine with native bf16 run,
slowly, on one without. Rates are measured, never assumed, by
`qkv.bench.matmul_gflops`.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from qkv._log import note_once
from qkv._private.torch import cpu_supports

__all__ = [
    "KEEP_VARIABLE",
    "TIERS",
    "TIER_VARIABLE",
    "CpuFeatures",
    "compute_dtype",
    "cpu_features",
    "cpu_model",
    "emulation_note",
    "machine_line",
    "native_low_precision",
    "note_computed_wide",
]

# the tiers, lowest first; a tier has every feature of the ones before it
TIERS: tuple[str, ...] = ("default", "avx2", "avx512", "amx")
# the environment variable that forces a lower tier (read on every probe: tests set it)
TIER_VARIABLE = "QKV_CPU_TIER"
# set to 1, low-precision products run in their own dtype even where they are emulated: slow,
# but it runs the paths of a machine with native bf16 (and no compiled kernels) on any machine
KEEP_VARIABLE = "QKV_KEEP_EMULATED_DTYPES"


@dataclass(frozen=True)
class CpuFeatures:
    """What qkv may use on this CPU (``tier``), and what the machine itself has (``detected``)."""

    tier: str  # the tier qkv uses: ``detected``, or a lower one forced by QKV_CPU_TIER
    detected: str  # the machine's own tier
    capability: str  # torch.backends.cpu.get_cpu_capability() (what ATen's kernels were built for)
    avx512_bf16: bool  # AVX-512 BF16 instructions, within the tier used
    amx: bool  # AMX tiles with bf16 (and, on every such CPU so far, AVX-512 FP16), within the tier used
    amx_fp16: bool  # AMX-FP16 tiles, within the tier used
    forced: str | None = None  # the QKV_CPU_TIER value when it is set
    note: str | None = None  # why a QKV_CPU_TIER value was not taken as it stands

    def native(self, dtype: torch.dtype) -> bool:
        """Whether this tier multiplies ``dtype`` with native instructions (float32 and float64 always)."""
        if dtype == torch.bfloat16:
            return self.avx512_bf16 or self.amx
        if dtype == torch.float16:
            return self.amx or self.amx_fp16
        return True

    def describe(self) -> str:
        """One line: the tier, and why when it is not the machine's.

        >>> CpuFeatures("avx2", "amx", "AVX512", False, False, False, forced="avx2").describe()
        'avx2 (forced by QKV_CPU_TIER=avx2; the machine is amx)'
        """
        if self.tier == self.detected:
            return self.tier if self.note is None else f"{self.tier} ({self.note})"
        return f"{self.tier} (forced by {TIER_VARIABLE}={self.forced}; the machine is {self.detected})"


def _machine() -> tuple[str, str, bool, bool, bool]:
    """(tier, capability, avx512_bf16, amx, amx_fp16) of the machine itself (`_features` keeps
    what follows from it)."""
    capability = torch.backends.cpu.get_cpu_capability()
    amx = cpu_supports("amx_tile")
    avx512 = cpu_supports("avx512") or capability in ("AVX512", "AMX")
    avx2 = avx512 or cpu_supports("avx2") or capability == "AVX2"
    tier = "amx" if amx and avx512 else "avx512" if avx512 else "avx2" if avx2 else "default"
    return tier, capability, cpu_supports("avx512_bf16"), amx, cpu_supports("amx_fp16")


# the features per QKV_CPU_TIER value, probed once each: a plain dict, which torch.compile traces
# (it warns on functools caches, and the test suite turns warnings into errors)
_FEATURES: dict[str, CpuFeatures] = {}


def _features(forced: str) -> CpuFeatures:
    features = _FEATURES.get(forced)
    if features is None:
        features = _FEATURES[forced] = _probe(forced)
    return features


def _probe(forced: str) -> CpuFeatures:
    detected, capability, avx512_bf16, amx, amx_fp16 = _machine()
    tier, note = detected, None
    wanted = forced.strip().lower()
    if wanted:
        if wanted not in TIERS:
            note = f"{TIER_VARIABLE}={forced!r} is not a tier ({', '.join(TIERS)}): ignored"
        elif TIERS.index(wanted) > TIERS.index(detected):
            note = f"{TIER_VARIABLE}={forced} is above this machine: ignored"
        else:
            tier = wanted
    rank = TIERS.index(tier)
    return CpuFeatures(
        tier=tier,
        detected=detected,
        capability=capability,
        avx512_bf16=avx512_bf16 and rank >= TIERS.index("avx512"),
        amx=amx and rank >= TIERS.index("amx"),
        amx_fp16=amx_fp16 and rank >= TIERS.index("amx"),
        forced=forced if wanted else None,
        note=note,
    )


def cpu_features() -> CpuFeatures:
    """The CPU features qkv uses now (the machine's, or a lower tier forced by QKV_CPU_TIER).

    >>> cpu_features().tier in TIERS
    True
    """
    return _features(os.environ.get(TIER_VARIABLE, ""))


# probed now for the tier of the environment qkv is imported in: a first probe inside a function
# torch.compile traces would break its graph (the probe calls PyTorch's CPU queries)
cpu_features()


def native_low_precision(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in ``dtype`` run natively on ``device`` (always True off the CPU and
    for float32 / float64).

    >>> native_low_precision(torch.float32, torch.device("cpu"))
    True
    """
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu":
        return True
    return cpu_features().native(dtype)


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype qkv multiplies ``dtype`` tensors in on ``device``: ``dtype`` itself where the
    machine has native products for it (or ``QKV_KEEP_EMULATED_DTYPES=1`` asks to keep it),
    float32 where PyTorch would emulate them.

    >>> compute_dtype(torch.float64, torch.device("cpu"))
    torch.float64
    """
    if native_low_precision(dtype, device) or os.environ.get(KEEP_VARIABLE, "") not in ("", "0"):
        return dtype
    return torch.float32


def emulation_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """What qkv does with ``dtype`` on a CPU without native products for it, else None.

    >>> emulation_note(torch.float32, torch.device("cpu")) is None
    True
    """
    if native_low_precision(dtype, device):
        return None
    name = str(dtype).removeprefix("torch.")
    needs = "AVX-512 BF16 or AMX" if dtype == torch.bfloat16 else "AVX-512 FP16 or AMX"
    if compute_dtype(dtype, device) == dtype:
        return (
            f"{name} products are not native on this CPU (tier {cpu_features().describe()}; they need "
            f"{needs}) and {KEEP_VARIABLE} keeps them in {name}: PyTorch emulates them, slower than float32"
        )
    return (
        f"{name} products are not native on this CPU (tier {cpu_features().describe()}; they need "
        f"{needs}): qkv keeps {name} storage and computes in float32, which is faster here than "
        f"PyTorch's emulated {name}"
    )


def note_computed_wide(dtype: torch.dtype, device: torch.device) -> None:
    """Say once per process (INFO on the ``qkv`` logger, printed by the CLI) that ``dtype``'s
    products are computed in float32 here: every place that widens an emulated dtype calls
    this, `qkv.attention`, `MultiHeadAttention` and the encoder alike, so the user hears it
    whichever of them runs."""
    note_once(f"widened {dtype} on {device.type}", lambda: emulation_note(dtype, device), logging.INFO)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name for reports and benchmark tables (Linux: /proc/cpuinfo's "model
    name", read for display only: features come from PyTorch), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_line() -> str:
    """The CPU and its tier in one line, printed with every benchmark table.

    >>> "tier" in machine_line()
    True
    """
    features = cpu_features()
    bf16 = "native" if features.native(torch.bfloat16) else "emulated (computed in float32)"
    return f"CPU: {cpu_model()}, tier {features.describe()}, bf16 {bf16}, {torch.get_num_threads()} threads"
