"""`qkv.native.build`'s build tools: ninja comes with qkv (the ``ninja`` package), so a build
finds it even when the venv's bin folder is not on PATH; the cache folder's name covers the
source, flags, torch and the Python ABI."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import ninja
import pytest

from qkv.native import build as compiled
from qkv.native import interval_bf16


def test_ninja_from_the_package_is_found_without_it_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(ninja.BIN_DIR)
    compiler = shutil.which("c++") or shutil.which("g++")
    monkeypatch.setenv("PATH", "" if compiler is None else str(Path(compiler).parent))
    path = compiled._build_path()
    assert folder in path.split(os.pathsep)
    assert shutil.which("ninja", path=path) is not None
    if compiler is not None and shutil.which("ninja", path=str(Path(compiler).parent)) is None:
        assert compiled._toolchain_reason("c++", path) is None  # the package's ninja is enough


def test_a_missing_compiler_is_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert compiled._toolchain_reason("qkv-no-such-compiler", str(tmp_path)) == "no C++ compiler was found (c++ or $CXX)"


def test_the_cache_folder_depends_on_the_python_abi(monkeypatch: pytest.MonkeyPatch) -> None:
    native = interval_bf16.NATIVE
    here = native.folder()
    assert here.name.startswith("qkv_interval_bf16_")
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "cpython-399-other" if name == "SOABI" else None)
    assert native.folder() != here and native.folder().parent == here.parent
