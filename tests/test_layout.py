"""The source layout of docs/design.md: data flows one way, and no module imports itself back.

Every ``import`` of a qkv module counts, at the top of a file or inside a function (a lazy
import is still a dependency); imports under ``if TYPE_CHECKING:`` do not run and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qkv

SOURCE = Path(qkv.__file__).parent

# From the top of the flow to its bottom; a module may import its own layer or a lower one.
LAYERS: list[tuple[str, ...]] = [
    ("qkv", "qkv.__main__", "qkv.cli"),
    ("qkv.examples", "qkv.viz", "qkv.bench"),
    ("qkv.models", "qkv.integrations"),
    ("qkv.inspect",),
    ("qkv.nn", "qkv.compat", "qkv.distributed"),
    ("qkv.attention",),
    ("qkv.backends",),
    ("qkv.native", "qkv.masks", "qkv.bias", "qkv.scores"),
    ("qkv.reference", "qkv._log", "qkv._checks", "qkv._private", "qkv._aliases"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SOURCE.rglob("*.py")}


def layer_of(name: str) -> int:
    best, depth = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    if best < 0:
        raise AssertionError(f"{name} is in no layer of LAYERS; add it where docs/design.md puts it")
    return best


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def runtime_imports(name: str) -> set[str]:
    """The qkv modules that ``name`` imports when it runs (lazy imports included)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "qkv":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in MODULES else _resolve(node.module)
                if target:
                    found.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qkv" and (target := _resolve(alias.name)):
                    found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(MODULES[name].read_text(encoding="utf-8")))
    found.discard(name)
    return found


GRAPH = {name: runtime_imports(name) for name in MODULES}


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target) < layer_of(name)
    ]
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    # the check above must be able to fail: a -> b -> c -> a is one circle, d stands apart
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_reference_depends_on_numpy_alone() -> None:
    tree = ast.parse(MODULES["qkv.reference"].read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"numpy", "__future__", "dataclasses", "typing", "collections", "math"}


def test_attention_is_the_function_after_its_package_is_imported() -> None:
    import qkv.attention.dispatch

    assert callable(qkv.attention) and qkv.attention.__module__ == "qkv.attention.functional"


def test_the_nn_package_names_its_classes() -> None:
    """``qkv.nn.MultiHeadAttention``, as a reader of the layout expects (formerly only
    ``qkv.nn.multihead.MultiHeadAttention`` and ``qkv.MultiHeadAttention``)."""
    import qkv.nn
    from qkv.nn import cache, multihead, paged_cache

    assert qkv.nn.MultiHeadAttention is multihead.MultiHeadAttention is qkv.MultiHeadAttention
    assert qkv.nn.KVCache is cache.KVCache and qkv.nn.PagedKVCache is paged_cache.PagedKVCache
    assert sorted(qkv.nn.__all__) == ["KVCache", "MultiHeadAttention", "PagedKVCache"]
    with pytest.raises(AttributeError, match="no attribute 'Transformer'"):
        qkv.nn.Transformer  # noqa: B018


@pytest.mark.parametrize("old", ["qkv.functional", "qkv.modules", "qkv.positional", "qkv.dispatch"])
def test_old_import_paths_still_work_and_warn(old: str) -> None:
    import importlib
    import sys

    from qkv._aliases import MOVED

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
