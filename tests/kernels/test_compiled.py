"""`qkv.native.build`, the one builder of qkv's C++ kernels: the compiler directly (no
torch.utils.cpp_extension, no ninja), a cache folder named by everything the library depends
on, a note per build with its time, and a failed build as one line naming its cause."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from qkv.native import build as compiled
from qkv.native import interval_bf16, inventory
from tests.kernels._compiler import ERROR_LINE, REASON, use_failing_compiler

# a kernel of three lines: extern "C", no torch header, the flags every kernel gets
_TINY = 'extern "C" long qkv_tiny_add(long a, long b) { return a + b; }\n'


def _tiny_kernel(folder: Path, text: str = _TINY) -> compiled.NativeKernel:
    source = folder / "tiny.cpp"
    source.write_text(text)
    return compiled.NativeKernel("tiny", source, "tiny test kernel")


def test_a_missing_compiler_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compiled._toolchain_reason("qkv-no-such-compiler") == (
        "no C++ compiler was found (qkv-no-such-compiler; set $CXX to choose one)"
    )
    monkeypatch.setenv("CXX", "qkv-no-such-compiler")
    monkeypatch.delenv("QKV_NO_COMPILED_KERNELS", raising=False)
    reason = compiled.static_reason(torch.bfloat16, torch.device("cpu"))
    assert reason is not None  # the tier's reason on a machine without AMX, else the compiler's
    assert "qkv-no-such-compiler" in reason or "tier is" in reason


def test_a_kernel_builds_loads_and_comes_from_the_cache_the_second_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    kernel = _tiny_kernel(tmp_path)
    if compiled._toolchain_reason(compiled._compiler_name()) is not None:  # no compiler here: the reason instead
        assert compiled.build(kernel, lambda library: None) == compiled._toolchain_reason(compiled._compiler_name())
        return
    with caplog.at_level(logging.INFO, logger="qkv"):
        library = compiled.build(kernel, lambda library: None)
    assert isinstance(library, ctypes.CDLL), library
    add = compiled.function(library, "qkv_tiny_add", ctypes.c_long, ctypes.c_long, ctypes.c_long)
    assert add(2**40, 5) == 2**40 + 5  # 64-bit arguments: the declared C types are used
    assert kernel.is_built() and kernel.library_path().parent == kernel.folder()
    assert kernel.folder().parent == tmp_path / "cache" and kernel.folder().name.startswith("qkv_tiny_")
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("building tiny ... done in ")]
    assert len(done) == 1 and done[0].endswith(" s")
    assert [p.name for p in kernel.folder().iterdir()] == ["qkv_tiny.so"]  # no partial file left
    monkeypatch.setattr(compiled, "_compile", lambda kernel, target: pytest.fail("compiled again"))
    assert isinstance(compiled.build(kernel, lambda library: None), ctypes.CDLL)


def test_a_failed_build_is_the_compilers_error_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    use_failing_compiler(monkeypatch, tmp_path)
    kernel = _tiny_kernel(tmp_path)
    assert compiled.build(kernel, lambda library: None) == REASON
    assert "error" in ERROR_LINE and not kernel.is_built()
    assert compiled._first_error_line("a.cpp: In function f:\na.cpp:3:1: error: x\nmore") == "a.cpp:3:1: error: x"
    assert compiled._first_error_line("ld: cannot find -lfoo\n") == "ld: cannot find -lfoo"


def test_a_check_that_fails_or_raises_is_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    kernel = _tiny_kernel(tmp_path)
    missing = compiled._toolchain_reason(compiled._compiler_name())
    if missing is not None:  # no compiler here: that is the reason, whatever the check
        assert compiled.build(kernel, lambda library: "unused") == missing
        return
    assert compiled.build(kernel, lambda library: "its self-check failed (x)") == "its self-check failed (x)"

    def raising(library: ctypes.CDLL) -> str | None:
        raise AttributeError("no such symbol")

    assert compiled.build(kernel, raising) == "its check at load raised AttributeError: no such symbol"


def test_the_cache_key_covers_source_compiler_flags_tier_torch_and_python(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("QKV_CPU_TIER", raising=False)
    kernel = interval_bf16.BUILDS["amx"]
    here = kernel.folder()
    assert here.name.startswith("qkv_interval_bf16_") and kernel.folder() == here  # stable
    assert dataclasses.replace(kernel, cflags=(*kernel.cflags, "-DQKV_OTHER")).folder() != here
    copy = tmp_path / "interval_bf16.cpp"
    copy.write_text(kernel.source.read_text() + "// one more comment\n")
    assert dataclasses.replace(kernel, source=copy).folder() != here
    with monkeypatch.context() as patch:
        patch.setenv("QKV_CPU_TIER", "avx2")
        assert kernel.folder() != here
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.0+other")
        assert kernel.folder() != here
    with monkeypatch.context() as patch:
        patch.setattr(sysconfig, "get_config_var", lambda name: "cpython-399-other" if name == "SOABI" else None)
        other = kernel.folder()
        assert other != here and other.parent == here.parent
    with monkeypatch.context() as patch:
        use_failing_compiler(patch, tmp_path)  # another compiler (and another cache folder)
        assert kernel.folder().name != here.name


def test_the_cache_key_follows_the_headers_a_source_includes_from_its_folder(tmp_path: Path) -> None:
    """decode.cpp and short_wide.cpp share vectors.h: a change there must rebuild both."""
    (tmp_path / "shared.h").write_text("inline int one() { return 1; }\n")
    source = tmp_path / "kernel.cpp"
    source.write_text('#include <cstdint>\n#include "shared.h"\n#include "absent.h"\nint f() { return one(); }\n')
    kernel = compiled.NativeKernel("header_probe", source, "header probe")
    assert compiled.local_headers(source) == [tmp_path / "shared.h"]  # system and missing headers are not read
    before = kernel.folder()
    (tmp_path / "shared.h").write_text("inline int one() { return 2; }\n")
    assert kernel.folder() != before


def test_the_two_builds_of_an_interval_kernel_are_cached_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The amx build calls oneDNN's micro-kernel, the avx512 build its own (QKV_DPBF16_PRODUCTS):
    two libraries, and the avx512 one keyed by its own tier whatever the machine's."""
    amx, avx512 = interval_bf16.BUILDS["amx"], interval_bf16.BUILDS["avx512"]
    assert "-DQKV_DPBF16_PRODUCTS" in avx512.cflags and "-DQKV_DPBF16_PRODUCTS" not in amx.cflags
    assert amx.folder() != avx512.folder() and avx512.folder().name.startswith("qkv_interval_bf16_avx512_")
    here = avx512.folder()
    monkeypatch.setenv("QKV_CPU_TIER", "avx2")
    assert avx512.folder() == here and "tier avx512" in compiled.cache_key(avx512)
    headers = [avx512.source.with_name(name) for name in ("products_bf16.h", "score_terms_bf16.h")]
    assert compiled.local_headers(avx512.source) == headers
    assert all(header.read_text(encoding="utf-8") in compiled.cache_key(avx512) for header in headers)


def test_the_cache_key_names_the_compiler_version_and_the_torch_build() -> None:
    key = compiled.cache_key(interval_bf16.BUILDS["amx"])
    compiler = shutil.which(compiled._compiler_name())
    if compiler is not None:
        assert str(Path(compiler).resolve()) in key
    assert f"torch {torch.__version__} {torch.version.git_version}" in key
    assert f"tier {inventory.compiled.cpu_features().tier}" in key
    assert " ".join(interval_bf16.BUILDS["amx"].cflags) in key


def test_only_the_kernels_that_call_aten_link_torch() -> None:
    """A kernel that includes no torch header builds without torch's include folder, and only
    the interval pair (oneDNN's micro-kernels, Sleef's log) links libtorch_cpu."""
    builds = [build for m in inventory._MODULES for build in (m.BUILDS.values() if hasattr(m, "BUILDS") else [m.native()])]
    linked = {b.stem for b in builds if "-ltorch_cpu" in compiled.compile_command(b, Path("x.so"))}
    assert linked == {"interval_bf16", "interval_bf16_backward", "interval_bf16_avx512", "interval_bf16_backward_avx512"}
    for build in builds:
        text = build.source.read_text()
        assert "#include <torch/extension.h>" not in text and "PYBIND11_MODULE" not in text
        assert ("#include <ATen/" in text) == build.torch_headers
