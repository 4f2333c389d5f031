"""Building qkv's C++ kernels on this machine, once, with a reason whenever one cannot run.

Each compiled kernel of qkv (a ``.cpp`` file next to its Python module) is built the first
time it is needed with ``torch.utils.cpp_extension`` and cached in PyTorch's folder for
extensions (``TORCH_EXTENSIONS_DIR`` when set), in a folder named by the hash of the source,
the compiler flags, the torch version and the Python ABI (`build_folder`): a change of any of
them builds anew, an unchanged
build is loaded in a second. Nothing here raises: a kernel that cannot be built is a
sentence saying why, and its caller falls back to a path that needs no compiler.

The flags below are those every kernel of qkv needs (AVX-512 with bf16 conversions for the
softmax and element-wise work, AMX for the products); a kernel adds its own checks after
loading (`build`'s ``check``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from qkv._log import note_once
from qkv.native.machine import cpu_features

__all__ = [
    "CFLAGS",
    "HEAD_MULTIPLE",
    "REQUIRED_TIER",
    "NativeKernel",
    "build",
    "build_folder",
    "built_once",
    "is_built",
    "onednn_packing_reason",
    "padded_heads",
    "static_reason",
]

# what the compiled code executes: AVX-512 (at::vec, bf16 conversions), AMX for the products
REQUIRED_TIER = "amx"
# -ffp-contract=off: a product and a difference written apart stay apart (GCC would fuse them
# into one FMA, whose unrounded product makes a softmax's max score differ from itself).
# -fopenmp: at::parallel_for is a header template whose OpenMP pragma is compiled into each
# module; without the flag it ran on one thread whatever torch's thread count (the interval
# kernel, sliding window n = 16,384, 2 threads: 88-97 ms without, 49-79 ms with, load 1.5-3.6)
CFLAGS = ["-O3", "-fopenmp", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-ffp-contract=off",
          "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma"]  # fmt: skip
# a build lock older than this was left by a killed build (a build takes about a minute)
_STALE_LOCK_SECONDS = 15 * 60
# one build at a time in this process (encoder batches run in threads): each kernel is built
# and checked once, and the cpp_extension logger's level is saved and restored by one thread
_BUILD_LOCK = threading.RLock()


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


def onednn_packing_reason(module: ModuleType) -> str | None:
    """Why a kernel that feeds oneDNN's micro-kernels its own VNNI panels cannot trust them
    here, or None: the module's ``micro_kernel_available()`` (``cpublas::could_pack``) and
    ``pack_matches()`` (its panels byte-equal to ``cpublas::pack``'s)."""
    if not module.micro_kernel_available():
        return "PyTorch's oneDNN cannot pack bfloat16 for its micro-kernel here (cpublas::could_pack)"
    if not module.pack_matches():
        return "oneDNN's packed layout for bfloat16 differs from the kernel's on this machine (pack_matches)"
    return None


def static_reason(dtype: torch.dtype, device: torch.device, needs_onednn: bool = False) -> str | None:
    """Why no compiled bf16 kernel of qkv can run for these inputs, from facts that need no
    build (dtype, device, the CPU tier, the switch, the tools), or None. ``needs_onednn``: the
    kernel calls oneDNN's micro-kernels (``cpublas::brgemm``), which refuse to run while
    ``torch.backends.mkldnn`` is switched off; that is checked on every call.

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
    if features.tier != REQUIRED_TIER or not features.avx512_bf16:
        return f"this CPU's tier is {features.describe()}; qkv's compiled kernels need {REQUIRED_TIER} (AVX-512 BF16 and AMX tiles)"
    if needs_onednn and not torch.backends.mkldnn.enabled:
        return "PyTorch's oneDNN is switched off (torch.backends.mkldnn.enabled is False)"
    return _toolchain_reason(os.environ.get("CXX", "c++"), _build_path())


def built_once(cache: dict[str, ModuleType | str], make: Callable[[], ModuleType | str]) -> ModuleType | str:
    """``cache["module"]``, made by ``make()`` the first time (one thread at a time): a kernel's
    one build attempt per process, the module or why there is none."""
    if "module" not in cache:
        with _BUILD_LOCK:
            if "module" not in cache:
                cache["module"] = make()
    return cache["module"]


def build_failure(cache: dict[str, ModuleType | str]) -> str | None:
    """Why the kernel's one build attempt of this process (`built_once`) failed, or None when
    it built or has not been tried yet."""
    outcome = cache.get("module")
    return outcome if isinstance(outcome, str) else None


def first_use_note(cache: dict[str, ModuleType | str]) -> str:
    """What `qkv.explain` adds to a kernel's name before its first build in this process."""
    return "" if isinstance(cache.get("module"), ModuleType) else ", built on first use (about a minute, once)"


def _build_path() -> str:
    """PATH for a build: the caller's, with the folder of the ``ninja`` package's binary (a
    dependency of qkv) appended, so that a venv used without activating it still builds."""
    search_path = os.environ.get("PATH", "")
    try:
        import ninja  # the PyPI package that ships the binary
    except ImportError:
        return search_path
    folder = str(getattr(ninja, "BIN_DIR", ""))
    return search_path if not folder or folder in search_path.split(os.pathsep) else search_path + os.pathsep + folder


# (compiler, PATH) -> why the build tools are missing, or None: two PATH scans, once per key
# (static_reason runs on every bf16 call of the engine); a dict, which torch.compile traces
_TOOLCHAIN: dict[tuple[str, str], str | None] = {}


def _toolchain_reason(compiler: str, search_path: str) -> str | None:
    """Why the build tools are missing, or None."""
    key = (compiler, search_path)
    if key not in _TOOLCHAIN:
        if shutil.which(compiler, path=search_path) is None:
            _TOOLCHAIN[key] = "no C++ compiler was found (c++ or $CXX)"
        elif shutil.which("ninja", path=search_path) is None:
            _TOOLCHAIN[key] = "ninja is not installed (torch.utils.cpp_extension builds with it)"
        else:
            _TOOLCHAIN[key] = None
    return _TOOLCHAIN[key]


@dataclass(frozen=True)
class NativeKernel:
    """One compiled kernel of qkv: its C++ source, how it is built, and its name in messages."""

    stem: str  # the module is qkv_<stem>_<hash>
    source: Path
    name: str  # e.g. "fused bf16 interval kernel", as explain and the build messages say it
    cflags: tuple[str, ...] = tuple(CFLAGS)
    duration: str = "about a minute"  # how long a cold build takes, said when it starts

    def folder(self) -> Path:
        """Its folder in the build cache (`build_folder`)."""
        return build_folder(self.stem, self.source, list(self.cflags))

    def is_built(self) -> bool:
        """Whether its finished build is in the cache."""
        return is_built(self.stem, self.source, list(self.cflags))


def build(kernel: NativeKernel, check: Callable[[ModuleType], str | None]) -> ModuleType | str:
    """Compile (or load the cached build of) ``kernel`` as the module ``qkv_<stem>_<hash>`` and
    run ``check`` on it: the module, or why there is none (the build's first error line, or
    what ``check`` returned). Its name and build duration are noted when it compiles, and how
    long it took when done (`qkv._log.note_once`: the ``qkv`` logger, once per build; a build
    or check that fails is noted once too)."""
    with _BUILD_LOCK:
        logger = logging.getLogger("torch.utils.cpp_extension")
        level = logger.level
        logger.setLevel(logging.ERROR)  # its CUDA notices (at import, at load) mean nothing on a CPU build
        try:
            module = _load(kernel.stem, kernel.source, kernel.name, list(kernel.cflags), kernel.duration)
        finally:
            logger.setLevel(level)  # the caller's logging as it was
        if isinstance(module, str):
            note_once(f"fallback {kernel.stem}", f"the {kernel.name} is not used, qkv runs its portable path: {module}")
            return module
        try:
            error = check(module)
        except Exception as failure:  # a check that raises is a reason to fall back too
            error = f"its check at load raised {type(failure).__name__}: {str(failure).strip()[:200]}"
        if error is not None:
            note_once(f"fallback {kernel.stem}", f"the {kernel.name} is not used, qkv runs its portable path: {error}")
        return module if error is None else error


def build_folder(stem: str, source: Path, cflags: list[str] | None = None) -> Path:
    """Where the build of ``source`` with ``cflags`` (default `CFLAGS`) lives: a folder of
    PyTorch's extension cache (``TORCH_EXTENSIONS_DIR`` when set) named by the hash of the
    source, the flags, the torch version and the Python ABI (two environments with the same
    torch but different Pythons never load each other's build). Nothing is created."""
    cpp_extension = _cpp_extension()
    text = source.read_text(encoding="utf-8")
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    key = "\n".join([text, " ".join(CFLAGS if cflags is None else cflags), torch.__version__, str(abi)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"qkv_{stem}_{digest}"


def is_built(stem: str, source: Path, cflags: list[str] | None = None) -> bool:
    """Whether a finished build of ``source`` is in the cache (`build_folder`): loading it then
    takes about a second, where building takes up to a minute."""
    folder = build_folder(stem, source, cflags)
    return any(folder.glob(f"{folder.name}*.so"))


@contextlib.contextmanager
def _path(search_path: str) -> Iterator[None]:
    """PATH set to ``search_path`` for a build (torch runs ``ninja`` from PATH), then restored."""
    before = os.environ.get("PATH")
    os.environ["PATH"] = search_path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _cpp_extension() -> ModuleType:
    """torch.utils.cpp_extension, imported without its CUDA notice (it logs a warning at import
    when no CUDA runtime is found, which means nothing for qkv's CPU builds)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _load(stem: str, source: Path, description: str, cflags: list[str], duration: str) -> ModuleType | str:
    cpp_extension = _cpp_extension()

    folder = build_folder(stem, source, cflags)
    name = folder.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = folder / "lock"  # torch's build lock; one left by a build that was killed blocks forever
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
        compiles = not any(folder.glob(f"{name}*.so"))
        if compiles:
            note_once(f"build {name}", f"compiling the {description} once ({duration}) into {folder}")
        started = time.perf_counter()
        with warnings.catch_warnings(), _path(_build_path()):
            warnings.simplefilter("ignore")
            module = cpp_extension.load(
                name=name, sources=[str(source)], extra_cflags=cflags, build_directory=str(folder),
                with_cuda=False, verbose=False,
            )  # fmt: skip
        if compiles:
            note_once(f"built {name}", f"built the {description} in {time.perf_counter() - started:.0f} s")
        return module
    except Exception as error:  # a failed build is a reason to fall back, never a traceback
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"its build failed ({first[:200]})"
