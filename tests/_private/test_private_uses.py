"""Every use of another library's private API lives in `qkv._private` (docs/design.md): the
source outside it is read with `ast`, so comments and docstrings that name a private function
do not count, and an attribute chain or import that reaches a private name of torch, typer or
transformers fails the test with its file and line."""

from __future__ import annotations

import ast
from pathlib import Path

import qkv

SOURCE = Path(qkv.__file__).resolve().parent
LIBRARIES = ("torch", "typer", "transformers", "click")
# Private attributes read on objects of those libraries whatever they are bound to.
PRIVATE_ATTRIBUTES = {"_global_mapping", "_active_collector", "_forward_hooks", "_forward_pre_hooks",
                      "_backward_hooks", "_backward_pre_hooks"}  # fmt: skip


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.relative_to(SOURCE.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            names = [alias.name for alias in node.names]
            if parts[0] in LIBRARIES and (any(map(_private, parts)) or any(map(_private, names))):
                found.append(f"{where} from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES and any(map(_private, parts)):
                    found.append(f"{where} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain is not None and chain[0] in LIBRARIES and _private(chain[-1]):
                found.append(f"{where} {'.'.join(chain)}")
            elif node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"{where} .{node.attr}")
    return found


def test_private_apis_are_used_only_in_qkv_private() -> None:
    outside = [p for p in sorted(SOURCE.rglob("*.py")) if "_private" not in p.relative_to(SOURCE).parts]
    assert len(outside) > 50  # the walk found the package
    uses = [use for path in outside for use in _uses(path)]
    assert uses == []
