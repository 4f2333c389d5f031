"""qkv: attention as the seed articles teach it, verified against the kernels people run.

The public API is re-exported here. Names are resolved lazily so that ``qkv --help`` and
``import qkv.reference`` do not pay for importing PyTorch.

    >>> import torch, qkv
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> qkv.attention(q, k, v).shape
    torch.Size([1, 2, 4, 8])
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from qkv import _aliases, _log  # _log: the qkv logger and its NullHandler, before any module logs

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "attention": "qkv.attention.functional",
    "explain": "qkv.attention.functional",
    "attention_weights": "qkv.attention.functional",
    "Explanation": "qkv.attention.functional",
    "MultiHeadAttention": "qkv.nn.multihead",
    "KVCache": "qkv.nn.cache",
    "KVBounds": "qkv.attention.bounds",
    "PagedKVCache": "qkv.nn.paged_cache",
    "attention_varlen": "qkv.attention.varlen",
}
_SUBMODULES = ("bias", "compat", "masks", "reference", "models", "examples", "viz", "distributed", "nn", "backends", "native", "inspect")
# moved in 0.2, kept for one release (qkv._aliases warns when they are imported)
_OLD_SUBMODULES = {"functional": "qkv.functional", "positional": "qkv.positional", "modules": "qkv.modules", "interop": "qkv.interop"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])

if TYPE_CHECKING:
    from qkv import (
        backends,
        bias,
        compat,
        distributed,
        examples,
        inspect,
        masks,
        models,
        native,
        nn,
        reference,
        viz,
    )
    from qkv.attention.bounds import KVBounds
    from qkv.attention.functional import Explanation, attention, attention_weights, explain
    from qkv.attention.varlen import attention_varlen
    from qkv.nn.cache import KVCache
    from qkv.nn.multihead import MultiHeadAttention
    from qkv.nn.paged_cache import PagedKVCache


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"qkv.{name}")
        globals()[name] = module
        return module
    if name in _OLD_SUBMODULES:
        return importlib.import_module(_OLD_SUBMODULES[name])  # warns through qkv._aliases
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """qkv itself: ``qkv.attention`` stays the function when its package is imported.

    Importing ``qkv.attention.dispatch`` makes Python bind the package ``qkv.attention`` as an
    attribute of qkv; the package is still reached through `sys.modules` and ``from`` imports.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "attention" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def _notebook_html(inspection: Any) -> str:
    """How Jupyter shows an `Inspection`: the viewer in a sandboxed iframe."""
    from qkv.viz.viewer import render_inline

    return render_inline(inspection)


def _show_inspections_in_notebooks() -> None:
    """Register the viewer with IPython by type name, so nothing is imported now (inspect
    never imports viz; the registration lives here, above both)."""
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    formatters = getattr(getattr(shell, "display_formatter", None), "formatters", None)
    if formatters is not None and "text/html" in formatters:
        formatters["text/html"].for_type_by_name("qkv.inspect.inspection", "Inspection", _notebook_html)


sys.modules[__name__].__class__ = _Package
_aliases.install()
_show_inspections_in_notebooks()
