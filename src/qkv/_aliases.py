"""The import paths of qkv 0.1 that moved, kept working for one release with a warning, and
the names a package resolves on first use (`lazy_names`).

``import qkv.functional`` (and the rest of `MOVED`) gives the module at its new path, the same
module object, and warns once per old path with a `DeprecationWarning` that names the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install", "lazy_names"]

# old path -> new path; the new layout is described in docs/design.md
MOVED: dict[str, str] = {
    "qkv.functional": "qkv.attention.functional",
    "qkv.dispatch": "qkv.attention.dispatch",
    "qkv.varlen": "qkv.attention.varlen",
    "qkv.modules": "qkv.nn.multihead",
    "qkv.positional": "qkv.nn.positional",
    "qkv.cache": "qkv.nn.cache",
    "qkv.paged_cache": "qkv.nn.paged_cache",
    "qkv.interop": "qkv.nn.interop",
    "qkv.inspect_steps": "qkv.inspect.steps",
    "qkv.inspect_roles": "qkv.inspect.roles",
    "qkv.inspect_rollout": "qkv.inspect.rollout",
    "qkv.inspect_pronoun": "qkv.inspect.pronoun",
    "qkv.kernels.machine": "qkv.native.machine",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        # the module ran at its new path; binding the old name to it is all there is to do
        return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            if fullname == "qkv.kernels":  # the old package of qkv.kernels.machine
                return importlib.machinery.ModuleSpec(fullname, _Package(), is_package=True)
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


class _Package(importlib.abc.Loader):
    """An empty package standing for a folder that moved, so that its old modules resolve."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = []


def install() -> None:
    """Put the finder on `sys.meta_path` once (after the normal finders: real modules win)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())


def lazy_names(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name of ``exports`` (name -> the module
    that defines it) is imported on first use and kept in the package, so that importing the
    package imports none of them (the HTML viewer never loads matplotlib, ``qkv --help`` never
    loads torch)."""

    def resolve(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return resolve
