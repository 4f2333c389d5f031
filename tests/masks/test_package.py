"""The masks package's place in the architecture: kernels import masks, never the reverse."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import qkv.masks

PACKAGE = Path(qkv.masks.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (a lazy import counts)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_mask_module_imports_the_kernels_or_anything_above_them() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "_base.py", "_layout.py", "_interval.py", "_data.py", "_opaque.py", "_varlen.py"}
    # the package itself, the shared argument checks, and qkv._private (the bottom of the import
    # order: whether a tensor can be read on the host while torch.compile / vmap traces)
    allowed = {"qkv.masks", "qkv._checks", "qkv._private"}
    for path in files:
        ours = {name for name in _imported_modules(path) if name == "qkv" or name.startswith("qkv.")}
        outside = {name for name in ours if not any(name == a or name.startswith(a + ".") for a in allowed)}
        assert not outside, f"{path.name} imports {sorted(outside)}"


def test_importing_the_masks_loads_no_kernel() -> None:
    code = "import sys, qkv.masks; print(sorted(m for m in sys.modules if m.startswith('qkv.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "qkv.masks._layout" in loaded  # the measurement sees the package's own modules
    assert "qkv.kernels" not in loaded and "qkv.attention.functional" not in loaded


def test_public_names_are_the_ones_users_import() -> None:
    for name in ("causal", "sliding_window", "documents", "key_padding", "prefix_lm", "predicate", "dense",
                 "varlen", "padded", "Mask", "Combined", "Causal", "SlidingWindow", "PrefixLM", "Documents",
                 "KeyPadding", "Predicate", "Dense", "Varlen", "Padded", "BlockLayout", "EMPTY", "PARTIAL", "FULL"):
        assert name in qkv.masks.__all__ and hasattr(qkv.masks, name)
    # each family's class and constructor live in one private module
    assert qkv.masks.causal.__module__ == qkv.masks.Causal.__module__ == "qkv.masks._interval"
    assert qkv.masks.documents.__module__ == qkv.masks.KeyPadding.__module__ == "qkv.masks._data"
    assert qkv.masks.predicate.__module__ == qkv.masks.Dense.__module__ == "qkv.masks._opaque"
    assert qkv.masks.BlockLayout.__module__ == "qkv.masks._layout"
