"""Building qkv's C++ kernels on this machine, once, with a reason whenever one cannot run.

Each compiled kernel of qkv (a ``.cpp`` file next to its Python module) is compiled the
first time it is needed, by the C++ compiler directly (``$CXX``, else ``c++``), into a
shared library with ``extern "C"`` entry points on raw pointers, sizes and strides; Python
loads it with `ctypes` and registers each entry point as a PyTorch operator under the
namespace ``qkv`` (``torch.ops.qkv.*``, `torch.library.custom_op`, with a fake
implementation for tracing and, for the interval pair, its autograd formula).

Why not ``torch.utils.cpp_extension``: a source that includes ``torch/extension.h`` and
binds with pybind11 took 30-150 s to compile cold (one core each, load 1-7); the same code
that includes only the ATen headers it uses (``ATen/cpu/vec``, ``ATen/native/CPUBlas.h``),
or none, takes 2-17 s at the same load, all five kernels well under 30 s on two cores
when built side by side (`build_all`). Only the kernels that call into ATen (oneDNN's
micro-kernels, Sleef's log) link ``libtorch_cpu``; the others need no torch library at all.

The build is cached in PyTorch's folder for extensions (``TORCH_EXTENSIONS_DIR`` when set,
else ``~/.cache/torch_extensions``) in a folder named by the hash of everything that makes
the library differ (`cache_key`): the source, the compiler's path and ``--version``, the
flags, qkv's CPU tier, the torch version and build, and the Python ABI. A change of any of
them builds anew; an unchanged build loads in milliseconds. A finished library is renamed
into place, so two processes building at once never load half a file. Nothing here raises:
a kernel that cannot be built is one sentence saying why (the compiler is missing, or the
compiler's first error line), and its caller falls back to a path that needs no compiler.
Each build is noted on the ``qkv`` logger: ``building <stem> ... done in X s``.

Tiers. The AMX kernels are written for `REQUIRED_TIER` only (`static_reason`); the fused
interval pair has a second build for ``avx512`` with AVX-512 BF16, on its own micro-kernel
(`IntervalKernel`, `interval_tier`: the same flags plus ``QKV_DPBF16_PRODUCTS``). A kernel written
for several tiers (the decode kernel, `qkv.native.decode`) is built once per tier it runs at,
with that tier's flags only (`TIER_CFLAGS`), as its own library (``NativeKernel.tier``, in the
cache key): `build_tier` picks the highest tier it supports at or below the one qkv uses now
(``QKV_CPU_TIER`` lowers it, so an AVX2 build runs and is tested on an AMX machine), and
`tier_reason` says why it cannot run without building.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv._log import note_once
from qkv._private import torch as private_torch
from qkv.native import switches
from qkv.native.machine import TIERS, cpu_features

__all__ = [
    "AMX_FLAGS",
    "CFLAGS",
    "HEAD_MULTIPLE",
    "INTERVAL_TIERS",
    "REQUIRED_TIER",
    "TIER_CFLAGS",
    "IntervalKernel",
    "NativeKernel",
    "TieredKernel",
    "build",
    "build_failure",
    "build_folder",
    "build_tier",
    "built_once",
    "cache_key",
    "compile_command",
    "direct_call",
    "first_use_note",
    "function",
    "interval_reason",
    "interval_tier",
    "loaded_or_raise",
    "local_headers",
    "onednn_packing_reason",
    "padded_heads",
    "static_reason",
    "strides",
    "tier_reason",
]

# what the compiled code executes: AVX-512 (at::vec, bf16 conversions), AMX for the products
REQUIRED_TIER = "amx"
# the fused interval kernels have a second build, for AVX-512 BF16 without AMX (AMD Zen 4 and
# 5, Intel Cooper Lake): their products on vdpbf16ps (products_bf16.h, `IntervalKernel`)
INTERVAL_TIERS = ("avx512", "amx")
# -ffp-contract=off: a product and a difference written apart stay apart (GCC would fuse them
# into one FMA, whose unrounded product makes a softmax's max score differ from itself).
# -fopenmp: the kernels split their work over OpenMP threads, as many as torch.get_num_threads()
# (PyTorch's own OpenMP runtime: libgomp is loaded once per process, by its soname).
# CPU_CAPABILITY: at::vec's AVX-512 implementations (its headers choose by this macro).
CFLAGS = ["-O3", "-fPIC", "-shared", "-std=c++20", "-fopenmp", "-ffp-contract=off",
          "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
          "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]  # fmt: skip
# Kernels written for several tiers (`NativeKernel.tier`) are compiled with their tier's flags
# only, so that a build for a lower tier runs on any higher machine (an AVX2 build on an AMX
# Xeon, as on an AMD EPYC): the source chooses its code by the compiler's macros (__AVX2__,
# __AVX512F__, __AVX512BF16__). F16C is left out: no kernel needs it and qkv's tiers do not probe it.
_COMMON_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c++20", "-fopenmp", "-ffp-contract=off")
_AVX512_FLAGS = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
TIER_CFLAGS: dict[str, tuple[str, ...]] = {
    "default": _COMMON_FLAGS,
    "avx2": (*_COMMON_FLAGS, "-mavx2", "-mfma"),
    "avx512": (*_COMMON_FLAGS, *_AVX512_FLAGS),
    "amx": (*_COMMON_FLAGS, *_AVX512_FLAGS, "-mavx512bf16"),
}
# for kernels that program the AMX tiles themselves
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]
# a compiler that runs longer than this is stuck (a cold build takes seconds)
_COMPILE_SECONDS = 600


# head dims are padded to this multiple for the micro-kernels (their K step)
HEAD_MULTIPLE = 32


def padded_heads(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) with D padded by zero columns to a multiple of `HEAD_MULTIPLE` and its last
    dim contiguous (a broadcast gradient is copied): zero columns change no score, no output.

    >>> padded_heads(torch.ones(2, 33)).shape
    torch.Size([2, 64])
    """
    pad = -x.shape[-1] % HEAD_MULTIPLE
    x = F.pad(x, (0, pad)) if pad else x  # (..., D + pad)
    return x if x.stride(-1) == 1 else x.contiguous()


def onednn_packing_reason(library: ctypes.CDLL, prefix: str) -> str | None:
    """Why a kernel that feeds oneDNN's micro-kernels its own VNNI panels cannot trust them
    here, or None: its ``<prefix>_micro_kernel_available()`` (``cpublas::could_pack``) and
    ``<prefix>_pack_matches()`` (its panels byte-equal to ``cpublas::pack``'s)."""
    if not function(library, f"{prefix}_micro_kernel_available", ctypes.c_int)():
        return "PyTorch's oneDNN cannot pack bfloat16 for its micro-kernel here (cpublas::could_pack)"
    if not function(library, f"{prefix}_pack_matches", ctypes.c_int)():
        return "oneDNN's packed layout for bfloat16 differs from the kernel's on this machine (pack_matches)"
    return None


def interval_tier() -> str | None:
    """The tier whose build of the fused interval kernels runs now (`INTERVAL_TIERS`), or None:
    ``amx``, or ``avx512`` where the tier qkv uses has AVX-512 BF16."""
    features = cpu_features()
    return features.tier if features.tier in INTERVAL_TIERS and features.avx512_bf16 else None


def interval_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """`static_reason` for the fused interval kernels: bf16, a tier of `INTERVAL_TIERS`, and
    oneDNN switched on where their ``amx`` build runs."""
    return static_reason(dtype, device, needs_onednn=True, tiers=INTERVAL_TIERS)


def static_reason(
    dtype: torch.dtype, device: torch.device, needs_onednn: bool = False, tiers: tuple[str, ...] = (REQUIRED_TIER,)
) -> str | None:
    """Why no compiled bf16 kernel of qkv can run for these inputs, from facts that need no
    build (dtype, device, the CPU tier, the switch, the compiler), or None. ``tiers``: the
    tiers the kernel has a build for (each needs AVX-512 BF16; `INTERVAL_TIERS` for the fused
    interval kernels). ``needs_onednn``: the ``amx`` build calls oneDNN's micro-kernels
    (``cpublas::brgemm``), which refuse to run while ``torch.backends.mkldnn`` is switched off;
    that is checked on every call.

    >>> static_reason(torch.float32, torch.device("cpu"))
    'it runs bfloat16 only (inputs are float32)'
    """
    if dtype != torch.bfloat16:
        return f"it runs bfloat16 only (inputs are {str(dtype).removeprefix('torch.')})"
    if device.type != "cpu":
        return "it runs on CPU only"
    if os.environ.get("QKV_NO_COMPILED_KERNELS", "") not in ("", "0"):
        return "QKV_NO_COMPILED_KERNELS is set"  # the user's own choice comes first, on any machine
    features = cpu_features()
    if features.tier not in tiers or not features.avx512_bf16:
        if tiers == (REQUIRED_TIER,):
            return f"this CPU's tier is {features.describe()}; qkv's compiled kernels need {REQUIRED_TIER} (AVX-512 BF16 and AMX tiles)"
        return f"this CPU's tier is {features.describe()}; the kernel needs AVX-512 BF16 (tier {' or '.join(tiers)})"
    if needs_onednn and features.tier == REQUIRED_TIER and not torch.backends.mkldnn.enabled:
        return "PyTorch's oneDNN is switched off (torch.backends.mkldnn.enabled is False)"
    return _toolchain_reason(_compiler_name())


def build_tier(supported: tuple[str, ...], tier: str | None = None) -> str | None:
    """The tier whose build of a kernel written for the ``supported`` tiers runs for ``tier``
    (None: the tier qkv uses now, `cpu_features`, which ``QKV_CPU_TIER`` can lower): the
    highest supported tier at or below it, or None when there is none.

    >>> build_tier(("avx2", "avx512"), "amx"), build_tier(("avx2", "avx512"), "avx2"), build_tier(("avx2",), "default")
    ('avx512', 'avx2', None)
    """
    wanted = cpu_features().tier if tier is None else tier
    rank = TIERS.index(wanted)
    below = [t for t in supported if TIERS.index(t) <= rank]
    return max(below, key=TIERS.index) if below else None


def tier_reason(supported: tuple[str, ...], dtype: torch.dtype, device: torch.device, dtypes: tuple[torch.dtype, ...],
                tier: str | None = None) -> str | None:
    """Why a compiled kernel written for the ``supported`` tiers and ``dtypes`` cannot run for
    inputs of ``dtype`` on ``device`` at ``tier`` (None: the tier qkv uses now), from facts
    that need no build, or None.

    >>> tier_reason(("avx2",), torch.float16, torch.device("cpu"), (torch.float32,))
    'it runs float32 only (inputs are float16)'
    """
    if dtype not in dtypes:
        names = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"it runs {names} only (inputs are {str(dtype).removeprefix('torch.')})"
    if device.type != "cpu":
        return "it runs on CPU only"
    if os.environ.get("QKV_NO_COMPILED_KERNELS", "") not in ("", "0"):
        return "QKV_NO_COMPILED_KERNELS is set"
    if build_tier(supported, tier) is None:
        now = cpu_features().describe() if tier is None else tier
        return f"this CPU's tier is {now}; the kernel is built for {' or '.join(supported)}"
    return _toolchain_reason(_compiler_name())


def loaded_or_raise(outcome: ctypes.CDLL | str, kernel_name: str) -> ctypes.CDLL:
    """The library of an operator about to run it; RuntimeError naming the kernel and why when
    ``outcome`` is a reason instead (the operators' one way of refusing)."""
    if isinstance(outcome, str):
        raise RuntimeError(f"the {kernel_name} cannot run here: {outcome}")
    return outcome


# the outcome of a kernel's one build attempt in a process is kept in a dict of its module
# (``_built``): "module" -> the loaded library or why there is none; "lock" -> its build lock
Outcome = ctypes.CDLL | str


def built_once(cache: dict, make: Callable[[], Outcome]) -> Outcome:
    """``cache["module"]``, made by ``make()`` the first time (one thread at a time per kernel:
    different kernels build side by side): a kernel's one build attempt per process, the
    loaded library or why there is none."""
    if "module" not in cache:
        with cache.setdefault("lock", threading.Lock()):  # setdefault is atomic: one lock per cache
            if "module" not in cache:
                cache["module"] = make()
    return cache["module"]


def build_failure(cache: dict) -> str | None:
    """Why the kernel's one build attempt of this process (`built_once`) failed, or None when
    it built or has not been tried yet."""
    outcome = cache.get("module")
    return outcome if isinstance(outcome, str) else None


def first_use_note(cache: dict) -> str:
    """What `qkv.explain` adds to a kernel's name before its first build in this process."""
    return "" if isinstance(cache.get("module"), ctypes.CDLL) else ", built on first use (seconds, once)"


def _compiler_name() -> str:
    """The C++ compiler the builds use: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


# compiler -> why it is missing, or None: one PATH scan per name (static_reason runs on every
# bf16 call of the engine); a dict, which torch.compile traces
_TOOLCHAIN: dict[str, str | None] = {}


@torch.compiler.assume_constant_result
def _on_path(compiler: str) -> bool:
    """Whether ``compiler`` is on PATH. Dynamo takes the answer as a constant while tracing:
    it cannot trace ``os.stat`` inside ``shutil.which``, and a first bf16 call made under
    torch.compile would otherwise break its graph there."""
    return shutil.which(compiler) is not None


def _toolchain_reason(compiler: str) -> str | None:
    """Why the build tools are missing, or None."""
    if compiler not in _TOOLCHAIN:
        found = _on_path(compiler)
        _TOOLCHAIN[compiler] = None if found else f"no C++ compiler was found ({compiler}; set $CXX to choose one)"
    return _TOOLCHAIN[compiler]


@functools.cache
def _compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and the first line of its ``--version`` (part of the
    cache key: an upgraded compiler builds anew)."""
    path = shutil.which(compiler) or compiler
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        version = ((done.stdout or done.stderr).strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    return f"{os.path.realpath(path)}\n{version}"


@dataclass(frozen=True)
class NativeKernel:
    """One compiled kernel of qkv: its C++ source, how it is built, and its name in messages."""

    stem: str  # the library is qkv_<stem>.so in the folder qkv_<stem>_<hash>
    source: Path
    name: str  # e.g. "fused bf16 interval kernel", as explain and the build messages say it
    cflags: tuple[str, ...] = tuple(CFLAGS)
    # whether the source includes ATen headers (then compiled against torch's include folder)
    # and whether it calls into libtorch_cpu (then linked with it and c10)
    torch_headers: bool = False
    links_torch: bool = False
    # the tier this build is for, in its cache key: a kernel written for several tiers
    # (`build_tier`; its flags are then ``TIER_CFLAGS[tier]``) or an interval kernel's avx512
    # build (`IntervalKernel`); None: a kernel for `REQUIRED_TIER` only, with the flags given,
    # keyed by the tier qkv uses now
    tier: str | None = None

    def folder(self) -> Path:
        """Its folder in the build cache (`build_folder`)."""
        return build_folder(self)

    def library_path(self) -> Path:
        """Where its finished library is (or will be)."""
        return self.folder() / f"qkv_{self.stem}.so"

    def is_built(self) -> bool:
        """Whether its finished build is in the cache."""
        return self.library_path().is_file()


@dataclass(eq=False)
class TieredKernel:
    """A kernel written for several CPU tiers (``tiers``, lowest first) and built per tier, with
    that tier's flags (`TIER_CFLAGS`) into its own cache folder: the builds, one attempt per tier
    per process (``builds``: tier -> `built_once`'s cache), and the helpers every such kernel
    module offers (`qkv.native.inventory` and `qkv doctor` read them). ``pick`` chooses the
    build for a tier (None: the tier qkv uses now) where `build_tier` alone would not."""

    stem: str
    source: Path
    name: str
    tiers: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]  # the input dtypes it runs
    switch: str  # its name for `qkv.backends.disabled`
    check: Callable[[ctypes.CDLL], str | None]  # the self-check a fresh library must pass (None: it did)
    pick: Callable[[str | None], str | None] | None = None
    builds: dict[str, dict] = field(default_factory=dict)

    def tier(self, tier: str | None = None) -> str | None:
        """The tier whose build runs for ``tier`` (None: the tier qkv uses now), or None."""
        return self.pick(tier) if self.pick is not None else build_tier(self.tiers, tier)

    def check_tier(self, tier: str | None) -> None:
        """Refuse a ``tier=`` that names no build of this kernel or a tier above the machine's
        (ValueError, before anything is built or run); None (the tier qkv uses now) passes."""
        if tier is not None and tier not in self.tiers:
            raise ValueError(f"tier={tier!r}: the {self.name} is built for {', '.join(self.tiers)}")
        if tier is not None and build_tier((tier,), None) is None:
            raise ValueError(f"tier={tier!r} is above this machine's tier ({cpu_features().describe()})")

    def kernel(self, tier: str) -> NativeKernel:
        """The build of ``tier``: its flags and its own cache folder."""
        return NativeKernel(f"{self.stem}_{tier}", self.source, self.name, cflags=TIER_CFLAGS[tier], tier=tier)

    def unavailable_reason(self, dtype: torch.dtype, device: torch.device, tier: str | None = None) -> str | None:
        """Why the kernel will not run for inputs of this dtype and device at ``tier`` (None: the
        tier qkv uses now): switched off, facts that need no build (`tier_reason`), or this
        process's failed build of that tier; None if it will (possibly after building it on
        first use). Never builds."""
        reason = switches.off_reason(self.switch) or tier_reason(self.tiers, dtype, device, self.dtypes, tier)
        if reason is not None:
            return reason
        built = self.tier(tier)
        assert built is not None  # tier_reason checked it
        return build_failure(self.builds.setdefault(built, {}))

    def first_use_note(self, tier: str | None = None) -> str:
        """What `qkv.explain` adds to the kernel's name before its first build (at this tier) in this process."""
        built = self.tier(tier)
        return "" if built is None else first_use_note(self.builds.setdefault(built, {}))

    def machine_build(self) -> NativeKernel:
        """The build this machine runs now (the lowest tier's where none of ``tiers`` runs), for
        `qkv.native.inventory`."""
        return self.kernel(self.tier(None) or self.tiers[0])

    def module(self, tier: str) -> ctypes.CDLL | str:
        """The loaded library of ``tier``'s build (built, or loaded from the cache, and checked on
        first use), or why there is none."""
        return built_once(self.builds.setdefault(tier, {}), lambda: build(self.kernel(tier), self.check))

    def build_now(self) -> None:
        """Build (or load) and self-check the machine's build now, if it may run here (switched
        off or not: `qkv doctor --build` builds ahead of time); a failure becomes its reason
        (`unavailable_reason`), never an exception."""
        tier = self.tier(None)
        # any dtype it runs: a build serves them all
        if tier is not None and tier_reason(self.tiers, self.dtypes[0], torch.device("cpu"), self.dtypes) is None:
            self.module(tier)


@dataclass(eq=False)
class IntervalKernel:
    """One fused interval kernel (the forward or the backward) with its two builds of one
    source, by tier (``builds``): ``amx``, whose products are oneDNN's micro-kernel on the AMX
    tiles (keyed by the tier qkv uses, as before there were two), and ``avx512``, whose products
    are the kernel's own on vdpbf16ps (``-DQKV_DPBF16_PRODUCTS``, products_bf16.h); and this
    process's one attempt at each (``attempts``: tier -> `built_once`'s cache). A fresh library
    passes ``self_check`` (against float64 math), the amx one `onednn_packing_reason` first."""

    stem: str
    source: Path
    name: str
    self_check: Callable[[ctypes.CDLL], str | None]
    builds: dict[str, NativeKernel] = field(init=False)
    attempts: dict[str, dict] = field(init=False)

    def __post_init__(self) -> None:
        self.builds = {
            "amx": NativeKernel(self.stem, self.source, self.name, torch_headers=True, links_torch=True),
            "avx512": NativeKernel(
                f"{self.stem}_avx512", self.source, self.name, cflags=(*CFLAGS, "-DQKV_DPBF16_PRODUCTS"),
                torch_headers=True, links_torch=True, tier="avx512",
            ),
        }  # fmt: skip
        self.attempts = {tier: {} for tier in self.builds}

    def native(self) -> NativeKernel:
        """The build the tier qkv uses now runs (the ``amx`` one where neither runs)."""
        return self.builds[interval_tier() or "amx"]

    def build_state(self) -> dict:
        """This process's attempt at `native` (`built_once`'s cache)."""
        return self.attempts[interval_tier() or "amx"]

    def build(self) -> Outcome:
        """Compile (or load the cached build of) `native` and check it: the library, or why not."""
        kernel = self.native()

        def check(library: ctypes.CDLL) -> str | None:
            # the amx build feeds oneDNN's micro-kernel panels of its own packing; the avx512
            # build packs for its own micro-kernel, which the self-check runs
            packing = onednn_packing_reason(library, f"qkv_{self.stem}") if kernel is self.builds["amx"] else None
            return packing or self.self_check(library)

        return build(kernel, check)

    def module(self) -> Outcome:
        """The loaded library of `native` (built and checked on first use), or why there is none."""
        return built_once(self.build_state(), self.build)


def _torch_folders() -> tuple[str, str]:
    """torch's include and library folders."""
    root = Path(torch.__file__).parent
    return str(root / "include"), str(root / "lib")


def compile_command(kernel: NativeKernel, output: Path) -> list[str]:
    """The compiler's command line that builds ``kernel`` into ``output``."""
    command = [_compiler_name(), *kernel.cflags]
    if kernel.torch_headers:
        include, _ = _torch_folders()
        abi = int(torch.compiled_with_cxx11_abi())  # as torch itself was built
        command += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-isystem", include]
    command += [str(kernel.source), "-o", str(output)]
    if kernel.links_torch:
        _, lib = _torch_folders()
        command += [f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]
    return command


def cache_key(kernel: NativeKernel) -> str:
    """What the cached library depends on, as one text: the source and the headers it includes
    from its own folder (`local_headers`), the compiler (path and version), the command's
    flags, qkv's CPU tier, the torch version and build, the Python ABI. (The command names the
    build folder, which is this key's hash: it enters as flags only.)"""
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    flags = compile_command(kernel, Path("out.so"))[1:]
    return "\n".join([
        kernel.source.read_text(encoding="utf-8"),
        *(header.read_text(encoding="utf-8") for header in local_headers(kernel.source)),
        _compiler_identity(_compiler_name()),
        " ".join(flags),
        f"tier {kernel.tier or cpu_features().tier}",
        f"torch {torch.__version__} {torch.version.git_version}",
        f"python {abi}",
    ])  # fmt: skip


def local_headers(source: Path) -> list[Path]:
    """The headers ``source`` includes from its own folder (``#include "name.h"``), in order.

    >>> [h.name for h in local_headers(Path(__file__).with_name("decode.cpp"))]
    ['vectors.h']
    """
    found = []
    for line in source.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "#include" and words[1].startswith('"'):
            header = source.parent / words[1].strip('"')
            if header.is_file():
                found.append(header)
    return found


def _cache_root() -> Path:
    """PyTorch's folder for extensions: ``TORCH_EXTENSIONS_DIR``, else under the user's cache."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def build_folder(kernel: NativeKernel) -> Path:
    """Where the build of ``kernel`` lives: ``qkv_<stem>_<hash of cache_key>`` in the cache
    folder. Nothing is created."""
    digest = hashlib.sha256(cache_key(kernel).encode()).hexdigest()[:16]
    return _cache_root() / f"qkv_{kernel.stem}_{digest}"


def function(library: ctypes.CDLL, name: str, restype: object, *argtypes: object) -> Callable[..., int]:
    """The entry point ``name`` of a loaded kernel with its C types declared (without them
    ctypes would pass every Python int as a 32-bit int)."""
    entry = getattr(library, name)
    entry.restype = restype
    entry.argtypes = list(argtypes)
    return entry


def direct_call(*tensors: torch.Tensor) -> bool:
    """Whether a kernel may run on these tensors' memory directly, past PyTorch's dispatcher:
    plain eager tensors, no torch.compile tracing, no torch function or dispatch mode (a
    tracer, FakeTensorMode, FlopCounterMode). Otherwise the kernel's operator runs, which
    every mode and tracer sees. The dispatcher's Python layers of a custom operator cost
    50-100 us a call (short_bf16 on one 8-query head: 125 us through the operator, 75 us
    direct, 18 us with the former pybind11 module; load 8), as much as a small kernel."""
    if torch.compiler.is_compiling() or private_torch.mode_active():
        return False
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and not private_torch.is_wrapped_tensor(t) for t in tensors)


def strides(t: torch.Tensor, dims: int = 3) -> ctypes.Array:
    """The strides of ``t``'s first ``dims`` dims, as the C array the kernels read."""
    return (ctypes.c_int64 * dims)(*t.stride()[:dims])


def build(kernel: NativeKernel, check: Callable[[ctypes.CDLL], str | None]) -> Outcome:
    """Compile (or find in the cache) ``kernel``, load it and run ``check`` on it: the loaded
    library, or why there is none (the compiler's first error line, or what ``check``
    returned). Its build is noted (``building <stem> ... done in X s``); a build or check
    that fails is noted once too (`qkv._log.note_once`)."""
    library = _load(kernel)
    if not isinstance(library, str):
        try:
            error = check(library)
        except Exception as failure:  # a check that raises is a reason to fall back too
            error = f"its check at load raised {type(failure).__name__}: {str(failure).strip()[:200]}"
        if error is None:
            return library
        library = error
    note_once(f"fallback {kernel.stem}", f"the {kernel.name} is not used, qkv runs its portable path: {library}")
    return library


def _first_error_line(output: str) -> str:
    """The line of a compiler's output that names the problem: its first ``error`` line, else
    its first line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[0] if lines else ""


def _load(kernel: NativeKernel) -> Outcome:
    """The kernel's library, compiled first when the cache has none; or why not."""
    target = kernel.library_path()
    if not target.is_file():
        failure = _compile(kernel, target)
        if failure is not None:
            return failure
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:  # e.g. a symbol of this torch that the library expected is missing
        return f"its library did not load ({str(error).strip()[:200]})"


def _compile(kernel: NativeKernel, target: Path) -> str | None:
    """Compile ``kernel`` into ``target`` (written under another name, then renamed into
    place): None, or why it failed."""
    reason = _toolchain_reason(_compiler_name())
    if reason is not None:
        return reason
    partial = target.with_name(f".{target.stem}.{os.getpid()}.{threading.get_ident()}.so")
    command = compile_command(kernel, partial)
    note_once(f"build {target.parent.name}", f"building {kernel.stem} (the {kernel.name}) into {target.parent} ...")
    started = time.perf_counter()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(command, capture_output=True, text=True, timeout=_COMPILE_SECONDS, check=False)
    except (OSError, subprocess.SubprocessError) as error:  # no such program, not executable, stuck
        partial.unlink(missing_ok=True)
        return f"its build failed ({type(error).__name__}: {str(error).strip()[:200]})"
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        line = _first_error_line(done.stderr + done.stdout) or f"{command[0]} exited with {done.returncode}"
        return f"its build failed ({line[:200]})"
    os.replace(partial, target)
    note_once(f"built {target.parent.name}", f"building {kernel.stem} ... done in {time.perf_counter() - started:.1f} s")
    return None
